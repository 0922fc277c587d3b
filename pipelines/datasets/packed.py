"""Packed rows (the output of `seqpack pack`) as a training input: no second packing.

Rows are shuffled over the whole dataset once per epoch (seeded, reshuffled every epoch): that
global order, epoch after epoch, is cut into global steps of G = H x batch_size rows, and host h
of H takes the h-th block of batch_size rows of each step (so every row is in exactly one shard
per epoch, and the global batch of a step is the same on any number of hosts). The state names
the global position (`GlobalRowBatches`): any host's state restores a run on any number of
hosts, with any batch size, with nothing repeated or lost.

Balanced datasets (`seqpack pack --data-parallel D --batch-size b`, manifest
``row_order = {"mode": "balanced", "data_parallel": D, "batch_size": b, ...}``) are laid out so
that rank r of step s reads rows [(s*D + r)*b, (s*D + r + 1)*b). Read with H hosts of n local
devices each (H * n = D, global rank r = h * n + local device), host h's batch of step s is the
n*b rows [(s*D + h*n)*b, (s*D + (h + 1)*n)*b): its ranks' rows, back to back, so splitting the
host batch into n equal slices in local-device order gives every rank its balanced rows. The
per-epoch shuffle moves whole steps (D*b rows), the same permutation on every host. Worked
example (D = 4, b = 2, H = 2, so n = 2 and batch_size = 4)::

    rows      0 1 | 2 3 | 4 5 | 6 7 || 8 9 | 10 11 | 12 13 | 14 15     (two steps)
    ranks     r0    r1    r2    r3  || r0    r1      r2      r3
    host 0    step 0: rows 0-3        step 1: rows 8-11
    host 1    step 0: rows 4-7        step 1: rows 12-15
    epoch order of steps (seeded): e.g. [1, 0] -> host 0 reads rows 8-11, then 0-3

The rows of a final partial step are not read (every rank of a step needs b rows). The state
counts global steps, so a run restores on any H that divides D.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grain
import numpy as np

from seqpack.packer import PackConfig
from seqpack.pipelines.datasets.elastic import grain_worker_states
from seqpack.pipelines.datasets.sources import SequentialIterator, SequentialIterDataset
from seqpack.pipelines.errors import InputError

log = logging.getLogger("seqpack")


def check_shape(source: Any, pack: PackConfig | None) -> None:
    """ValueError when a given pack config's seq_len / max_segments differ from the packed
    rows' (the rest of it does not apply: the rows are packed already)."""
    if pack is None:
        return
    for name in ("seq_len", "max_segments"):
        given, have = getattr(pack, name), getattr(source, name, None)
        if have is not None and given != have:
            raise ValueError(f"{name}={given} but the packed rows have {name}={have} (from "
                             f"their manifest); pass a PackConfig with {name}={have}, or no pack")


def balanced_layout(source: Any, *, batch_size: int, shard_count: int, drop_remainder: bool,
                    local_devices: int | None) -> tuple[int, int]:
    """(D, b) of a balanced dataset read by `shard_count` hosts (of `local_devices` devices
    each, when known) with host batches of `batch_size` rows; ValueError naming every number
    when they do not fit together."""
    order = getattr(getattr(source, "manifest", None), "row_order", None) or {}
    D, b = int(order["data_parallel"]), int(order["batch_size"])
    what = (f"the dataset is balanced for data_parallel={D} ranks of batch_size={b} rows per "
            f"step (manifest row_order)")
    if D % shard_count:
        raise ValueError(f"{what}; shard_count={shard_count} hosts must divide {D} (hosts x "
                         "local devices = data_parallel); pass Balance(steps=False) to read "
                         "it as plain rows")
    if local_devices is not None and shard_count * local_devices != D:
        raise ValueError(f"{what}, but {shard_count} processes x {local_devices} local devices "
                         f"= {shard_count * local_devices} ranks; repack for this topology, "
                         "pass Batching(shard_index=, shard_count=) to read it as if it were "
                         f"(each host {D // shard_count} ranks' rows), or Balance(steps=False)")
    per_host = D // shard_count * b
    if batch_size != per_host:
        raise ValueError(f"{what}; batch_size={batch_size} is the rows per host per step: each "
                         f"of shard_count={shard_count} hosts reads its {D // shard_count} "
                         f"ranks' {b} rows, so pass batch_size={per_host}")
    if not drop_remainder:
        raise ValueError(f"{what}; drop_remainder=False: a balanced dataset is read in whole "
                         "steps only (pass drop_remainder=True)")
    if len(source) < D * b:
        raise ValueError(f"{what} but holds {len(source)} rows, less than one step ({D * b})")
    return D, b


