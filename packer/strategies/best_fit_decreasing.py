"""Best fit decreasing in two dimensions: the offline, near-optimal strategy (tokens and slots).

A row has two limits, `capacity` tokens and `max_segments` slots. Plain best fit decreasing
(largest piece first, into the row it leaves with the least room) packs the big pieces tightly
and leaves the shortest ones for last, when the rows have room but no slots or slots but no
room: at L=8192 / S=64 the last rows hold 64 short pieces at 59% fill. Here every row is in
one of two pools, judged against `a`, the mean size of the pieces still to come:

* slot-short: room > free slots * a (the pieces to come would leave it under-filled), and
* token-short: the rest.

Pieces come largest first; each goes by best fit into a slot-short row if one fits it (big
pieces go where slots are scarce), else by best fit into any row, else into a new row. The
rows the tight lower bound (`packer.bounds`) says are needed are open from the start, empty:
while empty rows count as slot-short (L > S * a: the rest of the corpus is short pieces) they
take pieces before token-short rows do, which spreads the short tail over many rows instead of
piling it into the last ones. As `a` falls, rows move from token-short to slot-short (a heap of
the mean `room / free slots` at which each row changes pool).

Pieces of equal size come in runs, and a run is placed without a search per piece: best fit
puts consecutive equal pieces into the same row while it keeps room, slots and pool, so each row
takes as many as it can at once (Python steps per run and per row a run touches, numpy per
piece: a few bytes a piece).

Worked example (capacity 10, max_segments 4; bound 3 rows, open from the start)::

    sizes (input order):    3  7  5  5  2  8
    sorted (largest first): 8  7  5  5  3  2
    rows:                   0  1  2  2  1  0     row 0 = [8, 2], row 1 = [7, 3], row 2 = [5, 5]
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort

import numpy as np

from seqpack.packer.bounds import tight_lower_bound

_SHIFT = 40  # keys `room << _SHIFT | row`
_MASK = (1 << _SHIFT) - 1
_CLOSED, _SLOT, _TOKEN = 0, 1, 2


class _Rows:
    """Rows' rooms and counts, the two pools (sorted keys) and the pool-change heap."""

    def __init__(self, capacity: int, max_segments: int, min_size: int, empty: int) -> None:
        self.L, self.S, self.min_size = capacity, max_segments, min_size
        self.room: list[int] = []
        self.count: list[int] = []
        self.pool = bytearray()
        self.version: list[int] = []
        self.slot: list[int] = []  # keys of slot-short rows
        self.token: list[int] = []  # keys of token-short rows
        self.heap: list[tuple[float, int, int]] = []  # (-room / free, version, row)
        self.empty = empty  # rows open from the start and still empty

    def open(self, take: int, s: int) -> int:
        r = len(self.room)
        self.room.append(self.L - take * s)
        self.count.append(take)
        self.pool.append(_CLOSED)
        self.version.append(0)
        return r

    def file(self, r: int, a: float) -> None:
        """Puts row r (in no pool) into the pool its room and free slots give at mean a."""
        room, free = self.room[r], self.S - self.count[r]
        if room < self.min_size or free == 0:
            self.pool[r] = _CLOSED
        elif room > free * a:
            self.pool[r] = _SLOT
            insort(self.slot, (room << _SHIFT) | r)
        else:
            self.pool[r] = _TOKEN
            insort(self.token, (room << _SHIFT) | r)
            self.version[r] += 1
            heapq.heappush(self.heap, (-room / free, self.version[r], r))

    def file_block(self, first: int, num: int, a: float) -> None:
        """`file` for rows first .. first + num - 1, all in the same state (new rows)."""
        room, free = self.room[first], self.S - self.count[first]
        if room < self.min_size or free == 0:
            return  # closed: pool bytes are already _CLOSED
        keys = [(room << _SHIFT) | r for r in range(first, first + num)]
        target = self.slot if room > free * a else self.token
        at = bisect_left(target, keys[0])  # the highest row numbers: one block of equal rooms
        target[at:at] = keys
        if target is self.slot:
            self.pool[first : first + num] = bytes([_SLOT]) * num
            return
        self.pool[first : first + num] = bytes([_TOKEN]) * num
        for r in range(first, first + num):
            self.version[r] += 1
            heapq.heappush(self.heap, (-room / free, self.version[r], r))

    def migrate(self, a: float) -> None:
        """Moves the token-short rows that a (falling) mean has made slot-short."""
        heap, token, version, pool = self.heap, self.token, self.version, self.pool
        while heap and -heap[0][0] > a:
            _, v, r = heapq.heappop(heap)
            if pool[r] != _TOKEN or version[r] != v:
                continue  # stale entry: the row took pieces since
            key = (self.room[r] << _SHIFT) | r
            del token[bisect_left(token, key)]
            pool[r] = _SLOT
            insort(self.slot, key)


