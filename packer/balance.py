"""Balance helpers: equal-cost slices of a batch (online), and how balanced a row order is.

`balance_slices(costs, parts)` orders n rows (n % parts == 0) into `parts` consecutive slices
of n / parts rows whose total costs are near-equal: what `PackIterDataset(..., balance_ranks=N)`
does to each host batch so that its N local devices finish together. Rows are dealt out
largest first in snake order (slice 0, 1, .., N-1, N-1, .., 0, ...), then the heaviest and the
lightest slice swap the pair of rows that best evens them, while that helps (`_SWAPS` times).

`step_balance(costs, data_parallel, batch_size)` is the metric: for rows in output order, the
max / mean over ranks of each full step's rank costs (rank r of step s reads rows
[(s*D + r)*b, (s*D + r + 1)*b)); 1.0 is perfect.

Worked example (parts 2)::

    costs (rows 0..5):   7 1 4 4 2 6
    sorted:              7 6 4 4 2 1   dealt to slices 0 1 1 0 0 1
                         slice 0 = 7 + 4 + 2 = 13, slice 1 = 6 + 4 + 1 = 11
    swap 7 <-> 6:        slice 0 = 6 + 4 + 2 = 12, slice 1 = 7 + 4 + 1 = 12
    permutation:         [3 4 5 0 1 2]   (slice 0 = rows 3 4 5, slice 1 = rows 0 1 2)
"""

from __future__ import annotations

import numpy as np

_SWAPS = 64


def balance_slices(costs: object, parts: int) -> np.ndarray:
    """i64[n]: a permutation p such that costs[p].reshape(parts, -1) are the slices (rows of a
    slice in their original order). Deterministic; O(n log n + _SWAPS * (n / parts)^2)."""
    c = np.asarray(costs, np.float64)
    n = c.size
    if isinstance(parts, bool) or not isinstance(parts, int | np.integer) or parts < 1:
        raise ValueError(f"parts={parts!r} must be an int >= 1")
    if c.ndim != 1 or n % parts:
        raise ValueError(f"costs must be 1-D with a multiple of parts={parts} rows, got shape "
                         f"{c.shape}")
    per = n // parts
    if parts == 1 or per == 0:
        return np.arange(n, dtype=np.int64)
    desc = np.argsort(-c, kind="stable")
    i = np.arange(n)
    pos = i % parts
    part = np.empty(n, np.int64)
    part[desc] = np.where((i // parts) % 2 == 0, pos, parts - 1 - pos)
    for _ in range(_SWAPS):
        sums = np.bincount(part, weights=c, minlength=parts)
        hi, lo = int(np.argmax(sums)), int(np.argmin(sums))
        gap = sums[hi] - sums[lo]
        if gap <= 0:
            break
        a, b = np.flatnonzero(part == hi), np.flatnonzero(part == lo)
        d = c[a][:, None] - c[b][None, :]  # moving d from hi to lo: new gap |gap - 2d|
        score = np.abs(gap - 2 * d)
        k = int(np.argmin(score))
        if score.flat[k] >= gap:
            break
        x, y = a[k // b.size], b[k % b.size]
        part[x], part[y] = lo, hi
    return np.lexsort((i, part)).astype(np.int64)


def step_balance(costs: object, data_parallel: int, batch_size: int = 1) -> np.ndarray:
    """f64[full steps]: max / mean of the ranks' costs in each full step of rows in output
    order (costs f64[n]); an incomplete last step is left out."""
    c = np.asarray(costs, np.float64)
    D, b = int(data_parallel), int(batch_size)
    if D < 1 or b < 1:
        raise ValueError(f"data_parallel={D} and batch_size={b} must be >= 1")
    steps = c.size // (D * b)
    ranks = c[: steps * D * b].reshape(steps, D, b).sum(axis=2)
    mean = ranks.mean(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(mean > 0, ranks.max(axis=1) / mean, 1.0)
    return out
