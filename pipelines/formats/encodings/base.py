"""One plan, many encodings: what a `--format` is to the rest of seqpack.

The offline job plans, orders, checks and records rows one way whatever the format; only the
bytes of a shard differ. An `Encoding` turns a shard's rows (the contract's `[R, L]` / `[R, S]`
arrays plus the run's extra columns, as `packer.build_rows` makes them) into one file and reads
such a file back into the same arrays::

    write(path, batch, layout)      the shard file, from the rows
    read(path, layout)              -> the rows again (verify, stats, tests): every contract key
                                       the file keeps, each column it stores as read
                                       (`verbatim`), and each column it computes from the rows
                                       (`derived`: TRL's `labels`, Megatron's `loss_mask`)
    reader(path, layout)            -> random access to one row (`inspect`, the Grain source)
    derived(batch, layout)          the computed columns, from rows verify rebuilds from the
                                       inputs: compared with what `read` gives
    side_files(facts, layout)       JSON files beside the shards (Megatron-Bridge's metadata)

`Layout` says what a run's rows hold (its `PackConfig`, its extra columns as the manifest lists
them, how the shards are compressed); the manifest records the encoding's name, its shard
suffix, its writer options and the keys its files store, and the run's digests, resume and
verify treat every shard file alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from seqpack.packer import PackConfig, PackPlan, build_rows
from seqpack.packer.contract import (
    DATASET_ID,
    IGNORE_INDEX,
    SOURCE_INDEX,
    segment_ids_and_positions,
)
from seqpack.packer.mixing import dataset_columns
from seqpack.pipelines.errors import InputError

COMPRESSIONS = ("none", "snappy", "zstd")


@dataclasses.dataclass(frozen=True)
class Layout:
    """What one run's rows hold, and how its shards are compressed."""

    config: PackConfig
    # the manifest's `columns` entries: {"name", "source", "dtype", "pad", "role"}, in order
    columns: tuple[Mapping[str, Any], ...] = ()
    compression: str = "none"  # one of COMPRESSIONS
    store_derived: bool = False  # SQP1 only: also store the segment ids / positions
    mixed: bool = False  # rows of a mixture: they carry `segment_dataset_id` too
    # A mixture's datasets' first corpus examples (the manifest's `mixture`), where known
    firsts: tuple[int, ...] | None = None
    # The manifest's `inputs` record (read options, every input's fingerprint): what rows
    # stored by reference are read from (`index`); None where the rows hold their tokens
    inputs: Mapping[str, Any] | None = dataclasses.field(default=None, compare=False)
    # where rows by reference copy their URL inputs (None: `storage.cache_root()`)
    cache_dir: str | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "columns", tuple(self.columns or ()))
        if self.compression not in COMPRESSIONS:
            raise ValueError(f"compression={self.compression!r} must be one of "
                             f"{list(COMPRESSIONS)}")

    @property
    def feature(self) -> str:
        return self.config.feature

    def names(self, *roles: str) -> list[str]:
        """The extra columns of these roles ("labels", "mask", "values"), in order; all without
        a role."""
        return [str(c["name"]) for c in self.columns if not roles or c.get("role") in roles]

    def sources(self) -> list[str]:
        """The `[S]` keys naming each segment's source: the contract's two, and with a
        mixture `segment_dataset_id`."""
        k = self.config.keys()
        return [k.source_index, k.source_start, *([DATASET_ID] if self.mixed else [])]

    def pad(self, name: str) -> int:
        return next(int(c["pad"]) for c in self.columns if c["name"] == name)


