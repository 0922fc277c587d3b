"""The greedy passes of best fit decreasing: plain BFD by runs of equal sizes, and worst fit.

Plain BFD places the pieces largest first, each into the row it leaves with the least room; it
is the best plan wherever the segment cap hardly binds. Worst fit places each into the row with
the most room, starting from a number of empty rows: every row a mix of big and small pieces,
the plan for corpora whose slots bind.

Plain BFD by runs: pieces of equal size are placed without a search per piece. Best fit puts
consecutive equal pieces into the same row until it is full, so each open row takes
`min(room // s, S - count)` of the run in order of (room, row), and the rest open new rows
holding `min(capacity // s, S)` each.

Worked example (capacity 10, max_segments 4)::

    sizes (input order):   3  7  5  5  2  8
    sorted (largest first): 8  7  5  5  3  2
    plain BFD rows:         0  1  2  2  1  0     row 0 = [8, 2], row 1 = [7, 3], row 2 = [5, 5]
    worst fit, 3 rows:      0  1  2  2  1  0     (8, 7 and 5 open the rows; the second 5 goes to
                                                  the row of the first (room 5), 3 to 7's (room 3),
                                                  2 to 8's: the same rows here)
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort

import numpy as np

_SHIFT = 48  # plain BFD's keys `room << _SHIFT | row` (rows below 2**48)
_MASK = (1 << _SHIFT) - 1


def bfd_sorted(sizes_desc: np.ndarray, capacity: int, max_segments: int
                ) -> tuple[np.ndarray, int]:
    """Best fit over sizes already sorted largest first; returns (row per piece, rows).

    Works run by run (pieces of one size): Python steps per run and per row a run touches,
    numpy per piece, so memory is a few bytes a piece.
    """
    n = int(sizes_desc.size)
    out = np.empty(n, np.int32 if n < 2**31 else np.int64)  # rows <= pieces
    if n == 0:
        return out, 0
    cut = np.flatnonzero(sizes_desc[1:] != sizes_desc[:-1]) + 1
    starts = [0, *cut.tolist()]
    ends = [*cut.tolist(), n]
    run_sizes = sizes_desc[starts].tolist()
    keys: list[int] = []  # sorted `room << _SHIFT | row` of rows that can still take a piece
    count: list[int] = []
    min_size = int(sizes_desc[-1])  # rooms smaller than every piece are closed for good
    num_rows = 0
    for s, i, j in zip(run_sizes, starts, ends):
        # Place the run sizes_desc[i:j] of equal pieces: first into open rows, by best fit.
        k = bisect_left(keys, s << _SHIFT)
        touched = []
        while i < j and k < len(keys):
            key = keys[k]
            r = key & _MASK
            room = key >> _SHIFT
            take = min(room // s, max_segments - count[r], j - i)
            out[i : i + take] = r
            i += take
            count[r] += take
            touched.append((r, room - take * s))
            k += 1
        # Update the rows the run went into (remove their keys, re-insert the new rooms).
        if touched:
            del keys[k - len(touched) : k]
            for r, room in touched:
                if room >= min_size and count[r] < max_segments:
                    insort(keys, (room << _SHIFT) | r)
        if i < j:  # the rest of the run opens new rows, each taking as many as fit
            per_row = min(capacity // s, max_segments)
            full, rest = divmod(j - i, per_row)
            out[i : i + full * per_row] = num_rows + np.arange(full * per_row) // per_row
            i += full * per_row
            room = capacity - per_row * s
            if full and room >= min_size and per_row < max_segments:
                # New rows have the highest numbers: their equal keys go in one block.
                new = [(room << _SHIFT) | r for r in range(num_rows, num_rows + full)]
                at = bisect_left(keys, new[0])
                keys[at:at] = new
            count.extend([per_row] * full)
            num_rows += full
            if rest:
                out[i : i + rest] = num_rows
                i += rest
                room = capacity - rest * s
                count.append(rest)
                if room >= min_size and rest < max_segments:
                    insort(keys, (room << _SHIFT) | num_rows)
                num_rows += 1
    return out, num_rows


def worst_fit_sorted(sizes_desc: list[int], capacity: int, max_segments: int, num_rows: int):
    """Each piece (largest first) into the open row with the most room; opens rows as needed.

    Starting from `num_rows` empty rows, this deals big pieces out one per row and lets small
    pieces top up the emptiest rows: loads stay balanced and every row's slots get used.
    """
    heap = [(-capacity, r) for r in range(num_rows)]  # (-room, row) of rows with a free slot
    room = [capacity] * num_rows
    count = [0] * num_rows
    out = [0] * len(sizes_desc)
    for i, s in enumerate(sizes_desc):
        if heap and -heap[0][0] >= s:
            r = heap[0][1]
            room[r] -= s
            count[r] += 1
            if count[r] < max_segments:
                heapq.heapreplace(heap, (-room[r], r))
            else:
                heapq.heappop(heap)
        else:
            r = len(room)
            room.append(capacity - s)
            count.append(1)
            if max_segments > 1:
                heapq.heappush(heap, (-room[r], r))
        out[i] = r
    used = sorted({r for r in out})  # rows that stayed empty are dropped and renumbered
    if len(used) < len(room):
        remap = {r: k for k, r in enumerate(used)}
        out = [remap[r] for r in out]
    return out, len(used)
