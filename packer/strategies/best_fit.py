"""Best fit in input order: each piece goes to the open row with the least room that still fits.

Open rows are kept in one sorted list of integer keys `room << 48 | row`, so finding the tightest
row is a binary search (`bisect`) and ties go to the lowest row number. A row leaves the list once
it is full in segments or its room is below the smallest piece that can still come.

Worked example (capacity 8, max_segments 3); first fit would put the 2 into row 0 and need a
third row for the 3::

    sizes:  5  6  2  3
    rows:   0  1  1  0      row 0 = [5, 3], row 1 = [6, 2]: both full
"""

from __future__ import annotations

from bisect import bisect_left, insort

import numpy as np

_SHIFT = 48
_MASK = (1 << _SHIFT) - 1


class BestFitBins:
    """Open rows indexed by remaining room: the engine behind best_fit and the streaming packer.

    Rows are numbered from 0 in the order they open; `room` and `count` hold every row not yet
    `forget`-ed, `keys` only the rows that can still take a piece.
    """

    def __init__(self, capacity: int, max_segments: int, *, min_room: int = 1) -> None:
        self.capacity = capacity
        self.max_segments = max_segments
        self.min_room = max(1, min_room)
        self.room: dict[int, int] = {}
        self.count: dict[int, int] = {}
        self.keys: list[int] = []
        self.next_row = 0

    def place(self, sizes: list[int]) -> list[int]:
        """Places each size (in the given order) by best fit; returns the row of each."""
        keys, room, count = self.keys, self.room, self.count
        cap, smax, min_room = self.capacity, self.max_segments, self.min_room
        out: list[int] = []
        append = out.append
        for s in sizes:
            i = bisect_left(keys, s << _SHIFT)
            if i < len(keys):
                key = keys.pop(i)
                r = key & _MASK
                left = (key >> _SHIFT) - s
                n = count[r] + 1
            else:
                r = self.next_row
                self.next_row = r + 1
                left = cap - s
                n = 1
            room[r] = left
            count[r] = n
            if n < smax and left >= min_room:
                insort(keys, (left << _SHIFT) | r)
            append(r)
        return out

    def add_row(self, room: int, count: int) -> int:
        """Opens a row that already holds `count` pieces and has `room` left (restoring state)."""
        r = self.next_row
        self.next_row = r + 1
        self.room[r] = room
        self.count[r] = count
        if count < self.max_segments and room >= self.min_room:
            insort(self.keys, (room << _SHIFT) | r)
        return r

    def forget(self, row: int) -> None:
        """Drops `row` entirely (it was emitted)."""
        key = (self.room.pop(row) << _SHIFT) | row
        self.count.pop(row)
        i = bisect_left(self.keys, key)
        if i < len(self.keys) and self.keys[i] == key:
            del self.keys[i]


def assign_best_fit(sizes: np.ndarray, capacity: int, max_segments: int) -> tuple[np.ndarray, int]:
    """Best fit in input order; returns (row per piece, number of rows)."""
    bins = BestFitBins(capacity, max_segments)
    rows = bins.place(np.asarray(sizes, np.int64).tolist())
    return np.asarray(rows, np.int64), bins.next_row
