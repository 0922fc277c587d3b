"""Builds the straight-line training input pipeline: shard, shuffle, pack, batch, prefetch.

    source (random access)
      -> shard [shard_index::shard_count]      (defaults: jax.process_index() / process_count())
      -> shuffle(shuffle_seed) -> repeat(num_epochs)     (reshuffled every epoch)
      -> SequentialIterDataset -> PackIterDataset        (skipped for already-packed rows)
      -> batch(batch_size): {"tokens": [B, L], ..., "tokens_segment_lengths": [B, S], ...}
      -> mp_prefetch(worker_count) or a prefetch thread

Example::

    ds = make_training_pipeline(JsonlSource("train.jsonl"), seq_len=2048, batch_size=8,
                                shuffle_seed=0, num_epochs=1)
    it = iter(ds)
    batch = next(it)           # numpy arrays, ready for jax.device_put
    state = it.get_state()     # small; it.set_state(state) resumes exactly
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Mapping
from typing import Any

import grain
import numpy as np
from grain.experimental import ThreadPrefetchIterDataset

from seqpack.pipelines.datasets.pack import PackIterDataset
from seqpack.pipelines.datasets.sources import SequentialIterDataset


def ensure_flags_parsed() -> None:
    """Grain's worker processes read absl flags; outside an absl app mark them parsed (defaults).

    Without this, `mp_prefetch` raises UnparsedFlagAccessError in plain scripts and notebooks.
    """
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


# Clean shutdown. An iterator that a global still holds at interpreter exit is collected during
# module teardown, when Grain's prefetch modules have lost their globals (`queue`, `dataset` are
# None): its __del__ -> close() fails ("Exception ignored in DatasetIterator.__del__ ...
# 'NoneType' object has no attribute 'Empty'"), and Grain's prefetch close() is not idempotent.
# So the live iterators of these pipelines are closed at exit, before teardown, and the close()
# of every iterator in their chain made a no-op for the __del__ that follows. (Batches from
# worker processes are copied out of shared memory, whose arrays fail the same way.)
_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_live_iterators() -> None:
    for it in list(_LIVE):
        try:
            it.close()
        except Exception:  # noqa: BLE001 - best effort at exit; the process is ending anyway
            pass
        chain, seen = [it], set()
        while chain:
            node = chain.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            node.close = _closed  # __del__ at teardown calls close() again
            for v in vars(node).values():  # parents, and the per-worker iterators of mp
                for p in (v if isinstance(v, (list, tuple)) else (v,)):
                    if isinstance(p, grain.DatasetIterator):
                        chain.append(p)


def _closed() -> None:
    """close() of an iterator already closed at exit."""


def _own_memory(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch with plain numpy arrays (copies of a worker's shared-memory arrays)."""
    return {k: np.array(v) for k, v in batch.items()}


class _ClosedAtExit(grain.IterDataset):
    """Passes its parent through; its iterators are closed at interpreter exit (see `_LIVE`)."""

    def __iter__(self) -> grain.DatasetIterator:
        it = self._parent.__iter__()
        _LIVE.add(it)
        return it

    def __str__(self) -> str:
        return "ClosedAtExit"


def _source_feature(source: Any) -> str:
    """The feature to pack when none is given: a packed source's, the only key of the source's
    elements, else "tokens"."""
    feature = getattr(source, "feature", None)
    if isinstance(feature, str):
        return feature
    if len(source):
        first = source[0]
        if isinstance(first, Mapping) and len(first) == 1:
            return next(iter(first))
    return "tokens"


def _process_shard() -> tuple[int, int]:
    try:
        import jax
    except ImportError:  # single host without jax: one shard
        return 0, 1
    return jax.process_index(), jax.process_count()


def make_training_pipeline(
    source: Any,
    *,
    seq_len: int,
    batch_size: int,
    max_segments: int = 64,
    shuffle_seed: int,
    num_epochs: int | None,
    shard_index: int | None = None,
    shard_count: int | None = None,
    worker_count: int = 0,
    feature: str | None = None,
    strategy: str = "best_fit_decreasing",
    window: int = 1024,
    overflow: str = "error",
    segment_alignment: int = 1,
    pad_id: int = 0,
    shuffle_rows: bool = False,
    drop_remainder: bool = True,
    prefetch_buffer_size: int = 2,
    worker_buffer_size: int = 1,
) -> grain.IterDataset:
    """Returns a Grain `IterDataset` of packed `[B, L]` / `[B, S]` numpy batches.

    source:        a `grain.MapDataset` or any random-access source (`__len__`, `__getitem__`)
                   of example dicts; a `PackedArrayRecordSource` of packed rows is batched as is.
    shard_index, shard_count: this host's shard (every example lands in exactly one shard).
    num_epochs:    passes over the (shuffled, reshuffled each epoch) shard; None = forever.
    worker_count:  > 0 packs in that many processes (`mp_prefetch`), each on a slice of the
                   shard; 0 packs in this process behind a prefetch thread.
    feature:       the element key of the token ids; default: the only key of the source's
                   elements (a single-column source is taken as it comes), else "tokens".
    Further options go to `PackIterDataset`.

    Iterators still open at interpreter exit are closed then (no "Exception ignored" noise).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"{batch_size=} must be a positive int")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"{num_epochs=} must be >= 1, or None to repeat forever")
    if worker_count < 0:
        raise ValueError(f"{worker_count=} must be >= 0")
    if (shard_index is None) != (shard_count is None):
        raise ValueError(f"pass both or neither of {shard_index=} and {shard_count=}")
    if shard_index is None:
        shard_index, shard_count = _process_shard()
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"{shard_index=} must be in [0, {shard_count=})")

    if feature is None:
        feature = _source_feature(source)
    packed = bool(getattr(source, "is_packed", False))
    if packed:
        src_len = getattr(source, "seq_len", None)
        if src_len is not None and src_len != seq_len:
            raise ValueError(f"{seq_len=} but the packed rows have seq_len={src_len}")
    ds = source if isinstance(source, grain.MapDataset) else grain.MapDataset.source(source)
    ds = ds[shard_index::shard_count]
    if len(ds) == 0:
        raise ValueError(
            f"shard {shard_index} of {shard_count} is empty (source has {len(source)} examples)"
        )
    ds = ds.shuffle(seed=shuffle_seed)
    if num_epochs != 1:
        ds = ds.repeat(num_epochs)
    it_ds: grain.IterDataset = SequentialIterDataset(ds)
    if not packed:
        it_ds = PackIterDataset(
            it_ds,
            seq_len=seq_len,
            max_segments=max_segments,
            strategy=strategy,
            window=window,
            overflow=overflow,
            segment_alignment=segment_alignment,
            shuffle_rows=shuffle_rows,
            seed=shuffle_seed,
            pad_id=pad_id,
            feature=feature,
        )
    it_ds = it_ds.batch(batch_size, drop_remainder=drop_remainder)
    if worker_count > 0:
        ensure_flags_parsed()
        it_ds = it_ds.mp_prefetch(
            grain.MultiprocessingOptions(
                num_workers=worker_count, per_worker_buffer_size=worker_buffer_size
            )
        ).map(_own_memory)
    elif prefetch_buffer_size > 0:
        it_ds = ThreadPrefetchIterDataset(it_ds, prefetch_buffer_size=prefetch_buffer_size)
    return _ClosedAtExit(it_ds)
