"""Sieve: plans the loose rows of a plan again, window by window, as a stream would.

Largest-first passes deal the big pieces first and the small ones last, so what is left over at
the end is room spread thinly over many rows: rows full in slots with a few tokens free, or with
a free slot and too little room for any piece still to come. Where the segment cap binds that
room is what keeps the plan above the bound, and moving pieces one at a time (the repair) does
not gather it: mixing sizes again does.

This takes the loose rows (room above `capacity // _LOOSE` tokens; the roomiest first, up to
half the plan's pieces or `_BUDGET` if that is more), shuffles their pieces (seeded: the same
plan for the same input) and plans them in windows together with the rows the windows before
left open, as `StreamPlanner` does: every row planned exactly full is final, the others stay
open for the next window (`keep_open`). The rows it gives replace the loose rows only if there
are fewer of them.

Worked example (capacity 10, max_segments 3, window 4; every row with room is loose here)::

    plan (plain BFD):  [6, 3] [3, 2, 2] [2]    3 rows: room 1 / slots full, room 8
    shuffled pieces:   2 3 2 2 | 6 3
    window 1:          [2, 3, 2] [2]           neither exactly full: both stay open
    window 2 + open:   [2, 2, 6] [3, 2, 3]     the first is full: final; the second stays open
    end:               [3, 2, 3]               2 rows instead of 3
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

Planner = Callable[[np.ndarray], tuple[np.ndarray, int]]  # sizes -> (row per piece, rows)
_SEED = 0
_LOOSE = 1024  # a row is loose with more than capacity // _LOOSE tokens of room
_WINDOW = 512  # pieces a window adds
_BUDGET = 16384  # pieces it plans again: at most half the plan's, or this many if more
_WINDOW_ROWS = 64  # a window holds at least this many rows' worth of pieces (`sieve_window`)


def sieve_window(pieces_per_row: float) -> int:
    """Pieces a window of the sieve adds: `_WINDOW`, or `_WINDOW_ROWS` rows' worth at
    `pieces_per_row` (`regime.Regime.pieces_per_row`) where that is more: a window of a few
    rows' worth cannot mix sizes within a row (`StreamPlanner`'s `window_rows` is the stream's
    form of this rule)."""
    return max(_WINDOW, int(_WINDOW_ROWS * pieces_per_row))


def keep_open(used: np.ndarray, count: np.ndarray, capacity: int, max_rows: int,
              window: int) -> np.ndarray:
    """The rows of a window's plan to keep open (i64[k]): every row not exactly full
    (`used` < capacity, even with no free slot: planned again, its pieces may pack tighter),
    least filled first (then the lowest), up to `max_rows` rows and 2 * `window` pieces (or, for
    rows that take more than a window, 2 rows of tokens)."""
    keep = np.flatnonzero(used < capacity)
    keep = keep[np.lexsort((keep, used[keep]))][:max_rows]
    pieces_before = np.cumsum(count[keep]) - count[keep]
    tokens_before = np.cumsum(used[keep]) - used[keep]
    return keep[(pieces_before + count[keep] <= 2 * window) | (tokens_before < 2 * capacity)]


def sieve(sizes: np.ndarray, rows: np.ndarray, num_rows: int, capacity: int,
          plan: Planner, *, last: Planner | None = None, window: int = _WINDOW,
          seed: int = _SEED) -> tuple[np.ndarray, int]:
    """Plans the loose rows of the plan (pieces of `sizes`, i64[P], in rows `rows`, i64[P]) again
    (see the module docstring), each window by `plan(sizes) -> (row per piece, rows)` and the
    rows still open at the end by `last` (default `plan`); returns (row per piece, rows): the
    other rows first, in their order, then the new ones (the plan as it was unless fewer)."""
    sizes = np.asarray(sizes, np.int64)
    rows = np.asarray(rows, np.int64)
    used = np.bincount(rows, weights=sizes, minlength=num_rows).astype(np.int64)
    room = capacity - used
    loose = room > capacity // _LOOSE
    count = np.bincount(rows, minlength=num_rows)
    budget = max(sizes.size // 2, _BUDGET)
    if int(count[loose].sum()) > budget:  # the roomiest rows first, up to the budget
        by_room = np.flatnonzero(loose)
        by_room = by_room[np.lexsort((by_room, -room[by_room]))]
        loose[by_room[np.cumsum(count[by_room]) > budget]] = False
    if int(loose.sum()) < 2:
        return rows, num_rows
    label = np.cumsum(~loose) - 1
    kept = int((~loose).sum())
    todo = np.flatnonzero(loose[rows])
    got, n = sieve_all(sizes[todo], capacity, plan, last=last, window=window, seed=seed)
    if kept + n >= num_rows:
        return rows, num_rows
    out = label[rows]
    out[todo] = kept + got
    return out, kept + n


def sieve_all(sizes: np.ndarray, capacity: int, plan: Planner, *, last: Planner | None = None,
              window: int = _WINDOW, seed: int = _SEED) -> tuple[np.ndarray, int]:
    """Plans every piece of `sizes` (i64[P]) by windows of a seeded shuffle, rows not exactly
    full kept open (the loop of `sieve`, over a whole corpus); returns (row per piece, rows).
    Pieces of `capacity` tokens are rows of their own, first (in a window they only crowd out
    pieces that can still be mixed)."""
    sizes = np.asarray(sizes, np.int64)
    out = np.full(sizes.size, -1, np.int64)
    whole = np.flatnonzero(sizes == capacity)
    out[whole] = np.arange(whole.size)
    todo = np.flatnonzero(sizes != capacity)
    todo = todo[np.random.default_rng(seed).permutation(todo.size)]
    held = todo[:0]
    next_row = int(whole.size)
    for a in range(0, todo.size, window):
        pieces = np.concatenate([held, todo[a : a + window]])
        got, n = plan(sizes[pieces])
        got = np.asarray(got, np.int64)
        used = np.bincount(got, weights=sizes[pieces], minlength=n).astype(np.int64)
        count = np.bincount(got, minlength=n)
        is_open = np.zeros(n, bool)
        is_open[keep_open(used, count, capacity, n, window)] = True
        final = ~is_open[got]
        number = np.cumsum(~is_open) - 1 + next_row
        out[pieces[final]] = number[got[final]]
        next_row += int((~is_open).sum())
        held = pieces[~final]
    if held.size:
        got, n = (last or plan)(sizes[held])
        out[held] = next_row + np.asarray(got, np.int64)
        next_row += n
    return out, next_row
