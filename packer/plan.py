"""Plans a packing on lengths alone: over-length policy, strategy, then slot order and offsets.

A plan lists every piece that goes into the packed rows — which example it comes from, where in
the example it starts, how long it is, and the row and offset it lands at — plus counters for
everything that did not make it in unchanged. `assemble` turns a plan into token rows.

Worked example (seq_len 8, max_segments 4, overflow="split", best_fit_decreasing)::

    lengths:         5  11   0   3
    pieces:          e0[0:5]  e1[0:8]  e1[8:11]  e3[0:3]      (e2 is empty: counted, no piece)
    row / offset:    1 / 0    0 / 0    1 / 5      2 / 0  ...   (rows in BFD order)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from seqpack.packer.config import Overflow, PackConfig, Strategy
from seqpack.packer.contract import Counters
from seqpack.packer.inputs import InputError, check_lengths
from seqpack.packer.strategies import (
    assign_best_fit,
    assign_best_fit_decreasing,
    assign_first_fit,
    concat_split_pieces,
)

_ASSIGN = {
    Strategy.FIRST_FIT: assign_first_fit,
    Strategy.BEST_FIT: assign_best_fit,
    Strategy.BEST_FIT_DECREASING: assign_best_fit_decreasing,
}


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """Every piece of a packing, sorted by (row, slot). All arrays are i64[P]."""

    example: np.ndarray  # index of the input example
    start: np.ndarray  # where in the example the piece starts
    length: np.ndarray  # tokens in the piece
    row: np.ndarray  # packed row
    slot: np.ndarray  # segment slot within the row (0-based)
    offset: np.ndarray  # start of the piece within the row
    num_rows: int
    counters: Counters

    @property
    def num_pieces(self) -> int:
        return int(self.example.size)

    def row_slices(self) -> np.ndarray:
        """i64[num_rows + 1]: pieces of row r are [bounds[r], bounds[r + 1])."""
        return np.searchsorted(self.row, np.arange(self.num_rows + 1))


def apply_overflow(lengths: np.ndarray, config: PackConfig, *, ids: np.ndarray | None = None):
    """Cuts lengths into pieces by the overflow policy; returns (example, start, length, counters).

    `example` indexes `lengths`; `ids` (same size) only names examples in errors.
    """
    L = config.seq_len
    n = lengths.size
    empty = lengths == 0
    over = lengths > L
    num_over = int(over.sum())
    c = dict(
        num_examples=n,
        input_tokens=int(lengths.sum()),
        empty_examples=int(empty.sum()),
    )
    if num_over and config.overflow is Overflow.ERROR:
        i = int(np.argmax(over))
        name = int(ids[i]) if ids is not None else i
        raise InputError(
            f"example {name} has length {int(lengths[i])} > seq_len={L} ({num_over} examples are "
            "over-length); pass overflow='truncate', 'split' or 'drop', or raise seq_len"
        )
    if not num_over or config.overflow is Overflow.TRUNCATE:
        keep = np.flatnonzero(~empty)
        piece_len = np.minimum(lengths[keep], L)
        if num_over:
            c["truncated_examples"] = num_over
            c["truncated_tokens"] = int((lengths[over] - L).sum())
        return keep, np.zeros(keep.size, np.int64), piece_len, Counters(**c)
    if config.overflow is Overflow.DROP:
        keep = np.flatnonzero(~empty & ~over)
        c["dropped_examples"] = num_over
        c["dropped_tokens"] = int(lengths[over].sum())
        return keep, np.zeros(keep.size, np.int64), lengths[keep], Counters(**c)
    # SPLIT: pieces of at most L, each its own segment.
    num_pieces = -(-lengths // L)
    example = np.repeat(np.arange(n, dtype=np.int64), num_pieces)
    first = np.cumsum(num_pieces) - num_pieces
    k = np.arange(example.size, dtype=np.int64) - first[example]
    start = k * L
    piece_len = np.minimum(lengths[example] - start, L)
    c["split_examples"] = num_over
    c["split_pieces"] = int(num_pieces[over].sum())
    return example, start, piece_len, Counters(**c)


def plan(lengths: object, config: PackConfig) -> PackPlan:
    """Plans the packing of examples with these lengths (i64[n]) under `config`."""
    lengths = check_lengths(lengths)
    L, S, a = config.seq_len, config.max_segments, config.segment_alignment
    if config.strategy is Strategy.CONCAT_SPLIT:
        example, start, length, row = concat_split_pieces(lengths, L, S, a)
        cut = np.flatnonzero(start > 0)
        split_examples = np.unique(example[cut])
        counters = Counters(
            num_examples=int(lengths.size),
            input_tokens=int(lengths.sum()),
            empty_examples=int((lengths == 0).sum()),
            split_examples=int(split_examples.size),
            split_pieces=int(np.isin(example, split_examples).sum()),
        )
        num_rows = int(row[-1]) + 1 if row.size else 0
    else:
        example, start, length, counters = apply_overflow(lengths, config)
        sizes = -(-length // a) * a
        row, num_rows = _ASSIGN[Strategy(config.strategy)](sizes, L, S)
    return order_pieces(example, start, length, row, num_rows, counters, config)


def order_pieces(example, start, length, row, num_rows, counters, config) -> PackPlan:
    """Sorts pieces into (row, example, start) order and lays out slots and offsets."""
    a = config.segment_alignment
    # Two pieces of one example never share a row (only an example's last piece is shorter than
    # seq_len), so (row, example) is a unique key: one stable argsort instead of a lexsort.
    n_ex = int(example.max()) + 1 if example.size else 1
    order = np.argsort(row * n_ex + example, kind="stable")
    example, start, length, row = example[order], start[order], length[order], row[order]
    n = row.size
    first = np.searchsorted(row, row, side="left")  # index of the row's first piece
    slot = np.arange(n, dtype=np.int64) - first
    aligned = -(-length // a) * a
    excl = np.cumsum(aligned) - aligned
    offset = excl - excl[first] if n else excl
    return PackPlan(
        example=example,
        start=start,
        length=length,
        row=row,
        slot=slot,
        offset=offset,
        num_rows=int(num_rows),
        counters=counters,
    )
