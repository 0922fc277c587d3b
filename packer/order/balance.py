"""Balance helpers: equal-cost slices of a batch (online), and how balanced a row order is.

`balance_slices(costs, parts)` orders n rows (n % parts == 0) into `parts` consecutive slices
of n / parts rows whose total costs are near-equal: what the training pipeline's
`Balance(ranks=N)` does to each host batch so that its N local devices finish together. Rows
are dealt out largest first in snake order (slice 0, 1, .., N-1, N-1, .., 0, ...), then the
heaviest and the lightest slice swap the pair of rows that best evens them, while that helps
(`_SWAPS` times).

`step_balance(costs, data_parallel, batch_size)` is the metric: for rows in output order, the
max / mean over ranks of each full step's rank costs (rank r of step s reads rows
[(s*D + r)*b, (s*D + r + 1)*b)); 1.0 is perfect. `StepBalance` sums it up over the parts of an
output (its blocks' layouts, `packer.order`) for the manifest's stats.

Worked example (parts 2)::

    costs (rows 0..5):   7 1 4 4 2 6
    sorted:              7 6 4 4 2 1   dealt to slices 0 1 1 0 0 1
                         slice 0 = 7 + 4 + 2 = 13, slice 1 = 6 + 4 + 1 = 11
    swap 7 <-> 6:        slice 0 = 6 + 4 + 2 = 12, slice 1 = 7 + 4 + 1 = 12
    permutation:         [3 4 5 0 1 2]   (slice 0 = rows 3 4 5, slice 1 = rows 0 1 2)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from seqpack.packer.inputs import check_count

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
    spread = lambda p: np.ptp(np.bincount(p, weights=c, minlength=parts))  # noqa: E731
    if spread(i // per) < spread(part):  # the swaps' local optimum: never worse than as given
        return np.arange(n, dtype=np.int64)
    return np.lexsort((i, part)).astype(np.int64)


def step_balance(costs: object, data_parallel: int, batch_size: int = 1) -> np.ndarray:
    """f64[full steps]: max / mean of the ranks' costs in each full step of rows in output
    order (costs f64[n], finite); an incomplete last step is left out. `data_parallel` and
    `batch_size` are ints >= 1 (as `balance_slices`' parts and `RowOrder`'s: 2.5 is refused,
    not run as 2), and a NaN cost is refused, not measured as a perfect 1.0."""
    D = check_count("data_parallel", data_parallel, 1)
    b = check_count("batch_size", batch_size, 1)
    c = np.asarray(costs, np.float64)
    if c.ndim != 1:
        raise ValueError(f"costs must be 1-D (one per row), got shape {c.shape}")
    if not np.isfinite(c).all():
        bad = int(np.flatnonzero(~np.isfinite(c))[0])
        raise ValueError(f"costs must be finite: row {bad} costs {c[bad]}")
    steps = c.size // (D * b)
    ranks = c[: steps * D * b].reshape(steps, D, b).sum(axis=2)
    mean = ranks.mean(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(mean > 0, ranks.max(axis=1) / mean, 1.0)
    return out


_BALANCE_BIN = 1e-3  # StepBalance's histogram: max / mean - 1 in bins of this width
_BALANCE_BINS = 1000  # ... the last bin holding 1 + 0.999 and over


@dataclasses.dataclass(frozen=True)
class StepBalance:
    """How evenly the D ranks of each full step share its work: per step the most loaded rank's
    cost over the mean rank's (1.0: all equal; a step waits for its slowest rank, so 1.05
    idles 5% of it), for the output's order and for a random order of the same rows (what
    shuffled rows give); and, where the rows' segment counts are known, how much the steps'
    mean segments per row spread (a step of like rows, all long documents or all short turns,
    is no random sample: a length curriculum at the scale of a step). Parts of an output (its
    blocks) add up with `+`; `to_dict()` is what the manifest's stats hold as
    ``step_balance``."""

    steps: int
    ratio_sum: float
    ratio_max: float
    hist: tuple[int, ...]  # steps per bin of max / mean - 1 (`_BALANCE_BIN` wide)
    random_sum: float
    random_max: float
    random_hist: tuple[int, ...]
    # per-step mean segments per row: steps measured, sum and sum of squares, output and random
    segment_steps: int = 0
    segment_moments: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)

    @classmethod
    def of(cls, costs: object, layout: object, random_layout: object, D: int, b: int, *,
           segments: object = None) -> StepBalance:
        """Of the full steps of `layout` and of `random_layout` (the same number of steps of
        rows in rank layout), rows with these costs (f64[rows]) and segment counts (i64[rows],
        optional)."""
        costs = np.asarray(costs, np.float64)
        layout, random_layout = np.asarray(layout, np.int64), np.asarray(random_layout, np.int64)
        got = step_balance(costs[layout], D, b)
        rand = step_balance(costs[random_layout], D, b)
        if got.size != rand.size:
            raise ValueError(f"{got.size} steps against {rand.size} of the random layout")
        moments, measured = (0.0, 0.0, 0.0, 0.0), 0
        if segments is not None and got.size:
            seg = np.asarray(segments, np.float64)
            mine = seg[layout[: got.size * D * b]].reshape(got.size, -1).mean(axis=1)
            other = seg[random_layout[: got.size * D * b]].reshape(got.size, -1).mean(axis=1)
            moments = (float(mine.sum()), float((mine**2).sum()), float(other.sum()),
                       float((other**2).sum()))
            measured = int(got.size)
        return cls(int(got.size), float(got.sum()), float(got.max(initial=1.0)), _hist(got),
                   float(rand.sum()), float(rand.max(initial=1.0)), _hist(rand), measured,
                   moments)

    def __add__(self, other: StepBalance) -> StepBalance:
        return StepBalance(self.steps + other.steps, self.ratio_sum + other.ratio_sum,
                           max(self.ratio_max, other.ratio_max),
                           tuple(map(sum, zip(self.hist, other.hist, strict=True))),
                           self.random_sum + other.random_sum,
                           max(self.random_max, other.random_max),
                           tuple(map(sum, zip(self.random_hist, other.random_hist, strict=True))),
                           self.segment_steps + other.segment_steps,
                           tuple(a + c for a, c in zip(self.segment_moments, other.segment_moments,
                                                       strict=True)))  # type: ignore[arg-type]

    def segments_spread(self) -> tuple[float, float] | None:
        """(output, random order): the std over steps of their mean segments per row, or None
        where no segment counts were measured."""
        k = self.segment_steps
        if not k:
            return None
        s1, s2, r1, r2 = self.segment_moments
        return (float(np.sqrt(max(0.0, s2 / k - (s1 / k) ** 2))),
                float(np.sqrt(max(0.0, r2 / k - (r1 / k) ** 2))))

    def to_dict(self) -> dict:
        """steps; mean, p99 (the upper edge of its 0.001 bin) and max of max / mean, for the
        output and for a random order of its rows; and where measured, the spread of the steps'
        mean segments per row (`segments_spread`) against a random order's."""
        def figures(total: float, top: float, hist: tuple[int, ...]) -> dict:
            if not self.steps:
                return {"mean": 1.0, "p99": 1.0, "max": 1.0}
            k = int(np.searchsorted(np.cumsum(hist), 0.99 * self.steps))
            return {"mean": round(total / self.steps, 6),
                    "p99": round(min(top, 1.0 + (k + 1) * _BALANCE_BIN), 6),
                    "max": round(top, 6)}

        out = {"steps": self.steps, **figures(self.ratio_sum, self.ratio_max, self.hist),
               "random_order": figures(self.random_sum, self.random_max, self.random_hist)}
        spread = self.segments_spread()
        if spread is not None:
            out["segments_per_row_spread"] = {"output": round(spread[0], 6),
                                              "random_order": round(spread[1], 6)}
        return out


def _hist(ratios: np.ndarray) -> tuple[int, ...]:
    k = np.minimum(((ratios - 1.0) / _BALANCE_BIN).astype(np.int64), _BALANCE_BINS - 1)
    return tuple(np.bincount(np.maximum(k, 0), minlength=_BALANCE_BINS).tolist())
