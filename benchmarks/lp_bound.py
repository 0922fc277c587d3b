"""The configuration LP bound on rows (tokens and slots), by column generation: how loose
`packer.bounds.tight_lower_bound` is where a plan stays above its target.

A row is a configuration: a multiset of piece sizes with at most `L` tokens in at most `S`
pieces. Gilmore and Gomory's LP relaxation

    minimise  sum_p x_p   over configurations p,  x >= 0
    s.t.      sum_p a_ip x_p >= d_i               (d_i pieces of size w_i; a_ip of them in p)

is a lower bound on the rows of any packing, and on bin packing instances it is almost always
within one row of the optimum. Its dual prices y_i >= 0 give a bound at every step (Farley):
with z = max over configurations of sum_i y_i a_i (a knapsack with a cardinality cap, solved
exactly by a dynamic programme over (pieces, tokens)), y / max(1, z) is dual feasible, so

    rows >= ceil(sum_i y_i d_i / max(1, z)).

The master LP starts from one column per size and, if given, the rows of a plan; each step
prices the master's duals smoothed towards the best bound's (Wentges), adds up to
`_COLUMNS` configurations with positive reduced cost and stops when the bound meets the master
(converged), when no column prices out, or at the time limit (the bound so far is still valid).

Where slots and tokens interact (few slots, long pieces) the tight bound's per-threshold
counting misses that three mid-size pieces do not fit a row of three slots when two would:
lognormal lengths of mean 935 at L=2048 / S=3, tight bound 12,520 rows, LP bound 12,562 (the
plan: 12,572, 0.08% above it).

scipy (a dependency of jax) solves the master LP with HiGHS; this is a benchmark tool, the
packer does not use it. Worked example (L 9, S 3; sizes 8 4 4 4 4 2): the tight bound is 3
(26 tokens), but the 8 leaves room for nothing and two 4s for nothing else, so the LP bound is
3.25 and no packing needs fewer than 4 rows (the optimum: [8] [4 4] [4 4] [2]).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

_COLUMNS = 24  # configurations added per step at most
_ALPHA = 0.7  # smoothing of the pricing duals towards the best bound's


@dataclasses.dataclass(frozen=True)
class LPBound:
    bound: int  # no packing needs fewer rows
    master: float  # the last master LP's value: the LP bound is at most this
    converged: bool  # the bound is the LP's (ceil of its optimum)
    steps: int
    seconds: float


def _knapsack(w: np.ndarray, y: np.ndarray, L: int, S: int) -> tuple[np.ndarray, np.ndarray]:
    """dp[k, c]: the most price of at most k pieces (sizes w, any number of each) in c tokens;
    and the sizes with a positive price (the only ones worth a slot)."""
    pos = np.flatnonzero(y > 1e-12)
    dp = np.zeros((S + 1, L + 1))
    for i in pos.tolist():
        wi, yi = int(w[i]), float(y[i])
        for k in range(1, S + 1):
            np.maximum(dp[k, wi:], dp[k - 1, : L + 1 - wi] + yi, out=dp[k, wi:])
    return dp, pos


def _configuration(dp, w, y, pos, k: int, c: int) -> dict[int, int]:
    """The pieces (size index -> count) behind dp[k, c]."""
    out: dict[int, int] = {}
    wp, yp = w[pos], y[pos]
    while k > 0 and dp[k, c] > 1e-12:
        if dp[k, c] <= dp[k - 1, c] + 1e-12:
            k -= 1
            continue
        fits = wp <= c
        cand = np.full(pos.size, -np.inf)
        cand[fits] = dp[k - 1, c - wp[fits]] + yp[fits]
        j = int(np.argmax(cand))
        if cand[j] >= dp[k, c] - 1e-9:
            i = int(pos[j])
            out[i] = out.get(i, 0) + 1
            k, c = k - 1, c - int(w[i])
        else:
            c -= 1  # dp[k, c] == dp[k, c - 1]
    return out


def _columns(dp, w, y, pos, L: int) -> list[dict[int, int]]:
    """Up to _COLUMNS distinct configurations of price over 1, the highest first."""
    vals = dp[1:].copy()
    vals[:, 1:][vals[:, 1:] <= vals[:, :-1] + 1e-12] = 0  # ends where its tokens do
    vals[1:][vals[1:] <= dp[1:-1] + 1e-12] = 0  # uses every one of its k pieces
    out, seen = [], set()
    for f in np.argsort(vals, axis=None)[::-1][: 4 * _COLUMNS].tolist():
        k, c = divmod(f, L + 1)
        if vals[k, c] <= 1 + 1e-9 or len(out) == _COLUMNS:
            break
        a = _configuration(dp, w, y, pos, k + 1, c)
        key = tuple(sorted(a.items()))
        if a and key not in seen:
            seen.add(key)
            out.append(a)
    return out


def lp_bound(sizes: object, capacity: int, max_segments: int, *, rows: object = None,
             seconds: float = 60.0) -> LPBound:
    """The bound of the module docstring for pieces of `sizes` (each in [1, capacity]);
    `rows` (row per piece of a plan) seeds the master with the plan's rows."""
    from scipy.optimize import linprog
    from scipy.sparse import csc_matrix

    sizes = np.asarray(sizes, np.int64)
    L, S = int(capacity), int(max_segments)
    w, d = np.unique(sizes, return_counts=True)
    cols: list[dict[int, int]] = []
    known: set[tuple] = set()

    def add(a: dict[int, int]) -> bool:
        key = tuple(sorted(a.items()))
        if not a or key in known:
            return False
        known.add(key)
        cols.append(a)
        return True

    for i in range(w.size):
        add({i: min(S, L // int(w[i]))})
    if rows is not None:
        rows = np.asarray(rows, np.int64)
        at = np.searchsorted(w, sizes)
        order = np.argsort(rows, kind="stable")
        cut = np.searchsorted(rows[order], np.arange(int(rows.max()) + 2))
        for r in range(cut.size - 1):
            add(dict(zip(*np.unique(at[order[cut[r]:cut[r + 1]]], return_counts=True))))
    t0 = time.perf_counter()
    best, center, master, steps = 0.0, None, float("inf"), 0
    R: list[int] = []
    C: list[int] = []
    V: list[int] = []
    built = 0
    while True:
        for j in range(built, len(cols)):
            for i, v in cols[j].items():
                R.append(int(i))
                C.append(j)
                V.append(int(v))
        built = len(cols)
        A = csc_matrix((V, (R, C)), shape=(w.size, len(cols)))
        res = linprog(np.ones(len(cols)), A_ub=-A, b_ub=-d, bounds=(0, None), method="highs")
        master, ym = float(res.fun), -res.ineqlin.marginals
        steps += 1
        added = False
        for y in ((ym,) if center is None else (_ALPHA * center + (1 - _ALPHA) * ym, ym)):
            dp, pos = _knapsack(w, y, L, S)
            lb = float(y @ d) / max(1.0, float(dp[S, L]))
            if center is None or lb > best:
                best, center = max(best, lb), y.copy()
            added = sum(add(a) for a in _columns(dp, w, y, pos, L)) > 0
            if added:
                break
        lo, hi = int(np.ceil(best - 1e-6)), int(np.ceil(master - 1e-6))
        if not added or lo >= hi or time.perf_counter() - t0 > seconds:
            return LPBound(lo, master, lo >= hi, steps, time.perf_counter() - t0)
