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

from typing import Any

import grain
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
    feature: str = "tokens",
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
    Further options go to `PackIterDataset`.
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
        return it_ds.mp_prefetch(
            grain.MultiprocessingOptions(
                num_workers=worker_count, per_worker_buffer_size=worker_buffer_size
            )
        )
    if prefetch_buffer_size > 0:
        return ThreadPrefetchIterDataset(it_ds, prefetch_buffer_size=prefetch_buffer_size)
    return it_ds