def shard_batch(p: PackPlan, layout: Layout, *, dtype: Any, derived: bool,
                pieces: Sequence[np.ndarray] | None = None, values: np.ndarray | None = None,
                columns: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """One shard's rows from its plan `p` as every encoding stores them (`packer.build_rows`:
    `pieces[i]` the i-th piece's tokens, or `values` [R, L] in place; `columns` each extra
    column's [R, L]); a mixture's (`layout.firsts`) with `segment_dataset_id` and each
    example's index within its dataset, before the extra columns. The writer and the rows
    read back by reference (`index`) are made here, so they are the same bytes."""
    batch = build_rows(pieces, p, layout.config, dtype=dtype, derived=derived, values=values,
                       columns=columns)
    if layout.firsts is not None:
        ids, batch[SOURCE_INDEX] = dataset_columns(batch[SOURCE_INDEX],
                                                   np.asarray(layout.firsts, np.int64))
        extra = {name: batch.pop(name) for name in layout.names()}
        batch[DATASET_ID] = ids
        batch.update(extra)
    return batch


class ShardReader:
    """Random access to the rows of one shard file (`Encoding.reader`)."""

    num_rows: int

    def row(self, j: int) -> dict[str, np.ndarray]:
        """Row `j` (from 0) as contract arrays (`[L]`, `[S]`) plus the stored columns."""
        raise NotImplementedError

    def close(self) -> None:
        """Releases the file."""


class Encoding:
    """One `--format` (see the module docstring); subclasses set the class attributes."""

    name: str = ""  # the --format value
    suffix: str = ""  # shard file names: rows-00000-of-00008<suffix>
    record_encoding: str = ""  # the manifest's "record_encoding"
    max_token_id: int | None = None  # the largest token id its rows store (None: any)

    def check(self, layout: Layout) -> None:
        """ValueError naming the parameter (format=, segment_alignment=, ...) when the rows of
        `layout` cannot be written in this format."""

    def writer_options(self, layout: Layout) -> str:
        """The manifest's `writer_options`."""
        raise NotImplementedError

    def stored_keys(self, layout: Layout) -> list[str]:
        """What each stored row holds (the file's arrays or columns): the manifest's."""
        raise NotImplementedError

    def decoded_keys(self, layout: Layout) -> list[str]:
        """The keys `read` gives for every row."""
        return self.stored_keys(layout)

    def wants_derived(self, layout: Layout) -> bool:
        """Whether `write` needs the rows' segment ids and positions."""
        return True

    # An encoding that stores rows by reference (`index`) writes the plan, not the tokens:
    # `write_refs` instead of `write`.
    by_reference: bool = False

    def write_refs(self, path: str, p: PackPlan, layout: Layout, dtype: Any) -> None:
        """Writes the shard of plan `p` (rows by reference; `dtype`: the rows' tokens')."""
        raise NotImplementedError

    def write(self, path: str, batch: Mapping[str, np.ndarray], layout: Layout) -> None:
        """Writes the rows `batch` (`[R, L]` / `[R, S]`) as one shard file at `path`."""
        raise NotImplementedError

    def read(self, path: str, layout: Layout, num_rows: int | None = None
             ) -> dict[str, np.ndarray]:
        """Every row of the shard at local `path`, stacked; InputError naming the file (and
        row) when it is not such a shard or holds another count than `num_rows`."""
        raise NotImplementedError

    def reader(self, path: str, layout: Layout) -> ShardReader:
        raise NotImplementedError

    def verbatim(self, layout: Layout) -> list[str]:
        """The extra columns whose values `read` gives as the inputs held them."""
        return layout.names()

    def derived(self, batch: Mapping[str, np.ndarray], layout: Layout
                ) -> dict[str, np.ndarray]:
        """The columns this format computes from the rows (`[R, L]` each), as `read` gives
        them; `batch`: the contract's keys and every extra column."""
        return {}

    def loss_mask(self, rows: Mapping[str, np.ndarray], layout: Layout) -> np.ndarray:
        """bool[R, L]: the positions that take loss (`loss_positions`) in rows as `read` gives
        them (with their segment ids: `with_segment_ids`)."""
        return loss_positions(rows, layout)

    def side_files(self, facts: Mapping[str, Any], layout: Layout) -> dict[str, Any]:
        """JSON files written beside the shards when the run completes: name -> object;
        `facts`: the manifest's `shapes` (see `offline.record`) and `stats`."""
        return {}


def check_count(path: str, got: int, expected: int | None) -> None:
    """InputError unless a shard holds the manifest's row count."""
    if expected is not None and got != expected:
        raise InputError(f"{path}: holds {got} rows, the manifest says {expected}; the shard is "
                         "incomplete or replaced")


def next_token_mask(segment_ids: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """bool[..., L]: position p trains on token p + 1 of its own segment, where that token's
    labels / masks allow it (`allowed`): `seg[p] > 0`, `seg[p + 1] == seg[p]`, `allowed[p + 1]`
    (`pipelines.datasets.LossTokens(next_token=True)` counts the same positions)."""
    seg = np.asarray(segment_ids)
    out = np.zeros(seg.shape, bool)
    out[..., :-1] = (seg[..., :-1] > 0) & (seg[..., 1:] == seg[..., :-1]) & allowed[..., 1:]
    return out


def allowed_positions(batch: Mapping[str, np.ndarray], layout: Layout) -> np.ndarray:
    """bool[R, L]: positions whose tokens take loss by the run's columns: every labels column
    not -100 and every mask column not 0 there (all positions without such columns)."""
    values = np.asarray(batch[layout.feature])
    allowed = np.ones(values.shape, bool)
    for name in layout.names("labels"):
        allowed &= np.asarray(batch[name]) != IGNORE_INDEX
    for name in layout.names("mask"):
        allowed &= np.asarray(batch[name]) != 0
    return allowed


def with_segment_ids(rows: Mapping[str, np.ndarray], config: PackConfig
                     ) -> dict[str, np.ndarray]:
    """`rows` with the feature's segment ids and positions (rebuilt from the `[S]` metadata
    where they are not stored)."""
    k = config.keys()
    out = dict(rows)
    if k.segment_ids not in out or k.positions not in out:
        ids, pos = segment_ids_and_positions(out[k.segment_lengths], out[k.segment_offsets],
                                             config.seq_len)
        out.setdefault(k.segment_ids, ids)
        out.setdefault(k.positions, pos)
    return out


def loss_positions(batch: Mapping[str, np.ndarray], layout: Layout) -> np.ndarray:
    """bool[R, L]: positions that train on the next token of their segment where the run's
    labels / masks allow it (`next_token_mask`); `batch` holds every extra column."""
    seg = with_segment_ids(batch, layout.config)[layout.config.keys().segment_ids]
    return next_token_mask(seg, allowed_positions(batch, layout))


def check_names(fmt: str, fixed: Sequence[str], layout: Layout) -> None:
    """ValueError when an extra column would take the name of one of the format's own."""
    taken = [n for n in layout.names() if n in fixed]
    if taken:
        raise ValueError(f"format={fmt!r} writes its own column {taken[0]!r}: the extra "
                         f"column {taken[0]!r} needs another name in the inputs")