def is_balanced(source: Any) -> bool:
    order = getattr(getattr(source, "manifest", None), "row_order", None)
    return isinstance(order, Mapping) and order.get("mode") == "balanced"


_POOLS: dict[tuple[int, int], ThreadPoolExecutor] = {}  # (pid, threads) -> its pool


def read_rows(rows: grain.MapDataset, positions: Iterable[int], threads: int
              ) -> dict[str, np.ndarray]:
    """The rows at `positions`, stacked in order; `threads` > 1: read that many at once (rows
    that wait on storage: `Prefetch.read_threads`), by one pool per process."""
    positions = list(positions)
    if threads > 1 and len(positions) > 1:
        key = (os.getpid(), threads)
        pool = _POOLS.get(key) or _POOLS.setdefault(
            key, ThreadPoolExecutor(threads, thread_name_prefix="seqpack-rows"))
        got = list(pool.map(rows.__getitem__, positions))
    else:
        got = [rows[i] for i in positions]
    return {k: np.stack([r[k] for r in got]) for k in got[0]}


class HostSteps(grain.MapDataset):
    """Element k: host `shard_index`'s batch of step k of a balanced dataset (rows stacked)."""

    def __init__(self, rows: grain.MapDataset, *, step_rows: int, first: int, count: int,
                 read_threads: int = 0):
        super().__init__(rows)
        self._rows, self._step_rows, self._first, self._count = rows, step_rows, first, count
        self._n = len(rows) // step_rows
        self._threads = read_threads

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        base = (int(index) % self._n) * self._step_rows + self._first
        return read_rows(self._rows, range(base, base + self._count), self._threads)

    def __str__(self) -> str:
        return f"HostSteps(steps={self._n}, rows {self._first}..+{self._count} of each)"


def packed_batches(source: Any, *, batch_size: int, shuffle_seed: int, num_epochs: int | None,
                   shard_index: int, shard_count: int, drop_remainder: bool,
                   balanced_steps: bool | None, local_devices: int | None,
                   read_threads: int = 0) -> grain.IterDataset:
    """Batches of packed rows (see the module docstring); `balanced_steps` None follows the
    manifest, False reads a balanced dataset as plain rows; `local_devices` (None: unknown)
    is checked against a balanced layout; `read_threads`: rows read at once (`read_rows`)."""
    rows = source if isinstance(source, grain.MapDataset) else grain.MapDataset.source(source)
    if balanced_steps is None:
        balanced_steps = is_balanced(source)
    elif balanced_steps and not is_balanced(source):
        raise ValueError("Balance(steps=True) but the packed rows' manifest has no balanced "
                         "row_order (pack with data_parallel=D and batch_size=b)")
    if balanced_steps:
        D, b = balanced_layout(source, batch_size=batch_size, shard_count=shard_count,
                               drop_remainder=drop_remainder, local_devices=local_devices)
        steps = HostSteps(rows, step_rows=D * b, first=shard_index * batch_size,
                          count=batch_size, read_threads=read_threads).shuffle(seed=shuffle_seed)
        left = len(rows) % (D * b)
        if left:
            log.warning("the last %d packed rows (a partial step of D=%d ranks x b=%d rows) are "
                        "not read: every rank of a step needs b rows", left, D, b)
        run = {**run_stamp(source, len(rows), shuffle_seed=shuffle_seed,
                           num_epochs=num_epochs), "ranks": D, "rank_rows": b}
        return BalancedSteps(steps if num_epochs == 1 else steps.repeat(num_epochs), run)
    if len(rows) < shard_count:
        raise ValueError(f"{len(rows)} packed rows cannot be dealt to {shard_count} hosts")
    run = run_stamp(source, len(rows), shuffle_seed=shuffle_seed, num_epochs=num_epochs)
    rows = rows.shuffle(seed=shuffle_seed)
    if num_epochs != 1:
        rows = rows.repeat(num_epochs)
    step_rows = batch_size * shard_count
    if drop_remainder and num_epochs is not None and len(rows) % step_rows:
        left = range(len(rows) - len(rows) % step_rows, len(rows))
        _dropped(rows, left[shard_index * batch_size:(shard_index + 1) * batch_size],
                 len(left), batch_size, getattr(source, "feature", "tokens"))
    return GlobalRowBatches(rows, batch_size=batch_size, shard_index=shard_index,
                            shard_count=shard_count, drop_remainder=drop_remainder,
                            read_threads=read_threads, run=run)


