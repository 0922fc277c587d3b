"""Builds the straight-line training input pipeline: shard, shuffle, pack, batch, prefetch.

    source of examples (random access)
      -> shard [shard_index::shard_count]      (defaults: jax.process_index() / process_count())
      -> shuffle(shuffle_seed) -> repeat(num_epochs)     (reshuffled every epoch)
      -> SequentialIterDataset -> PackIterDataset        (rows shuffled per window)
      -> batch(batch_size): {"tokens": [B, L], ..., "tokens_segment_lengths": [B, S], ...}
    source of packed rows (`PackedArrayRecordSource`, see packed.py)
      -> shuffle(shuffle_seed) over all rows -> repeat -> [shard_index::shard_count] -> batch
         (balanced datasets: whole steps, each host its ranks' rows)
    then
      -> + loss_tokens [B] (loss.LossTokens) -> BalanceRanks(balance_ranks), if asked
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
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np
from grain.experimental import ThreadPrefetchIterDataset

from seqpack.packer.order import CostModel
from seqpack.pipelines.datasets import packed
from seqpack.pipelines.datasets.balance import BalanceRanks
from seqpack.pipelines.datasets.columns import ColumnSpec, Role, columns_from, loss_feature
from seqpack.pipelines.datasets.loss import LossTokens
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


def _source_feature(source: Any, declared: set[str]) -> str:
    """The feature to pack when none is given: a packed source's, the only key of the source's
    elements that is not a column or dropped, else "tokens"."""
    feature = getattr(source, "feature", None)
    if isinstance(feature, str):
        return feature
    if len(source):
        first = source[0]
        if isinstance(first, Mapping):
            rest = [k for k in first if k not in declared]
            if len(rest) == 1:
                return rest[0]
    return "tokens"


def _process_shard() -> tuple[int, int, int | None]:
    try:
        import jax
    except ImportError:  # single host without jax: one shard
        return 0, 1, None
    return jax.process_index(), jax.process_count(), jax.local_device_count()


def _shard(shard_index: int | None, shard_count: int | None) -> tuple[int, int, int | None]:
    """(this host's shard, the shard count, its local devices if known: from jax by default)."""
    if (shard_index is None) != (shard_count is None):
        raise ValueError(f"pass both or neither of {shard_index=} and {shard_count=}")
    if shard_index is None or shard_count is None:
        return _process_shard()
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"{shard_index=} must be in [0, {shard_count=})")
    return shard_index, shard_count, None


def _check_counts(batch_size: int, num_epochs: int | None, worker_count: int,
                  balance_ranks: int | None) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"{batch_size=} must be a positive int")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"{num_epochs=} must be >= 1, or None to repeat forever")
    if worker_count < 0:
        raise ValueError(f"{worker_count=} must be >= 0")
    if balance_ranks is not None and (balance_ranks < 1 or batch_size % balance_ranks):
        raise ValueError(f"{balance_ranks=} must be a positive divisor of {batch_size=} (one "
                         "equal slice of the host batch per local device)")


def _example_batches(source: Any, *, shard: tuple[int, int, int | None], seq_len: int | None,
                     batch_size: int, shuffle_seed: int, num_epochs: int | None,
                     drop_remainder: bool, **pack: Any) -> grain.IterDataset:
    """Examples -> shard -> shuffle -> repeat -> PackIterDataset -> batch."""
    if seq_len is None:
        raise ValueError("seq_len=None: pass the row length L (only packed sources carry one)")
    ds = source if isinstance(source, grain.MapDataset) else grain.MapDataset.source(source)
    shard_index, shard_count, _ = shard
    ds = ds[shard_index::shard_count]
    if len(ds) == 0:
        raise ValueError(
            f"shard {shard_index} of {shard_count} is empty (source has {len(source)} examples)"
        )
    ds = ds.shuffle(seed=shuffle_seed)
    if num_epochs != 1:
        ds = ds.repeat(num_epochs)
    rows = PackIterDataset(SequentialIterDataset(ds), seq_len=seq_len, seed=shuffle_seed, **pack)
    return rows.batch(batch_size, drop_remainder=drop_remainder)


def _loss_tokens(source: Any, feature: str, *, label_features: ColumnSpec,
                 mask_features: ColumnSpec, meta_features: ColumnSpec, next_token: bool
                 ) -> LossTokens:
    """How `loss_tokens` is counted: from the label / mask columns given (for a packed source
    checked against its manifest, plus the columns the manifest gives a "role")."""
    cols = columns_from((feature,), label_features=label_features, mask_features=mask_features,
                        meta_features=meta_features)
    if getattr(source, "is_packed", False):
        cols = packed.check_columns(source, cols, explicit_pads={
            n for spec in (label_features, mask_features) if isinstance(spec, Mapping)
            for n in spec})
    return LossTokens(feature=loss_feature((feature,), cols),
                      labels=tuple(c.name for c in cols if c.role is Role.LABELS),
                      masks=tuple(c.name for c in cols if c.role is Role.MASK),
                      next_token=next_token)


