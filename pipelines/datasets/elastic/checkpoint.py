"""Every host's pipeline state from a checkpoint, as Orbax's Grain handler writes them.

Grain's `CheckpointHandler` (what Orbax saves a Grain iterator with) writes one JSON state per
process, `process_<i>-of-<N>.json`, and restores the one of its own index and count, which a
run on another number of hosts does not have. `read_host_states` reads all of them, checked
(one run, every process once), as the state `make_training_pipeline`'s iterator restores on
any layout; `ElasticCheckpointHandler` is Grain's handler whose restore does that where its
own file is missing.

Example::

    it.set_state(read_host_states("ckpt/step_1000/data_iter"))   # any number of hosts

    import orbax.checkpoint as ocp
    mngr = ocp.CheckpointManager(path, item_handlers={"data": ElasticCheckpointHandler()})
"""

from __future__ import annotations

import re
from typing import Any

from seqpack.pipelines.datasets.elastic.hosts import HOSTS
from seqpack.pipelines.errors import InputError

_NAME = re.compile(r"process_(\d+)-of-(\d+)\.json")


def read_host_states(directory: Any) -> dict[str, Any]:
    """`{"hosts": [state of process 0, ..., state of process N-1]}` from the
    `process_<i>-of-<N>.json` files in `directory` (a path, `epath.Path` or URL); InputError
    naming the directory for none, several counts or a missing process, and naming the file
    for one that is not a JSON state."""
    from seqpack.pipelines import storage

    where = str(directory)
    try:
        names = [n for n in storage.sizes(where) if _NAME.fullmatch(n)]
    except FileNotFoundError:
        names = []
    counts = {int(_NAME.fullmatch(n).group(2)) for n in names}  # type: ignore[union-attr]
    if not names:
        raise InputError(f"{where} holds no process_<i>-of-<N>.json state (Grain's checkpoint "
                         "files): pass the directory Orbax wrote the data iterator's state to")
    if len(counts) != 1:
        raise InputError(f"{where} holds the states of runs of {sorted(counts)} processes; "
                         "keep one checkpoint's files in a directory")
    N = counts.pop()
    have = {int(_NAME.fullmatch(n).group(1)) for n in names}  # type: ignore[union-attr]
    missing = sorted(set(range(N)) - have)
    if missing:
        raise InputError(f"{where}: the states of processes {missing} of {N} are missing "
                         f"(process_{missing[0]}-of-{N}.json ...); every host's state is "
                         "needed to restore on another number of hosts")
    return {HOSTS: [storage.read_json(storage.join(where, f"process_{i}-of-{N}.json"))
                    for i in range(N)]}


def _process_index_and_count() -> tuple[int, int]:
    """The process index and count Grain's handler names its files by (jax's, else 0 of 1)."""
    try:
        import jax
    except ImportError:
        return 0, 1
    return jax.process_index(), jax.process_count()


def _handler_base() -> type:
    import grain.checkpoint

    return grain.checkpoint.CheckpointHandler


class ElasticCheckpointHandler(_handler_base()):  # type: ignore[misc]
    """Grain's Orbax `CheckpointHandler` (one state per process) whose restore, where this
    process's file of this process count is missing (the run's host count changed), reads
    every process's state (`read_host_states`)."""

    def restore(self, directory: Any, item: Any = None, args: Any = None) -> Any:
        item = item or args.item
        index, count = _process_index_and_count()
        if (directory / f"process_{index}-of-{count}.json").exists():
            return super().restore(directory, item=item)
        item.set_state(read_host_states(directory))
        return item