def run_stamp(source: Any, rows: int, *, shuffle_seed: int, num_epochs: int | None
              ) -> dict[str, Any]:
    """What a state of packed rows is valid for: the rows (their count, length and, where
    the manifest records them, a digest of the shards' digests), the seed and the epochs."""
    import hashlib

    manifest = getattr(source, "manifest", None)
    digests = getattr(manifest, "shard_sha256", None)
    return {"rows": rows, "seq_len": getattr(source, "seq_len", None), "seed": shuffle_seed,
            "num_epochs": num_epochs,
            "shards": hashlib.sha256("".join(digests).encode()).hexdigest()[:16]
            if digests else None}


class GlobalRowBatches(grain.IterDataset):
    """Host `shard_index`'s batches of `rows` (the global order of every row of every epoch):
    global step k is rows [k G, (k + 1) G), G = batch_size x shard_count, and host h takes its
    block [k G + h b, k G + (h + 1) b), so the hosts' batches side by side (a global array
    assembled in process order) are the global order itself: the same global batches on any
    number of hosts. A last, partial step is dropped on every host (drop_remainder) or dealt
    in turn (host h: positions h, h + H, ... of it).

    The state names the global position (the first row of the next step), so any host's state
    restores on any host count and batch size with nothing repeated or lost. In a worker
    process (`mp_prefetch` slices it), worker w of W makes steps w, w + W, ...: the batches
    and their order do not depend on the worker count."""

    def __init__(self, rows: grain.MapDataset, *, batch_size: int, shard_index: int,
                 shard_count: int, drop_remainder: bool, read_threads: int = 0,
                 run: Mapping[str, Any] | None = None):
        super().__init__()
        self._rows, self._drop, self._threads = rows, drop_remainder, read_threads
        self._run = dict(run or {})  # `run_stamp`: what a state restores into
        self._b, self._h, self._H = batch_size, shard_index, shard_count
        self._steps = (0, 1)  # (first step, stride): this copy's steps

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        """Called by Grain in each prefetch worker (on its copy of the dataset)."""
        if sequential_slice:
            raise ValueError("packed rows are read by steps in their global order: worker "
                             "processes take steps in turn (sequential_slice=False)")
        self._steps = (sl.start or 0, sl.step or 1)

    def __iter__(self) -> GlobalRowIterator:
        return GlobalRowIterator(self)

    def __str__(self) -> str:
        return (f"GlobalRowBatches(rows={len(self._rows)}, batch_size={self._b}, "
                f"shard {self._h} of {self._H})")


