"""Concatenate-and-split: fill every row completely, cutting examples at row ends (pretraining).

Examples are laid back to back in input order; when a row runs out of room (or of segment slots)
the current example is cut and continues as a new segment at the start of the next row. Each
piece records where in its example it starts, so nothing is lost and the cut is visible.

Worked example (capacity 4, max_segments 4)::

    lengths:  3  4  2
    row 0:    e0[0:3] e1[0:1]        offsets 0 3
    row 1:    e1[1:4] e2[0:1]        offsets 0 3
    row 2:    e2[1:2]                offset  0
"""

from __future__ import annotations

import numpy as np


def concat_split_pieces(
    lengths: np.ndarray, capacity: int, max_segments: int, alignment: int = 1
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Returns (example, start, length, row) of every piece; empty examples give no piece."""
    lengths = np.asarray(lengths, np.int64)
    if alignment == 1 and max_segments >= capacity:
        return _concat_split_dense(lengths, capacity)
    ex, st, ln, rw = [], [], [], []
    row, used, count = 0, 0, 0
    for e, n in enumerate(lengths.tolist()):
        start = 0
        while start < n:
            if count == max_segments or used >= capacity:
                row, used, count = row + 1, 0, 0
            take = min(capacity - used, n - start)
            ex.append(e)
            st.append(start)
            ln.append(take)
            rw.append(row)
            used = -(-(used + take) // alignment) * alignment
            count += 1
            start += take
    as_arr = lambda x: np.asarray(x, np.int64)  # noqa: E731
    return as_arr(ex), as_arr(st), as_arr(ln), as_arr(rw)


def _concat_split_dense(lengths: np.ndarray, capacity: int):
    """Vectorised path when the segment cap cannot bind: cut the token stream every capacity."""
    nonempty = np.flatnonzero(lengths > 0)
    lens = lengths[nonempty]
    ends = np.cumsum(lens)
    starts = ends - lens
    total = int(ends[-1]) if ends.size else 0
    cuts = np.arange(capacity, total, capacity, dtype=np.int64)
    # Piece boundaries are example starts plus row cuts that fall strictly inside an example.
    bounds = np.union1d(starts, cuts)
    piece_end = np.append(bounds[1:], total)
    example_pos = np.searchsorted(starts, bounds, side="right") - 1
    example = nonempty[example_pos]
    start = bounds - starts[example_pos]
    length = piece_end - bounds
    row = bounds // capacity
    return example, start, length, row
