"""Builds the straight-line training input pipeline: shard, shuffle, pack, batch, prefetch.

    source of examples (random access), or a Mixture of such sources
      -> the global order (shuffle_seed, reshuffled every epoch, num_epochs of them), host h of
         H and worker w of W reading positions w H + h, + H W, ...   (defaults: jax's process
         index and count; `elastic.ElasticExamples`)
      -> PackIterDataset(pack)  (rows shuffled per window; examples held by reference)
      -> batch(batch_size): {"tokens": [B, L], ..., "tokens_segment_lengths": [B, S], ...}
    source of packed rows (`PackedArrayRecordSource`, see packed.py)
      -> shuffle(shuffle_seed) over all rows -> repeat -> global steps, host h block h of each
         (balanced datasets: whole steps, each host its ranks' rows; both resume on any H)
    then
      -> + loss_tokens [B] (loss.LossTokens) -> BalanceRanks(balance.ranks), if asked
      -> ContextParallelLayout(batch.context_parallel), if asked (rows split over CP ranks)
      -> mp_prefetch(worker_count) or a prefetch thread
      -> examples: `elastic.OnlineHosts` (a state restores on any host and worker count)

The options come in groups, each a frozen dataclass: `packer.PackConfig` (the rows),
`Batching` (the batch and this host's shard), `Columns` (columns.py), `Balance` (balance.py),
`Window` (pack.py) and `Prefetch`. Example::

    ds = make_training_pipeline(JsonlSource("train.jsonl"), pack=PackConfig(2048), batch=8,
                                shuffle_seed=0, num_epochs=1)
    it = iter(ds)
    batch = next(it)           # numpy arrays, ready for jax.device_put
    state = it.get_state()     # small; it.set_state(state) resumes exactly
"""

from __future__ import annotations

import atexit
import dataclasses
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np
from grain.experimental import ThreadPrefetchIterDataset

from seqpack import packer
from seqpack.packer import PackConfig
from seqpack.packer.context_parallel import check_layout
from seqpack.pipelines.datasets import packed
from seqpack.pipelines.datasets.balance import Balance, BalanceRanks
from seqpack.pipelines.datasets.columns import (
    Column,
    Columns,
    Role,
    check_int,
    check_packed_columns,
    check_type,
    loss_feature,
)
from seqpack.pipelines.datasets.elastic import ElasticExamples, OnlineHosts
from seqpack.pipelines.datasets.loss import LossTokens
from seqpack.pipelines.datasets.mixing import Mixture
from seqpack.pipelines.datasets.pack import PackIterDataset, Window
from seqpack.pipelines.errors import InputError


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


@dataclasses.dataclass(frozen=True)
class Batching:
    """The batch and this host's shard.

    batch_size:     rows per host batch.
    drop_remainder: a last, short batch is dropped (True) or kept.
    shard_index, shard_count: this host's shard (every example or row in exactly one shard);
                    both None (the default): `jax.process_index()` / `jax.process_count()`.
    context_parallel: C: rows in the load-balanced layout of C context-parallel ranks
                    (`ContextParallelLayout`; rank r's tokens at [r L/C, (r + 1) L/C)), packed
                    with `PackConfig(context_parallel=C)`. None: rows as packed.
    context_parallel_layout: "te" (TransformerEngine's, the default), "rotated" (its chunk
                    pairs turned span by span) or "balanced" (each span's pairs to the least
                    loaded ranks; the batch carries `<feature>_row_positions` for the kernels):
                    the last two more even on rows of many short segments, read by seqpack's
                    kernels only.
    """

    batch_size: int
    drop_remainder: bool = True
    shard_index: int | None = None
    shard_count: int | None = None
    context_parallel: int | None = None
    context_parallel_layout: str = "te"

    def __post_init__(self) -> None:
        shard_index, shard_count = self.shard_index, self.shard_count
        check_int("batch_size", self.batch_size, low=1)
        check_type("drop_remainder", self.drop_remainder, bool)
        if (shard_index is None) != (shard_count is None):
            raise ValueError(f"pass both or neither of {shard_index=} and {shard_count=}")
        if shard_index is not None and shard_count is not None:
            check_int("shard_index", shard_index, low=0)
            check_int("shard_count", shard_count, low=1)
            if shard_index >= shard_count:
                raise ValueError(f"{shard_index=} must be in [0, {shard_count=})")
        if self.context_parallel is not None:
            check_int("context_parallel", self.context_parallel, low=1)
        check_layout(self.context_parallel_layout, "context_parallel_layout")

    def shard(self) -> tuple[int, int, int | None]:
        """(this host's shard, the shard count, its local devices if known: from jax by
        default)."""
        if self.shard_index is None or self.shard_count is None:
            return _process_shard()
        return self.shard_index, self.shard_count, None


