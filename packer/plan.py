"""Plans a packing on lengths alone: over-length policy, strategy, then slot order and offsets.

A plan lists every piece that goes into the packed rows — which example it comes from, where in
the example it starts, how long it is, and the row and offset it lands at — plus counters for
everything that did not make it in unchanged. `assemble` turns a plan into token rows.

Blocks: past `block_size` examples (default `DEFAULT_BLOCK_SIZE`, about four million) the plan is
made per block of consecutive examples, each block's rows after the previous block's. A block's
plan depends on its lengths alone, so the result is the same however the blocks are scheduled,
and a corpus of any size is planned holding one block's working memory. `plan_rows` keeps only
the row of each piece (`RowAssignment`, 4 bytes a piece); `plan` expands that into a `PackPlan`.

Worked example (seq_len 8, max_segments 4, overflow="split", best_fit_decreasing)::

    lengths:         5  11   0   3
    pieces:          e0[0:5]  e1[0:8]  e1[8:11]  e3[0:3]      (e2 is empty: counted, no piece)
    row / offset:    1 / 0    0 / 0    1 / 5      2 / 0  ...   (rows in BFD order)
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

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

DEFAULT_BLOCK_SIZE = 1 << 22  # examples planned together; larger corpora are planned per block

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


def apply_overflow(lengths: np.ndarray, config: PackConfig, *, ids: np.ndarray | None = None,
                   first: int = 0):
    """Cuts lengths into pieces by the overflow policy; returns (example, start, length, counters).

    `example` indexes `lengths`; `ids` (same size) only names examples in errors, or `first` the
    index of `lengths[0]`.
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
        name = int(ids[i]) if ids is not None else first + i
        raise InputError(
            f"example {name} has length {int(lengths[i])} > seq_len={L} ({num_over} "
            f"{'example is' if num_over == 1 else 'examples are'} over-length); pass "
            "overflow='truncate', 'split' or 'drop', or raise seq_len"
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
    # SPLIT: pieces of at most L, each its own segment (in place where it can: a few bytes a
    # piece of temporaries).
    num_pieces = -(-lengths // L)
    example = np.repeat(np.arange(n, dtype=np.int64), num_pieces)
    first_piece = np.cumsum(num_pieces)
    first_piece -= num_pieces
    start = np.arange(example.size, dtype=np.int64)
    start -= first_piece[example]
    del first_piece
    start *= L
    piece_len = lengths[example]
    piece_len -= start
    np.minimum(piece_len, L, out=piece_len)
    c["split_examples"] = num_over
    c["split_pieces"] = int(num_pieces[over].sum())
    return example, start, piece_len, Counters(**c)


@dataclasses.dataclass(frozen=True)
class RowAssignment:
    """A plan in compact form: the row of every piece, pieces in input order.

    Input order is (example, start): the order `pieces` yields them in, which re-derives each
    piece's example, start and length from the lengths and the config.
    """

    row: np.ndarray  # i32[P] (i64 past 2**31 rows): the packed row of each piece
    num_rows: int
    counters: Counters
    block_size: int  # examples per block the plan was made with

    @property
    def num_pieces(self) -> int:
        return int(self.row.size)


def aligned(length: np.ndarray, alignment: int) -> np.ndarray:
    """Tokens each piece takes in a row: its length rounded up to `alignment` (a new array)."""
    return -(-length // alignment) * alignment


def check_block_size(block_size: int | None) -> int:
    """`block_size`, or the default for None; ValueError unless an int >= 1."""
    if block_size is None:
        return DEFAULT_BLOCK_SIZE
    if isinstance(block_size, bool) or not isinstance(block_size, int | np.integer) \
            or block_size < 1:
        raise ValueError(f"block_size={block_size!r} must be an int >= 1")
    return int(block_size)


def _blocks(lengths: object, block_size: int) -> Iterator[tuple[int, np.ndarray]]:
    """(first example, i64 lengths) of each block, checked block by block."""
    arr = np.asarray(lengths)
    if arr.ndim != 1 or arr.size == 0:
        yield 0, check_lengths(arr)
        return
    for first in range(0, arr.size, block_size):
        yield first, check_lengths(arr[first : first + block_size], first=first)


def _block_pieces(lengths: np.ndarray, config: PackConfig, first: int):
    """One block's pieces in input order: (example, start, length, row or None, counters).

    `example` is global (`first` + index in the block); `row` is given by concat_split only.
    """
    if config.strategy is not Strategy.CONCAT_SPLIT:
        example, start, length, counters = apply_overflow(lengths, config, first=first)
        return example + first, start, length, None, counters
    L, S, a = config.seq_len, config.max_segments, config.alignment
    example, start, length, row = concat_split_pieces(lengths, L, S, a)
    split_examples = np.unique(example[start > 0])
    counters = Counters(
        num_examples=int(lengths.size),
        input_tokens=int(lengths.sum()),
        empty_examples=int((lengths == 0).sum()),
        split_examples=int(split_examples.size),
        split_pieces=int(np.isin(example, split_examples).sum()),
    )
    return example + first, start, length, row, counters


def _assign(length: np.ndarray, row: np.ndarray | None, config: PackConfig
            ) -> tuple[np.ndarray, int]:
    if row is not None:  # concat_split placed its pieces while cutting them
        return row, int(row[-1]) + 1 if row.size else 0
    a = config.alignment
    sizes = length if a == 1 else aligned(length, a)
    return _ASSIGN[Strategy(config.strategy)](sizes, config.seq_len, config.max_segments)


def plan_block(lengths: np.ndarray, config: PackConfig, first: int = 0):
    """Plans one block on its own: (example, start, length, row, num_rows, counters), pieces in
    input order, examples numbered from `first`, rows from 0. `plan_rows` numbers each block's
    rows after the previous blocks'; the Beam job plans blocks on different workers."""
    example, start, length, row, counters = _block_pieces(lengths, config, first)
    row, num_rows = _assign(length, row, config)
    return example, start, length, row, num_rows, counters


def _planned_blocks(lengths: object, config: PackConfig, block_size: int):
    """Per block: (example, start, length, row, counters, rows so far); a block's rows are
    numbered after the earlier blocks'."""
    base = 0
    for first, block in _blocks(lengths, block_size):
        example, start, length, row, num_rows, counters = plan_block(block, config, first)
        base += num_rows
        yield example, start, length, row + (base - num_rows), counters, base


def pieces(lengths: object, config: PackConfig, *, block_size: int | None = None
           ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(example, start, length) i64 arrays of every piece, in input order, a part at a time.

    The pieces a `RowAssignment` made with the same lengths, config and block size assigns.
    Cutting examples into pieces is per example (but for concat_split, which cuts the block's
    stream), so the parts are at most 2**18 examples: a few MB of temporaries.
    """
    block_size = check_block_size(block_size)
    part = block_size if config.strategy is Strategy.CONCAT_SPLIT else min(block_size, 1 << 18)
    for first, block in _blocks(lengths, block_size):
        for a in range(0, max(block.size, 1), part):
            example, start, length, _, _ = _block_pieces(block[a : a + part], config, first + a)
            yield example, start, length


def plan_block_rows(lengths: np.ndarray, config: PackConfig, first: int = 0
                    ) -> tuple[np.ndarray, int, Counters]:
    """One block's (row per piece i32 (i64 past 2**31 rows), rows, counters), rows from 0: what
    `plan_rows` keeps of `plan_block` (a picklable call, for `map_blocks`)."""
    example, start, length, row, c = _block_pieces(lengths, config, first)
    del example, start  # only the pieces' lengths are planned on
    row, block_rows = _assign(length, row, config)
    del length
    return (row.astype(np.int32) if block_rows < 2**31 else row), block_rows, c


MapBlocks = Callable[[Callable[..., Any], Iterator[tuple], int], Iterator[Any]]


def plan_rows(lengths: object, config: PackConfig, *, block_size: int | None = None,
              map_blocks: MapBlocks | None = None) -> RowAssignment:
    """Plans the packing of examples with these lengths, keeping only each piece's row.

    Holds the lengths, 4 bytes a piece for the result and one block's working memory.
    `map_blocks(fn, calls, count)`: runs `fn(*call)` for each call, results in order (a pool of
    worker processes: `seqpack pack --workers` plans its blocks in parallel); the plan is the
    same either way, each block planned on its own (the same rows as one after the other).
    """
    return next(plan_rows_many(lengths, [config], block_size=block_size, map_blocks=map_blocks))


def plan_rows_many(lengths: object, configs: Sequence[PackConfig], *,
                   block_size: int | None = None, map_blocks: MapBlocks | None = None
                   ) -> Iterator[RowAssignment]:
    """`plan_rows` of the same lengths with each of `configs` (a dry run's strategies), in
    order, every config's blocks through one `map_blocks`: with worker processes the plans of
    all the configs run side by side (four strategies of one block on four workers), and each
    assignment is yielded once its blocks are done (the ones after it still in flight)."""
    block_size = check_block_size(block_size)
    arr = np.asarray(lengths)
    count = -(-arr.size // block_size) if arr.ndim == 1 and arr.size else 1
    calls = ((block, config, first) for config in configs
             for first, block in _blocks(arr, block_size))
    total = count * len(configs)
    if map_blocks is None or total == 1:
        results: Iterator[Any] = (plan_block_rows(*call) for call in calls)
    else:
        results = map_blocks(plan_block_rows, calls, total)
    for _ in configs:
        rows: list[np.ndarray] = []
        counters = Counters()
        num_rows = 0
        for row, block_rows, c in itertools.islice(results, count):
            if num_rows:
                row = row + num_rows if num_rows + block_rows < 2**31 else \
                    row.astype(np.int64) + num_rows
            num_rows += block_rows
            rows.append(row)
            counters = counters + c
        out = rows[0] if len(rows) == 1 else np.concatenate(rows)
        del rows
        yield RowAssignment(out, num_rows, counters, block_size)


def plan(lengths: object, config: PackConfig, *, block_size: int | None = None) -> PackPlan:
    """Plans the packing of examples with these lengths (i64[n]) under `config`; past
    `block_size` examples (default `DEFAULT_BLOCK_SIZE`) per block (see the module docstring).
    48 bytes a piece: `plan_rows` is the compact form for corpora of any size."""
    parts = list(_planned_blocks(lengths, config, check_block_size(block_size)))
    counters = sum((p[4] for p in parts), Counters())
    example, start, length, row = (np.concatenate([p[i] for p in parts]) for i in range(4))
    return order_pieces(example, start, length, row, parts[-1][5], counters, config)


def order_pieces(example, start, length, row, num_rows, counters, config) -> PackPlan:
    """Sorts pieces into (row, example, start) order and lays out slots and offsets."""
    # Two pieces of one example never share a row (only an example's last piece is shorter than
    # seq_len), so (row, example) is a unique key: one stable argsort instead of a lexsort,
    # where the key fits int64 (a caller's ids may be negative or huge: then the lexsort).
    lo = int(example.min()) if example.size else 0
    n_ex = int(example.max()) - lo + 1 if example.size else 1
    if (int(row.max()) + 1 if row.size else 0) * n_ex < 2**62:
        order = np.argsort(row * n_ex + (example - lo), kind="stable")
    else:
        order = np.lexsort((example, row))
    example, start, length, row = example[order], start[order], length[order], row[order]
    n = row.size
    first = np.searchsorted(row, row, side="left")  # index of the row's first piece
    slot = np.arange(n, dtype=np.int64) - first
    size = aligned(length, config.alignment)
    excl = np.cumsum(size) - size
    offset = excl - excl[first] if n else excl
    return PackPlan(example, start, length, row, slot, offset, int(num_rows), counters)
