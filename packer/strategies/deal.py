"""Dealing the pieces into the tight bound's rows: a plan that, where it fits, needs no pass.

A plan in the tight bound's rows is optimal. Where rows hold many pieces each and the bound
leaves a little room in every row, spreading the tokens evenly over those rows gets one, and
dealing the pieces (sorted largest first) round by round over them spreads the tokens evenly
at numpy speed:

* the snake deal: round k gives its pieces to rows 0, 1, ..., R - 1, or R - 1, ..., 0 for odd
  k, so a row that got a bigger piece in one round gets a smaller one in the next. A few numpy
  operations over the pieces, whatever R.
* the balanced deal: each round gives its largest piece to the row holding the fewest tokens
  so far, its next to the next fewest, and so on (one sort of R loads per round). Tighter than
  the snake; a numpy step per round.

Every row takes at most one piece a round, so no row holds more than ceil(n / R) pieces; that
is at most `max_segments` because the bound is at least ceil(n / S). The plan is used only if
every row's tokens fit: then it has the bound's rows, and no pass can do better. Otherwise
the caller runs its passes as before; the snake then cost about one numpy pass over the
pieces, and the balanced deal (tried only where the snake came close: `_CLOSE`) one numpy
step a round.

`best_fit_decreasing.assign_best_fit_decreasing` deals first where a row can run out of slots
(elsewhere its one-dimensional passes cost about as little), for a whole plan: offline, and a
stream's last window. Not for a stream's other windows nor the sieve's, whose rows are kept or
emitted only when full: rows balanced alike would leave none.

gsm8k_train at L=32768 / S=256 (7,473 pieces, 37 rows): the snake fits (rows at 97.5-97.7%),
0.05 ms, where the two-dimensional pass took 4.4 ms for the same 37 rows. At 8192 / 64 (145
rows at 99.5%) the snake leaves 2 rows a few tokens over and the balanced deal fits in
0.4 ms, where the two-dimensional pass took 6.2 ms.

The dealt rows are alike in tokens and in segments. Where a few pieces are long they are
less alike in cost (l^2) than worst fit's rows, which take no piece while they hold the most:
a deal gives every row one piece of each round, the row with the longest piece too (chat_dev
at 32768 / 64: the costliest 1% of rows 1.16 times the mean cost, 1.03 under worst fit; see
benchmarks/README.md, seventeenth session, for what that does to balanced steps).

Worked example (capacity 10, max_segments 4, bound 3)::

    sorted (largest first): 5  4  4  3  3  3  2  2  1
    round:                  0  0  0  1  1  1  2  2  2
    snake rows:             0  1  2  2  1  0  0  1  2     loads 10, 9, 8: fits
"""

from __future__ import annotations

import numpy as np

# The balanced deal runs only where the snake's rows came out at most this share of the row
# over (the worst row's tokens), and it has at most `_ROUNDS` rounds.
_CLOSE, _ROUNDS = 0.01, 512


def _fits(rows: np.ndarray, sizes_desc: np.ndarray, num_rows: int, capacity: int) -> float:
    """The fullest row's tokens over `capacity` (<= 1: every row fits)."""
    return float(np.bincount(rows, weights=sizes_desc, minlength=num_rows).max()) / capacity


def snake_rows(n: int, num_rows: int) -> np.ndarray:
    """The row of each of n pieces in the snake deal over `num_rows` rows."""
    rnd, pos = np.divmod(np.arange(n, dtype=np.int64), num_rows)
    return np.where(rnd & 1, num_rows - 1 - pos, pos)


def balanced_rows(sizes_desc: np.ndarray, num_rows: int) -> np.ndarray:
    """The row of each piece in the balanced deal (each round largest piece to emptiest row)."""
    n = int(sizes_desc.size)
    rows = np.empty(n, np.int64)
    load = np.zeros(num_rows, np.int64)
    for a in range(0, n, num_rows):
        b = min(n, a + num_rows)
        to = np.argsort(load, kind="stable")[: b - a]
        rows[a:b] = to
        load[to] += sizes_desc[a:b]
    return rows


def deal_sorted(sizes_desc: np.ndarray, capacity: int, max_segments: int, num_rows: int
                ) -> tuple[np.ndarray, int] | None:
    """A plan of the pieces (sorted largest first) in `num_rows` rows by the snake deal, else
    the balanced deal (see the module docstring); None if neither fits."""
    n = int(sizes_desc.size)
    if num_rows <= 0 or n < num_rows or -(-n // num_rows) > max_segments:
        return None
    rows = snake_rows(n, num_rows)
    worst = _fits(rows, sizes_desc, num_rows, capacity)
    if worst <= 1.0:
        return rows, num_rows
    if worst > 1.0 + _CLOSE or -(-n // num_rows) > _ROUNDS:
        return None
    rows = balanced_rows(sizes_desc, num_rows)
    if _fits(rows, sizes_desc, num_rows, capacity) <= 1.0:
        return rows, num_rows
    return None