@dataclasses.dataclass(frozen=True)
class Prefetch:
    """How batches are made ahead of the training step.

    worker_count:       > 0 packs in that many processes (`mp_prefetch`); 0: in this one,
                        with a prefetch thread.
    worker_buffer_size: batches each worker process makes ahead.
    buffer_size:        batches the prefetch thread makes ahead (worker_count 0; 0: no thread).
    read_threads:       packed rows of a batch read at once in each process, for rows that
                        wait on storage; None: the source's `read_threads` (an index read by
                        byte range: 16), else 0 (one at a time).
    """

    worker_count: int = 0
    worker_buffer_size: int = 1
    buffer_size: int = 2
    read_threads: int | None = None

    def __post_init__(self) -> None:
        check_int("worker_count", self.worker_count, low=0)
        check_int("worker_buffer_size", self.worker_buffer_size, low=1)
        check_int("buffer_size", self.buffer_size, low=0)
        if self.read_threads is not None:
            check_int("read_threads", self.read_threads, low=0)


def _process_shard() -> tuple[int, int, int | None]:
    try:
        import jax
    except ImportError:  # single host without jax: one shard
        return 0, 1, None
    return jax.process_index(), jax.process_count(), jax.local_device_count()


@dataclasses.dataclass(frozen=True)
class ContextParallelLayout:
    """Batches in the load-balanced layout of `context_parallel` ranks
    (`packer.context_parallel_order`): every `[B, L]` array of the batch (tokens, segment ids,
    positions, columns) is permuted alike so that rank r's tokens sit at [r L/C, (r + 1) L/C);
    the `[B, S]` metadata (offsets, lengths, sources) stays global, as the attention kernels
    take it (`kernels.segment_attention(..., context_parallel_axis=...)`). The rows must be
    packed with `PackConfig(context_parallel=C)` (or a multiple of C). With layout "balanced"
    the batch also gets `<feature>_row_positions` i32[B, L]: each token's position in the row
    (the order itself), which the kernels take as `context_parallel_positions` (sharded)."""

    context_parallel: int
    feature: str = "tokens"
    layout: str = "te"  # or "rotated", "balanced" (packer.context_parallel_order)

    def __post_init__(self) -> None:
        check_int("context_parallel", self.context_parallel, low=1)
        check_layout(self.layout)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        k = packer.contract.keys(self.feature)
        seq_len = np.shape(batch[k.values])[-1]
        order = packer.context_parallel_order(
            batch[k.segment_offsets], batch[k.segment_lengths], seq_len=seq_len,
            context_parallel=self.context_parallel, layout=self.layout)
        out = {name: np.take_along_axis(v, order, axis=1) if np.ndim(v) == 2 and
               np.shape(v)[1] == seq_len and not packer.contract.is_per_slot(name) else v
               for name, v in batch.items()}
        if self.layout == "balanced":  # no twin on device: the kernels read the order
            out[f"{self.feature}_row_positions"] = order
        return out


def _context_parallel(source: Any, pack: PackConfig | None, C: int | None) -> PackConfig | None:
    """The pack config to use under `Batching(context_parallel=C)`: C filled in where None;
    ValueError when the rows (the config's or a packed source's) are not aligned to 2C."""
    if C is None:
        return pack
    if pack is not None and not getattr(source, "is_packed", False):
        if pack.context_parallel is None:
            return dataclasses.replace(pack, context_parallel=C)
        have, where = pack, f"pack=PackConfig(context_parallel={pack.context_parallel})"
    else:
        manifest = getattr(source, "manifest", None)
        have = manifest.pack_config() if manifest is not None else None
        where = f"the packed rows (context_parallel={getattr(have, 'context_parallel', None)})"
    if have is None or have.alignment % (2 * C):
        raise ValueError(f"Batching(context_parallel={C}) needs rows whose segments are aligned "
                         f"to 2 x {C}, not {where}; pack them with context_parallel={C}")
    return pack