def _fill(rows: _Rows, keys: list[int], out: np.ndarray, s: int, i: int, j: int,
          limit) -> tuple[int, list[int]]:
    """Best fit of pieces out[i:j] (size s) into the rows of `keys` in order of room; each row
    takes up to limit(room, free) of them. Returns (next i, rows touched), their keys removed."""
    k = k0 = bisect_left(keys, s << _SHIFT)
    touched = []
    S, count, room = rows.S, rows.count, rows.room
    while i < j and k < len(keys):
        r = keys[k] & _MASK
        free = S - count[r]
        take = min(room[r] // s, free, j - i, limit(room[r], free))
        out[i : i + take] = r
        i += take
        count[r] += take
        room[r] -= take * s
        touched.append(r)
        k += 1
    del keys[k0:k]
    return i, touched


def _two_pool_sorted(sizes_desc: np.ndarray, capacity: int, max_segments: int, num_rows: int
                     ) -> tuple[np.ndarray, int]:
    """Places sizes sorted largest first (see the module docstring) with `num_rows` rows open
    from the start; returns (row per piece, rows used). Rows are numbered as they first fill."""
    n = int(sizes_desc.size)
    out = np.empty(n, np.int32 if n < 2**31 else np.int64)  # rows <= pieces
    if n == 0:
        return out, 0
    L, S = capacity, max_segments
    cut = np.flatnonzero(sizes_desc[1:] != sizes_desc[:-1]) + 1
    starts, ends = [0, *cut.tolist()], [*cut.tolist(), n]
    tail = np.cumsum(sizes_desc[::-1])[::-1]  # tail[i] = sum of sizes_desc[i:]
    rows = _Rows(L, S, int(sizes_desc[-1]), num_rows)
    for s, i, j in zip(sizes_desc[starts].tolist(), starts, ends):
        a = float(tail[j]) / (n - j) if j < n else float(s)  # mean of the pieces after the run
        rows.migrate(a)
        if s > a:
            def limit(room: int, free: int, s: int = s, a: float = a) -> int:
                return max(1, math.ceil((room - free * a) / (s - a)))  # stays slot-short
        else:
            def limit(room: int, free: int) -> int:
                return n
        i, touched = _fill(rows, rows.slot, out, s, i, j, limit)
        for r in touched:
            rows.file(r, a)
        if i < j and rows.empty and L > S * a:  # empty rows are slot-short: open them
            i = _open_rows(rows, out, s, i, j, a, min(L // s, S, limit(L, S)), cap=rows.empty)
        if i < j:
            i, touched = _fill(rows, rows.token, out, s, i, j, lambda room, free: n)
            for r in touched:
                rows.file(r, a)
        if i < j:
            _open_rows(rows, out, s, i, j, a, min(L // s, S), cap=None)
    return out, len(rows.room)


def _open_rows(rows: _Rows, out: np.ndarray, s: int, i: int, j: int, a: float, per_row: int,
               *, cap: int | None) -> int:
    """Opens rows for out[i:j] (size s), `per_row` each (the last takes the rest), at most `cap`
    rows (None: as many as needed). Returns the next i."""
    full = (j - i) // per_row if cap is None else min(cap, (j - i) // per_row)
    if full:
        first = len(rows.room)
        out[i : i + full * per_row] = first + np.arange(full * per_row) // per_row
        i += full * per_row
        rows.room.extend([rows.L - per_row * s] * full)
        rows.count.extend([per_row] * full)
        rows.pool.extend(bytes(full))
        rows.version.extend([0] * full)
        rows.file_block(first, full, a)
    rows.empty = max(0, rows.empty - full)
    if i < j and (cap is None or cap > full):
        r = rows.open(j - i, s)
        out[i:j] = r
        i = j
        rows.file(r, a)
        rows.empty = max(0, rows.empty - 1)
    return i


def assign_best_fit_decreasing(
    sizes: np.ndarray, capacity: int, max_segments: int
) -> tuple[np.ndarray, int]:
    """Best fit decreasing in two dimensions; returns (row per piece, rows)."""
    sizes = np.asarray(sizes, np.int64)
    n = sizes.size
    if n == 0:
        return np.zeros(0, np.int64), 0
    small = sizes.astype(np.int32) if capacity < 2**31 else sizes.copy()  # sizes <= capacity
    small *= -1
    order = np.argsort(small, kind="stable")  # largest first, ties in input order
    del small
    sizes_desc = sizes[order]
    bound = tight_lower_bound(sizes_desc, capacity, max_segments)
    rows_desc, num_rows = _two_pool_sorted(sizes_desc, capacity, max_segments, bound)
    rows = np.empty(n, np.int64)
    rows[order] = rows_desc
    return rows, num_rows