class GlobalRowIterator(grain.DatasetIterator):
    """Iterator of `GlobalRowBatches`; state {"position": the global row position of the next
    step, "steps": steps made, "shard_index", "shard_count", "batch_size"}. Restoring reads the
    position (any host count or batch size); a worker process reads its own step count, in
    the layout it was saved with (Grain hands every worker the state an unsliced iterator
    made: relative to the worker's own steps)."""

    def __init__(self, ds: GlobalRowBatches):
        super().__init__()
        self._ds = ds
        self._first, self._stride = ds._steps
        self._step_rows = ds._b * ds._H
        self._count = 0
        self._position = self._first * self._step_rows

    def __next__(self) -> dict[str, Any]:
        ds, start = self._ds, self._position
        n = len(ds._rows)
        if start + self._step_rows <= n:  # a whole step: this host's block of it
            mine = range(start + ds._h * ds._b, start + (ds._h + 1) * ds._b)
        elif ds._drop:
            raise StopIteration  # on every host: no host has a whole batch
        else:  # the last, partial step: dealt in turn, every host within a row of the others
            mine = range(start + ds._h, n, ds._H)
            if not len(mine):
                raise StopIteration
        self._position = min(start + self._stride * self._step_rows, n)  # n: finished
        self._count += 1
        return read_rows(ds._rows, mine, ds._threads)

    def get_state(self) -> dict[str, Any]:
        ds = self._ds
        return {"position": self._position, "steps": self._count, "shard_index": ds._h,
                "shard_count": ds._H, "batch_size": ds._b, "run": ds._run}

    def set_state(self, state: dict[str, Any]) -> None:
        ds = self._ds
        _check_stamp(state, ds._run)
        if (self._first, self._stride) == (0, 1):
            state = _one_state(state)  # (saved with worker processes: restored without)
            position, count = int(state["position"]), int(state.get("steps", 0))
        elif (state.get("shard_count"), state.get("batch_size")) != (ds._H, ds._b):
            raise ValueError(
                f"a worker state of a run with shard_count={state.get('shard_count')}, "
                f"batch_size={state.get('batch_size')} cannot restore a worker with "
                f"shard_count={ds._H}, batch_size={ds._b}: worker processes count their own "
                "steps, and another layout would repeat or lose rows. Restore without worker "
                "processes (Prefetch(worker_count=0)), which reads the global position, and "
                "save again")
        else:
            count = int(state["steps"])
            position = (self._first + count * self._stride) * self._step_rows
        if position < 0 or position > len(ds._rows):
            raise ValueError(f"state position={position} is outside the {len(ds._rows)} rows "
                             "of this run's epochs (a state of another dataset or num_epochs?)")
        self._position, self._count = position, count

    def __str__(self) -> str:
        return "GlobalRowIterator"


def _check_stamp(state: Any, run: Mapping[str, Any], key: str = "position") -> None:
    """InputError unless `state` is a state of packed rows (`key`: "position"; balanced
    steps: "next_index") saved over the same rows, seed and epochs (a state of an earlier
    version, without a stamp, is taken as it is)."""
    workers = worker_states(state) if isinstance(state, Mapping) else None
    for one in [state] if workers is None else workers:
        if isinstance(one, Mapping) and "online" in one:
            raise InputError("the state is one of online packing: restore it into a pipeline "
                             "over examples, not packed rows")
        if not isinstance(one, Mapping) or key not in one:
            what = sorted(one) if isinstance(one, Mapping) else type(one).__name__
            kind = "balanced steps" if key == "next_index" else "packed rows read as rows"
            raise InputError(f"the state is not a state of {kind} (keys: {what}); restore "
                             "the state this pipeline's iterator saved")
        saved = one.get("run")
        for field in sorted(set(saved or ()) | set(run)) if saved is not None else ():
            if saved.get(field) != run.get(field):
                raise InputError(f"the state was saved by another run: its {field} is "
                                 f"{saved.get(field)!r}, this pipeline's {run.get(field)!r}; "
                                 "restore into a pipeline over the same packed rows, "
                                 "shuffle_seed and num_epochs")