def _check_feature(source: Any, feature: str, columns: Columns, *,
                   where: str = "the source") -> None:
    """InputError when element 0 of a source of examples lacks the packed feature: it names
    the keys it has and the pack config that packs the right one."""
    if not len(source):
        return
    first = source[0]
    if not isinstance(first, Mapping) or feature in first:
        return
    keys = sorted(map(str, first))
    rest = [k for k in keys if k not in columns.names() and k not in columns.drop]
    hint = rest[0] if len(rest) == 1 else "input_ids"
    raise InputError(
        f"element 0 of {where} lacks the packed feature {feature!r} (its keys: {keys}); "
        f"name the key of the token ids in the pack config: PackConfig(..., feature={hint!r})")


def _example_batches(source: Any, *, pack: PackConfig, batch: Batching,
                     shard: tuple[int, int, int | None], shuffle_seed: int,
                     num_epochs: int | None, columns: Columns, window: Window
                     ) -> tuple[grain.IterDataset, dict[str, Any]]:
    """Examples in their seeded global order, this host's positions of it (each worker
    process its own: `elastic.ElasticExamples`) -> PackIterDataset -> batch (a mixture: each
    dataset's global order, dealt alike, mixed and packed directly); and what a state must
    share to restore (the run: data, seed, epochs, packing)."""
    shard_index, shard_count, _ = shard
    run: dict[str, Any] = {"seed": shuffle_seed, "num_epochs": num_epochs,
                           "pack": pack.to_dict(), "window": dataclasses.asdict(window),
                           "columns": sorted(c.name for c in columns.of((pack.feature,)))}
    if isinstance(source, Mixture):
        source = source.for_feature(pack.feature)
        for name, src in zip(source.names, source.sources):
            _check_feature(src, pack.feature, columns, where=f"dataset {name!r}")
        parent: grain.IterDataset = source.configured(
            shard_index=shard_index, shard_count=shard_count, num_epochs=num_epochs)
        run["datasets"] = dict(zip(source.names, source.sizes))
    else:
        _check_feature(source, pack.feature, columns)
        if len(source) <= shard_index:
            raise ValueError(f"shard {shard_index} of {shard_count} is empty (source has "
                             f"{len(source)} examples)")
        parent = ElasticExamples(source, seed=shuffle_seed, num_epochs=num_epochs,
                                 shard_index=shard_index, shard_count=shard_count)
        run["examples"] = len(source)
    rows = PackIterDataset(parent, pack, columns=columns, window=window, seed=shuffle_seed)
    if batch.drop_remainder:
        return packed.FullBatches(rows, batch.batch_size, pack.feature), run
    return rows.batch(batch.batch_size, drop_remainder=False), run


def _loss_tokens(source: Any, feature: str, columns: Columns) -> LossTokens:
    """How `loss_tokens` is counted: from the label / mask columns given (for a packed source
    checked against its manifest, plus the columns the manifest gives a "role")."""
    cols: Sequence[Column] = columns.of((feature,))
    if getattr(source, "is_packed", False):
        cols = check_packed_columns(source, cols, explicit_pads=columns.explicit_pads())
    return LossTokens(feature=loss_feature((feature,), cols),
                      labels=tuple(c.name for c in cols if c.role is Role.LABELS),
                      masks=tuple(c.name for c in cols if c.role is Role.MASK),
                      next_token=columns.next_token_loss)


def _prefetch(ds: grain.IterDataset, prefetch: Prefetch) -> grain.IterDataset:
    if prefetch.worker_count > 0:
        ensure_flags_parsed()
        return ds.mp_prefetch(
            grain.MultiprocessingOptions(
                num_workers=prefetch.worker_count,
                per_worker_buffer_size=prefetch.worker_buffer_size,
            )
        ).map(_own_memory)
    if prefetch.buffer_size > 0:
        return ThreadPrefetchIterDataset(ds, prefetch_buffer_size=prefetch.buffer_size)
    return ds


def _check_options(pack: PackConfig | None, batch: Batching | int, num_epochs: int | None,
                   columns: Columns, balance: Balance, window: Window, prefetch: Prefetch
                   ) -> Batching:
    """The batch as a `Batching`, after checking every option group is its dataclass."""
    if pack is not None:
        check_type("pack", pack, PackConfig, " (e.g. PackConfig(2048)) or None")
    if not isinstance(batch, Batching):
        if isinstance(batch, bool) or not isinstance(batch, int):
            raise ValueError(f"batch={batch!r} must be a Batching or a positive int")
        batch = Batching(batch)
    for name, value, kind in (("columns", columns, Columns), ("balance", balance, Balance),
                              ("window", window, Window), ("prefetch", prefetch, Prefetch)):
        check_type(name, value, kind)
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"{num_epochs=} must be >= 1, or None to repeat forever")
    if balance.ranks is not None and batch.batch_size % balance.ranks:
        raise ValueError(f"Balance(ranks={balance.ranks}) must be a divisor of "
                         f"batch_size={batch.batch_size} (one equal slice of the host batch per "
                         "local device)")
    return batch


