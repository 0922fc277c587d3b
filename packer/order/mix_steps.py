"""Steps that hold a mixture's shares: a block's rows dealt into steps of G rows by dataset.

A best-fit-decreasing row of a mixture is mostly one dataset (one long document, or many short
ones), so steps drawn at random hold the weights only on average. Here each row's imbalance
is its units per dataset minus the block's shares of its size; the rows, largest imbalance
first (ties in a seeded random order), go one by one to the step with room whose running
imbalance they bring closest to zero (squared distance). Every full step then holds the
block's shares within a fraction of a row; the seed breaks ties.

    rows (a, b)       (4, 0) (4, 0) (0, 4) (0, 4) (2, 2) (2, 2)   shares 0.5 / 0.5, G = 2
    imbalance of a    +2     +2     -2     -2      0      0
    steps             [(4, 0), (0, 4)]  [(4, 0), (0, 4)]  [(2, 2), (2, 2)]

Rows that make no full step (n mod G) are dealt as one more step of that size.
"""

from __future__ import annotations

import numpy as np


def mixture_steps(units: np.ndarray,  # int[n, K]: each row's units per dataset
                  G: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(i64[F, G]: F = n // G full steps, i64[n - F * G]: the rows left for an incomplete
    step), the rows 0..n-1 dealt as the module docstring says; what is left over is dealt as
    one more, smaller step, so it holds the shares too."""
    u = np.asarray(units, np.float64)
    n = u.shape[0]
    F = n // G
    cap = np.full(F + 1, G)
    cap[F] = n - F * G
    total = u.sum(0)
    if total.sum() <= 0:  # no units to share: the rows in a seeded order
        order = rng.permutation(n)
        return order[: F * G].reshape(F, G), order[F * G:]
    b = u - np.outer(u.sum(1), total / total.sum())
    order = np.lexsort((rng.random(n), -np.einsum("rk,rk->r", b, b)))
    b = b[order]
    acc = np.zeros((F + 1, u.shape[1]))
    fill = np.zeros(F + 1, np.int64)
    out = np.empty(F * G + cap[F], np.int64)
    base = np.arange(F + 1) * G
    for i, r in enumerate(order.tolist()):
        # |acc_s + b_r|^2 - |acc_s|^2 = 2 acc_s.b_r + |b_r|^2, the same |b_r|^2 for all
        score = acc @ b[i]
        score[fill >= cap] = np.inf
        s = int(np.argmin(score))
        acc[s] += b[i]
        out[base[s] + fill[s]] = r
        fill[s] += 1
    return out[: F * G].reshape(F, G), out[F * G:]