def _prefetch(ds: grain.IterDataset, *, worker_count: int, worker_buffer_size: int,
              prefetch_buffer_size: int) -> grain.IterDataset:
    if worker_count > 0:
        ensure_flags_parsed()
        return ds.mp_prefetch(
            grain.MultiprocessingOptions(
                num_workers=worker_count, per_worker_buffer_size=worker_buffer_size
            )
        ).map(_own_memory)
    if prefetch_buffer_size > 0:
        return ThreadPrefetchIterDataset(ds, prefetch_buffer_size=prefetch_buffer_size)
    return ds


def make_training_pipeline(
    source: Any,
    *,
    seq_len: int | None = None,
    batch_size: int,
    max_segments: int | None = None,
    shuffle_seed: int,
    num_epochs: int | None,
    shard_index: int | None = None,
    shard_count: int | None = None,
    worker_count: int = 0,
    feature: str | None = None,
    label_features: ColumnSpec = (),
    mask_features: ColumnSpec = (),
    meta_features: ColumnSpec = (),
    drop_features: Sequence[str] = (),
    next_token_loss: bool = True,
    balance_ranks: int | None = None,
    cost_model: CostModel | None = None,
    balanced_steps: bool | None = None,
    strategy: str = "best_fit_decreasing",
    window: int = 1024,
    overflow: str = "error",
    segment_alignment: int = 1,
    pad_id: int = 0,
    shuffle_rows: bool = True,
    drop_remainder: bool = True,
    prefetch_buffer_size: int = 2,
    worker_buffer_size: int = 1,
) -> grain.IterDataset:
    """A Grain `IterDataset` of packed `[B, L]` / `[B, S]` numpy batches + `loss_tokens` `[B]`.

    source:       a random-access source (`grain.MapDataset`, or `__len__` + `__getitem__`) of
                  example dicts, or a `PackedArrayRecordSource` (packed.py: no second packing;
                  seq_len / max_segments from its manifest, a different one is a ValueError).
    shard_index, shard_count: this host's shard (every example or row in exactly one shard).
    num_epochs:   passes over the data, reshuffled each epoch; None = forever.
    worker_count: > 0 packs in that many processes (`mp_prefetch`); 0: a prefetch thread.
    feature:      the token ids' key; default: the only other key of the elements, or "tokens".
    label_features, mask_features, meta_features: columns packed with the tokens (columns.py);
                  any other key of the elements must be in `drop_features` (else InputError).
    next_token_loss: how `loss_tokens` counts (loss.py). balance_ranks, cost_model: balance.py.
    balanced_steps: a packed source balanced offline: None follows its manifest, False reads
                  it as plain rows. The other options go to `PackIterDataset` (seeded by
                  shuffle_seed). Iterators still open at interpreter exit are closed then.
    """
    _check_counts(batch_size, num_epochs, worker_count, balance_ranks)
    shard = _shard(shard_index, shard_count)
    columns = {**_names(label_features), **_names(mask_features), **_names(meta_features)}
    if feature is None:
        feature = _source_feature(source, set(columns) | set(drop_features))
    if getattr(source, "is_packed", False):
        packed.check_shape(source, seq_len, max_segments)
        ds = packed.packed_batches(
            source, batch_size=batch_size, shuffle_seed=shuffle_seed, num_epochs=num_epochs,
            shard_index=shard[0], shard_count=shard[1], drop_remainder=drop_remainder,
            balanced_steps=balanced_steps, local_devices=shard[2])
    else:
        ds = _example_batches(
            source, shard=shard, seq_len=seq_len, batch_size=batch_size,
            shuffle_seed=shuffle_seed, num_epochs=num_epochs, drop_remainder=drop_remainder,
            max_segments=64 if max_segments is None else max_segments, strategy=strategy,
            window=window, overflow=overflow, segment_alignment=segment_alignment,
            shuffle_rows=shuffle_rows, pad_id=pad_id, feature=feature,
            label_features=label_features, mask_features=mask_features,
            meta_features=meta_features, drop_features=drop_features)
    ds = ds.map(_loss_tokens(source, feature, label_features=label_features,
                             mask_features=mask_features, meta_features=meta_features,
                             next_token=next_token_loss))
    if balance_ranks is not None:
        ds = ds.map(BalanceRanks(balance_ranks, feature=feature, cost_model=cost_model))
    ds = _prefetch(ds, worker_count=worker_count, worker_buffer_size=worker_buffer_size,
                   prefetch_buffer_size=prefetch_buffer_size)
    return _ClosedAtExit(ds)


def _names(spec: ColumnSpec) -> dict[str, None]:
    return dict.fromkeys(spec)