def make_training_pipeline(
    source: Any,
    *,
    pack: PackConfig | None = None,
    batch: Batching | int,
    shuffle_seed: int,
    num_epochs: int | None,
    columns: Columns = Columns(),
    balance: Balance = Balance(),
    window: Window = Window(),
    prefetch: Prefetch = Prefetch(),
) -> grain.IterDataset:
    """A Grain `IterDataset` of packed `[B, L]` / `[B, S]` numpy batches + `loss_tokens` `[B]`.

    source:       a random-access source (`grain.MapDataset`, or `__len__` + `__getitem__`) of
                  example dicts, a `Mixture` of such sources (each dataset sharded, and
                  passed over `num_epochs` times, in the mixture), or a
                  `PackedArrayRecordSource` (packed.py: no second packing).
    pack:         the rows (`packer.PackConfig`: seq_len, max_segments, strategy, overflow,
                  segment_alignment, pad_id and `feature`, the key of the token ids, default
                  "tokens"). Required for examples; for packed rows optional, their seq_len,
                  max_segments and feature coming from the manifest (a different seq_len or
                  max_segments is a ValueError).
    batch:        `Batching` (batch size, drop_remainder, this host's shard), or the batch size.
    num_epochs:   passes over the data, reshuffled each epoch; None = forever.
    columns:      columns packed with the tokens, keys dropped, how `loss_tokens` counts
                  (`Columns`): any other key of the elements raises `InputError`.
    balance:      `Balance`: host batches balanced across local devices, balanced packed rows.
    window:       `Window`: the streaming packer's knobs (seeded by shuffle_seed).
    prefetch:     `Prefetch`: worker processes or a prefetch thread. Iterators still open at
                  interpreter exit are closed then.
    """
    if isinstance(shuffle_seed, bool) or not isinstance(shuffle_seed, (int, np.integer)) \
            or shuffle_seed < 0:
        raise ValueError(f"shuffle_seed={shuffle_seed!r} must be an int >= 0")
    shuffle_seed = int(shuffle_seed)
    batch = _check_options(pack, batch, num_epochs, columns, balance, window, prefetch)
    pack = _context_parallel(source, pack, batch.context_parallel)
    shard = batch.shard()
    if getattr(source, "is_packed", False):
        feature = str(source.feature)
        packed.check_shape(source, pack)
        ds = packed.packed_batches(
            source, batch_size=batch.batch_size, shuffle_seed=shuffle_seed,
            num_epochs=num_epochs, shard_index=shard[0], shard_count=shard[1],
            drop_remainder=batch.drop_remainder, balanced_steps=balance.steps,
            local_devices=shard[2], read_threads=getattr(source, "read_threads", 0)
            if prefetch.read_threads is None else prefetch.read_threads)
    else:
        if pack is None:
            raise ValueError("pack=None: pass the packing config, e.g. pack=PackConfig(2048) "
                             "(only packed sources carry one)")
        feature = pack.feature
        ds, run = _example_batches(source, pack=pack, batch=batch, shard=shard,
                                   shuffle_seed=shuffle_seed, num_epochs=num_epochs,
                                   columns=columns, window=window)
    ds = ds.map(_loss_tokens(source, feature, columns))
    if balance.ranks is not None:
        ds = ds.map(BalanceRanks(balance.ranks, feature=feature, cost_model=balance.cost))
    if batch.context_parallel is not None:
        ds = ds.map(ContextParallelLayout(batch.context_parallel, feature=feature,
                                          layout=batch.context_parallel_layout))
    ds = _prefetch(ds, prefetch)
    if getattr(source, "is_packed", False):
        ds = packed.WorkerLayout(ds, prefetch.worker_count)
    else:  # its state restores on any layout
        ds = OnlineHosts(ds, shard_index=shard[0], shard_count=shard[1],
                         workers=prefetch.worker_count, features=1,
                         datasets=len(source.names) if isinstance(source, Mixture) else 1,
                         mixed=isinstance(source, Mixture), run=run)
    return _ClosedAtExit(ds)
