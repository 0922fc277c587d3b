"""First fit in input order: each piece goes to the lowest-numbered row that still has room.

A segment tree over rows holds each row's room (-1 once the row is full in segments); descending
it finds the first row with room >= size in O(log rows), instead of scanning all rows.

Worked example (capacity 8, max_segments 3)::

    sizes:  5  6  2  3
    rows:   0  1  0  2      row 0 = [5, 2], row 1 = [6], row 2 = [3]
"""

from __future__ import annotations

import numpy as np


def assign_first_fit(sizes: np.ndarray, capacity: int, max_segments: int) -> tuple[np.ndarray, int]:
    """First fit in input order; returns (row per piece, number of rows)."""
    sizes_list = np.asarray(sizes, np.int64).tolist()
    n = len(sizes_list)
    size = 1
    while size < max(n, 1):
        size *= 2
    # Leaves are rows (at most one per piece); unopened rows hold full capacity, so the first
    # leaf with room >= s is either an open row or the next row to open.
    tree = [capacity] * (2 * size)
    count = [0] * size
    rows = [0] * n
    num_rows = 0
    for i, s in enumerate(sizes_list):
        node = 1
        while node < size:
            node = 2 * node if tree[2 * node] >= s else 2 * node + 1
        r = node - size
        rows[i] = r
        if r >= num_rows:
            num_rows = r + 1
        count[r] += 1
        value = tree[node] - s
        if count[r] >= max_segments:
            value = -1
        tree[node] = value
        node >>= 1
        while node:
            a, b = tree[2 * node], tree[2 * node + 1]
            new = a if a > b else b
            if tree[node] == new:
                break
            tree[node] = new
            node >>= 1
    return np.asarray(rows, np.int64), num_rows