def worker_states(state: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The workers' states of a state saved with worker processes; None for one saved
    without (`elastic.hosts.grain_worker_states`)."""
    found = grain_worker_states(state)
    return None if found is None else [s for s in found.values() if s]


def _one_state(state: dict[str, Any]) -> dict[str, Any]:
    """A state saved with worker processes as one iterator's: the first step no worker had
    handed over (the least of their positions, each a worker's next step) and all their
    steps; a state saved without, as it is."""
    workers = worker_states(state)
    if workers is None:
        return state
    return {**workers[0], "position": min(int(s["position"]) for s in workers),
            "steps": sum(int(s["steps"]) for s in workers)}


class BalancedSteps(SequentialIterDataset):
    """A balanced dataset's steps in order (`SequentialIterDataset`), the state stamped with
    the run (`run_stamp`, D and b); a state saved with worker processes restores without them
    (worker w of W reads steps w, w + W, ...: the first step no worker handed over)."""

    def __init__(self, parent: grain.MapDataset, run: Mapping[str, Any]):
        super().__init__(parent)
        self._run = dict(run)

    def __iter__(self) -> _BalancedIterator:
        return _BalancedIterator(self._parent, self._run)


class _BalancedIterator(SequentialIterator):
    def __init__(self, parent: grain.MapDataset, run: dict[str, Any]):
        super().__init__(parent)
        self._run = run

    def get_state(self) -> dict[str, Any]:
        return {**super().get_state(), "run": self._run}

    def set_state(self, state: dict[str, Any]) -> None:
        _check_stamp(state, self._run, "next_index")
        found = grain_worker_states(state)
        if found is not None:  # saved with W workers, restored without
            W = len(found)
            state = {"next_index": min(w + int(s["next_index"]) * W
                                       for w, s in found.items() if s)}
        super().set_state(state)


class WorkerLayout(grain.IterDataset):
    """Packed rows' pipeline of `workers` processes: a state restores on the worker count it
    was saved with, or without workers (the global position); another count is a ValueError
    saying so (Grain's own restore would fail inside)."""

    def __init__(self, parent: grain.IterDataset, workers: int):
        super().__init__(parent)
        self._workers = workers

    def __iter__(self) -> grain.DatasetIterator:
        return _WorkerLayoutIterator(self._parent.__iter__(), self._workers)


class _WorkerLayoutIterator(grain.DatasetIterator):
    def __init__(self, parent: grain.DatasetIterator, workers: int):
        super().__init__(parent)
        self._workers = workers

    def __next__(self) -> dict[str, Any]:
        return next(self._parent)

    def get_state(self) -> dict[str, Any]:
        return self._parent.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        saved = worker_states(state)
        if self._workers and (saved is None or len(saved) != self._workers):
            raise ValueError(
                f"a state saved with {len(saved) if saved else 0} worker process(es) cannot "
                f"restore {self._workers}: restore it with Prefetch(worker_count="
                f"{len(saved) if saved else 0}) or worker_count=0 (which reads the global "
                "position, on any host count), and save again")
        self._parent.set_state(state)


class FullBatches(grain.IterDataset):
    """Rows packed on the fly in batches of `batch_size`, a last, short batch (the end of the
    data: `num_epochs`) dropped with a warning naming its rows and tokens, as packed rows'
    is (Grain's `batch(drop_remainder=True)` drops it without a word). The state is Grain's
    batch's: a checkpoint restores either way."""

    def __init__(self, rows: grain.IterDataset, batch_size: int, feature: str):
        super().__init__(rows.batch(batch_size, drop_remainder=False))
        self._b, self._feature = batch_size, feature

    def __iter__(self) -> grain.DatasetIterator:
        return _FullBatchIterator(self._parent.__iter__(), self._b, self._feature)

    def __str__(self) -> str:
        return f"FullBatches(batch_size={self._b})"


class _FullBatchIterator(grain.DatasetIterator):
    def __init__(self, parent: grain.DatasetIterator, batch_size: int, feature: str):
        super().__init__(parent)
        self._b, self._feature = batch_size, feature

    def __next__(self) -> dict[str, Any]:
        batch = next(self._parent)
        rows = len(batch[self._feature])
        if rows < self._b:
            tokens = int(np.sum(batch[f"{self._feature}_segment_lengths"]))
            log.warning("the last %d packed rows (%d tokens) are dropped: a batch needs %d "
                        "rows (Batching(drop_remainder=False) keeps them)", rows, tokens,
                        self._b)
            raise StopIteration
        return batch

    def get_state(self) -> dict[str, Any]:
        return self._parent.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state)


def _dropped(rows: grain.MapDataset, positions: Sequence[int], total: int, batch_size: int,
             feature: str) -> None:
    """Says which rows a last, partial global step drops: their number, this host's share and
    its tokens."""
    tokens = sum(int(np.sum(rows[i][f"{feature}_segment_lengths"])) for i in positions)
    log.warning("the last %d packed rows (a partial global step; %d of them, %d tokens, this "
                "host's) are dropped: the hosts' batches of %d rows cannot all be filled "
                "(Batching(drop_remainder=False) keeps them)", total, len(positions), tokens,
                batch_size)
