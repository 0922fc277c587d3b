"""Dealing the pieces into the tight bound's rows: a plan that, where it fits, needs no pass.

A plan in the tight bound's rows is optimal. Where rows hold many pieces each and the bound
leaves a little room in every row, spreading the tokens evenly over those rows gets one, at
numpy speed. Three deals over the pieces sorted largest first:

* the snake: round k (R pieces) gives its pieces to rows 0, 1, ..., R - 1, or R - 1, ..., 0
  for odd k, so a row that got a bigger piece in one round gets a smaller one in the next;
* the balanced deal: each round's largest piece to the row holding the fewest tokens so far,
  its next to the next fewest, and so on;
* the even deal: blocks of R // 2 pieces, each to the R // 2 rows with the fewest tokens (of
  those with a free slot), the largest to the emptiest: a row holding a long piece takes none
  while it is in the fuller half, so its rows are alike in cost, not only in tokens.

The snake decides first: where its fullest row is more than `_CLOSE` (1%) over, no deal is
tried. Otherwise the even deal where the plan has at least `_EVEN_ROWS` rows, then the snake,
then the balanced deal, the first whose rows all fit. The schedule deals a whole plan only
(offline, and a stream's last window): the rows of a stream's other windows and of the sieve's
are kept only when full, and rows balanced alike would leave none.

Worked example (capacity 10, max_segments 4, bound 3)::

    sorted (largest first): 5  4  4  3  3  3  2  2  1
    round:                  0  0  0  1  1  1  2  2  2
    snake rows:             0  1  2  2  1  0  0  1  2     loads 10, 9, 8: fits

and the even deal of 6 5 3 3 2 2 1 1 over 4 rows (blocks of 2): 6 5 to rows 0 1, 3 3 to the
empty rows 2 3, 2 2 to rows 2 3 (3 and 3 tokens), 1 1 to rows 1 2 (5, 5; the lower first):
loads 6, 6, 6, 5, where the snake gives 7, 6, 5, 5.
"""

from __future__ import annotations

import numpy as np

# The balanced deal runs only where the snake's rows came out at most this share of the row
# over (the worst row's tokens), and it has at most `_ROUNDS` rounds; the even deal deals into
# plans of at least `_EVEN_ROWS` rows (below, its blocks of half the rows would be short and
# its numpy steps many a piece).
_CLOSE, _ROUNDS, _EVEN_ROWS = 0.01, 512, 256
_FULL = np.iinfo(np.int64).max  # the even deal's key of a row with no free slot


def _fits(rows: np.ndarray, sizes_desc: np.ndarray, num_rows: int, capacity: int) -> float:
    """The fullest row's tokens over `capacity` (<= 1: every row fits)."""
    return float(np.bincount(rows, weights=sizes_desc, minlength=num_rows).max()) / capacity


def snake_rows(n: int, num_rows: int) -> np.ndarray:
    """The row of each of n pieces in the snake deal over `num_rows` rows."""
    rnd, pos = np.divmod(np.arange(n, dtype=np.int64), num_rows)
    return np.where(rnd & 1, num_rows - 1 - pos, pos)


def balanced_rows(sizes_desc: np.ndarray, num_rows: int, max_segments: int) -> np.ndarray:
    """The row of each piece in the balanced deal (each round's largest piece to the emptiest
    row): `_emptiest_first` in blocks of every row."""
    return _emptiest_first(sizes_desc, num_rows, max_segments, num_rows)


def even_rows(sizes_desc: np.ndarray, num_rows: int, max_segments: int) -> np.ndarray:
    """The row of each piece in the even deal: `_emptiest_first` in blocks of half the rows."""
    return _emptiest_first(sizes_desc, num_rows, max_segments, max(1, num_rows // 2))


def _emptiest_first(sizes_desc: np.ndarray, num_rows: int, max_segments: int, block: int
                    ) -> np.ndarray:
    """The row of each piece dealt in blocks of `block` pieces, each block to the rows with the
    fewest tokens among those with a free slot, the largest piece to the emptiest (ties: the
    lower row). No row takes more than `max_segments`; more pieces than the rows have slots
    for is a ValueError (`deal_sorted` never asks that)."""
    n, R = int(sizes_desc.size), num_rows
    rows = np.empty(n, np.int64)
    index = np.arange(R, dtype=np.int64)
    load = np.zeros(R, np.int64)
    count = np.zeros(R, np.int64)
    key = index.copy()  # load * R + row: distinct, so every pick is defined
    a = 0
    while a < n:
        k = min(block, n - a)
        to = index if k >= R else np.argpartition(key, k - 1)[:k]
        to = to[np.argsort(key[to])]
        if key[to[-1]] == _FULL:
            to = to[key[to] != _FULL]
            k = to.size
            if k == 0:
                raise ValueError(f"{n} pieces do not fit {R} rows of {max_segments} slots")
        rows[a : a + k] = to
        load[to] += sizes_desc[a : a + k]
        count[to] += 1
        key[to] = load[to] * R + to
        key[to[count[to] >= max_segments]] = _FULL
        a += k
    return rows


def deal_sorted(sizes_desc: np.ndarray, capacity: int, max_segments: int, num_rows: int
                ) -> tuple[np.ndarray, int] | None:
    """A plan of the pieces (sorted largest first) in `num_rows` rows by a deal (see the module
    docstring): the even deal from `_EVEN_ROWS` rows on, else (or if it does not fit) the
    snake, else the balanced deal; None if none fits or the snake's fullest row is more than
    `_CLOSE` over."""
    n = int(sizes_desc.size)
    if num_rows <= 0 or n < num_rows or -(-n // num_rows) > max_segments:
        return None
    rows = snake_rows(n, num_rows)
    worst = _fits(rows, sizes_desc, num_rows, capacity)
    if worst > 1.0 + _CLOSE:
        return None
    keys_fit = n * capacity < _FULL // num_rows  # load * R + row < 2**63 (load <= n * capacity)
    if num_rows >= _EVEN_ROWS and keys_fit:
        even = even_rows(sizes_desc, num_rows, max_segments)
        if _fits(even, sizes_desc, num_rows, capacity) <= 1.0:
            return even, num_rows
    if worst <= 1.0:
        return rows, num_rows
    if -(-n // num_rows) > _ROUNDS or not keys_fit:
        return None
    rows = balanced_rows(sizes_desc, num_rows, max_segments)
    if _fits(rows, sizes_desc, num_rows, capacity) <= 1.0:
        return rows, num_rows
    return None
