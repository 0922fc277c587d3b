"""The order a window's rows leave in, over a mixture: every prefix near the window's shares.

Rows packed from a mixture differ in their datasets' shares (a row of one long document, a row
of short ones), so a batch of randomly ordered rows carries the mixture only on average. Here
the rows are put in order greedily: next the row that keeps the running tokens per dataset
closest (squared distance) to the window's shares; ties keep the seeded shuffle's order. Any
run of consecutive rows, and so any batch, then holds the shares within about one row.

    row tokens (a, b)   (4, 0) (4, 0) (0, 4) (0, 4)   shares 0.5 / 0.5
    order               (4, 0) (0, 4) (4, 0) (0, 4)   running a share: 1, 0.5, 0.67, 0.5
"""

from __future__ import annotations

import numpy as np


def balanced_order(tokens: np.ndarray,  # i64[R, K]: dataset tokens per row
                   order: list[int], parts: list[int] | None = None) -> list[int]:
    """`order` (a seeded shuffle of the rows) re-ordered so each prefix tracks the shares.
    `parts`: rows per part of a window cut where a stage ended (`layouts.plan_cut`): each
    part's rows leave after the previous part's, in the order that keeps its own shares."""
    if parts is not None and len(parts) > 1:
        ends = np.cumsum(parts)
        part = np.searchsorted(ends, order, side="right")
        return [r for k in range(len(parts))
                for r in balanced_order(tokens, [r for r, p in zip(order, part) if p == k])]
    tok = tokens[order].astype(np.float64)
    total = tok.sum(0)
    if total.sum() <= 0 or len(order) < 3:
        return list(order)
    # |run + tok_r - share (run_total + size_r)|^2 = |a|^2 + 2 a.b_r + |b_r|^2 with
    # a = run - share run_total and b_r = tok_r - share size_r: one mat-vec a step
    b = tok - np.outer(tok.sum(1), total / total.sum())
    bb = np.einsum("rk,rk->r", b, b)
    a = np.zeros(tok.shape[1])
    out = []
    for _ in range(len(order)):
        j = int(np.argmin(bb + 2 * (b @ a)))
        out.append(order[j])
        a += b[j]
        bb[j] = np.inf
    return out
