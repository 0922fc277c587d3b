"""Packing statistics of a batch or a plan: efficiency, padding, histograms, cost of the rows.

Everything is computed from summaries that add up over parts of a packing (the Beam job plans
per block): `row_histograms` (tokens and segments per row) and `CostSummary` (attention and
model cost per row, `cost_summary`); `stats_from_histograms` turns their sums into
`PackingStats`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from seqpack.packer.bounds import lower_bound
from seqpack.packer.contract import Counters, keys, packed_features
from seqpack.packer.order import CostModel
from seqpack.packer.plan import PackPlan

_FILL_BINS = 20
COST_BINS = 1000  # histogram bins of a row's cost (and attention) over [0, a full row's]
_QUANTILES = {"min": 0.0, "p1": 1.0, "p10": 10.0, "p50": 50.0, "p90": 90.0, "max": 100.0}

__all__ = ["CostSummary", "PackingStats", "cost_summary", "lower_bound", "stats"]


@dataclasses.dataclass(frozen=True)
class CostSummary:
    """What the statistics need of a set of rows' costs; summaries of parts add up (`+`).

    Attention: a segment of l tokens attends over l^2 (query, key) pairs, a row over L^2 if
    attention ignored the segments; `sum_sq` is the sum of l^2. Cost: c(l) of `model`, summed
    per row. The histograms count rows by their fraction of a full row (one L-token segment).
    """

    model: CostModel
    seq_len: int
    num_rows: int
    sum_sq: int  # sum of l^2 over every segment
    total_cost: float  # sum of c(l) over every segment
    max_row_cost: float
    min_row_cost: float
    cost_hist: np.ndarray  # i64[COST_BINS]: rows by cost / full_row_cost
    attention_hist: np.ndarray  # i64[COST_BINS]: rows by sum of l^2 / L^2
    min_row_sq: int = 0  # the least and most sum of l^2 of a row (exact, where the
    max_row_sq: int = 0  # histogram's quantiles are bin centres)

    def __add__(self, other: CostSummary) -> CostSummary:
        if (self.model, self.seq_len) != (other.model, other.seq_len):
            raise ValueError(f"cannot add cost summaries of {self.model} / L={self.seq_len} and "
                             f"{other.model} / L={other.seq_len}")
        if not other.num_rows:
            return self
        if not self.num_rows:
            return other
        return CostSummary(self.model, self.seq_len, self.num_rows + other.num_rows,
                           self.sum_sq + other.sum_sq, self.total_cost + other.total_cost,
                           max(self.max_row_cost, other.max_row_cost),
                           min(self.min_row_cost, other.min_row_cost),
                           self.cost_hist + other.cost_hist,
                           self.attention_hist + other.attention_hist,
                           min(self.min_row_sq, other.min_row_sq),
                           max(self.max_row_sq, other.max_row_sq))


def _bin(x: np.ndarray) -> np.ndarray:
    return np.bincount(np.minimum((x * COST_BINS).astype(np.int64), COST_BINS - 1),
                       minlength=COST_BINS).astype(np.int64)


def cost_summary(row: np.ndarray, length: np.ndarray, num_rows: int, seq_len: int,
                 model: CostModel | None = None) -> CostSummary:
    """`CostSummary` of rows given by each piece's row and length (any order; i64[P] each)."""
    model = model or CostModel()
    row = np.asarray(row, np.int64)
    length = np.asarray(length, np.int64)
    cost = model.row_costs(row, length, num_rows)
    sq = np.bincount(row, weights=length.astype(np.float64) ** 2, minlength=num_rows)
    full = model.full_row_cost(seq_len)
    return CostSummary(
        model=model,
        seq_len=int(seq_len),
        num_rows=int(num_rows),
        sum_sq=int((length * length).sum()),
        total_cost=float(cost.sum()),
        max_row_cost=float(cost.max()) if num_rows else 0.0,
        min_row_cost=float(cost.min()) if num_rows else 0.0,
        cost_hist=_bin(cost / full),
        attention_hist=_bin(sq / float(seq_len) ** 2),
        min_row_sq=int(sq.min()) if num_rows else 0,
        max_row_sq=int(sq.max()) if num_rows else 0,
    )


def _hist_quantiles(hist: np.ndarray, lo: float, hi: float, scale: float) -> dict[str, float]:
    """Quantiles of values binned over [0, 1) x scale (bin centres, within [lo, hi]: within
    half a bin, scale / 2000, of the values'); min and max are lo and hi (exact)."""
    out = {}
    for k, q in _QUANTILES.items():
        value = (_quantile(hist, q) + 0.5) / COST_BINS * scale
        out[k] = lo if k == "min" else hi if k == "max" else min(max(value, lo), hi)
    return out


def cost_fields(c: CostSummary | None) -> dict:
    """The `PackingStats` fields of a cost summary (None: all None)."""
    if c is None or not c.num_rows:
        return {k: None for k in _COST_FIELDS}
    L2 = float(c.seq_len) ** 2
    full = c.model.full_row_cost(c.seq_len)
    mean = c.total_cost / c.num_rows
    return {
        "cost_model": c.model.to_dict(),
        "attention_sum_sq": int(c.sum_sq),
        "attention_full_sq": int(c.num_rows * c.seq_len * c.seq_len),
        "attention_fraction": float(c.sum_sq / (c.num_rows * L2)),
        "row_attention_quantiles": _hist_quantiles(
            c.attention_hist, c.min_row_sq / L2, c.max_row_sq / L2, 1.0),
        "cost_total": float(c.total_cost),
        "cost_full_row": float(full),
        "row_cost_quantiles": _hist_quantiles(c.cost_hist, c.min_row_cost, c.max_row_cost, full),
        "row_cost_max_over_mean": float(c.max_row_cost / mean) if mean else 0.0,
    }


_COST_FIELDS = ("cost_model", "attention_sum_sq", "attention_full_sq", "attention_fraction",
                "row_attention_quantiles", "cost_total", "cost_full_row", "row_cost_quantiles",
                "row_cost_max_over_mean")


@dataclasses.dataclass(frozen=True)
class PackingStats:
    """How well a set of rows is packed. `to_dict()` is JSON-serializable."""

    num_rows: int
    seq_len: int
    max_segments: int
    num_segments: int
    real_tokens: int
    efficiency: float  # real tokens / (rows x L)
    padding_fraction: float
    lower_bound_rows: int
    rows_over_lower_bound: float  # rows / lower bound - 1
    segments_per_row: list[int]  # histogram: [k] = rows holding k segments, k = 0..S
    row_fill_histogram: list[int]  # rows per fill bucket [i/20, (i+1)/20), last includes 1.0
    row_fill_quantiles: dict[str, float]  # min, p1, p10, p50, p90, max of used / L
    counters: dict[str, int]
    # Cost of the rows (None when not computed; see `CostSummary` and packer.order.cost):
    cost_model: dict | None = None  # CostModel.to_dict()
    attention_sum_sq: int | None = None  # sum of l^2 over segments: segment-aware attention
    attention_full_sq: int | None = None  # rows x L^2: attention over whole rows
    attention_fraction: float | None = None  # the first over the second (the rest is saved)
    row_attention_quantiles: dict[str, float] | None = None  # of sum(l^2) / L^2 per row
    cost_total: float | None = None  # sum of c(l) over segments
    cost_full_row: float | None = None  # c(L): the most one row can cost
    row_cost_quantiles: dict[str, float] | None = None  # of a row's sum of c(l)
    row_cost_max_over_mean: float | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def stats_from_lengths(
    segment_lengths: np.ndarray,  # i32[R, S]
    seq_len: int,
    counters: Counters | None = None,
    *,
    cost: CostModel | None = None,
    alignment: int = 1,
) -> PackingStats:
    """Statistics from the per-row segment lengths alone; with `cost`, the rows' costs too
    (`alignment`: as `stats_of_pieces`)."""
    seg = np.asarray(segment_lengths, np.int64).reshape(-1, np.shape(segment_lengths)[-1])
    c = None
    if cost is not None:
        row = np.repeat(np.arange(seg.shape[0]), seg.shape[1])
        c = cost_summary(row, seg.reshape(-1), seg.shape[0], seq_len, cost)
    return stats_from_histograms(*length_histograms(seg, seq_len), seq_len, counters, costs=c,
                                 slack=alignment_slack(seg, alignment))


def length_histograms(segment_lengths: np.ndarray, seq_len: int
                      ) -> tuple[np.ndarray, np.ndarray]:
    """`row_histograms` of rows given by their `[R, S]` segment lengths."""
    seg = np.asarray(segment_lengths, np.int64).reshape(-1, np.shape(segment_lengths)[-1])
    return _histograms(seg.sum(axis=1), (seg > 0).sum(axis=1), seq_len, seg.shape[1])


def stats_of_pieces(row: np.ndarray, length: np.ndarray, num_rows: int, seq_len: int,
                    max_segments: int, counters: Counters | None = None, *,
                    cost: CostModel | None = None, alignment: int = 1) -> PackingStats:
    """Statistics from each piece's row and length (any order): 16 bytes a row, no [R, S]
    (24 with `cost`: the rows' costs too, as `cost_summary` gives them). `alignment`: the
    config's (`PackConfig.alignment`): the lower bound counts each piece rounded up to it."""
    c = None if cost is None else cost_summary(row, length, num_rows, seq_len, cost)
    return stats_from_histograms(*row_histograms(row, length, num_rows, seq_len, max_segments),
                                 seq_len, counters, costs=c,
                                 slack=alignment_slack(length, alignment))


def alignment_slack(length: np.ndarray, alignment: int) -> int:
    """Tokens that rounding each piece of `length` up to `alignment` adds (each segment starts
    at a multiple of it): what the rows hold besides the tokens and no plan avoids."""
    length = np.asarray(length, np.int64)
    return int((-length % alignment).sum()) if alignment > 1 else 0


def row_histograms(row: np.ndarray, length: np.ndarray, num_rows: int, seq_len: int,
                   max_segments: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows holding u tokens, u = 0..L; rows holding k segments, k = 0..S): what the
    statistics need of a set of rows. Histograms of parts of a packing add up."""
    row = np.asarray(row)
    length = np.asarray(length)
    used = np.zeros(num_rows, np.int64)
    nseg = np.zeros(num_rows, np.int64)
    step = 1 << 20  # a million pieces at a time: temporaries stay small
    for a in range(0, row.size, step):
        r, n = row[a : a + step], length[a : a + step]
        lo = int(r.min())  # sorted rows (a plan's order) make each chunk's range short
        r = r - lo
        got = np.bincount(r, weights=n).astype(np.int64)
        used[lo : lo + got.size] += got
        got = np.bincount(r[n > 0])
        nseg[lo : lo + got.size] += got
    return _histograms(used, nseg, seq_len, max_segments)


def _histograms(used: np.ndarray, nseg: np.ndarray, seq_len: int, max_segments: int
                ) -> tuple[np.ndarray, np.ndarray]:
    return (np.bincount(used, minlength=seq_len + 1).astype(np.int64),
            np.bincount(nseg, minlength=max_segments + 1).astype(np.int64))


def _quantile(counts: np.ndarray, q: float) -> float:
    """The q-th percentile (numpy's "linear" method) of the values 0..len(counts)-1 repeated
    counts[v] times, without repeating them."""
    n = int(counts.sum())
    cum = np.cumsum(counts)
    h = (n - 1) * q / 100.0
    lo = int(np.floor(h))
    hi = min(lo + 1, n - 1)
    a, b = (float(np.searchsorted(cum, k, side="right")) for k in (lo, hi))
    return a + (b - a) * (h - lo)


def stats_from_histograms(used_hist: np.ndarray, nseg_hist: np.ndarray, seq_len: int,
                          counters: Counters | None = None, *,
                          costs: CostSummary | None = None, slack: int = 0) -> PackingStats:
    """Statistics from `row_histograms` and `cost_summary` (each summed over any parts of a
    packing); without `costs` the cost fields are None. `slack`: the alignment's tokens
    (`alignment_slack`, summed likewise), counted in the lower bound."""
    used_hist = np.asarray(used_hist, np.int64)
    nseg_hist = np.asarray(nseg_hist, np.int64)
    S = nseg_hist.size - 1
    R = int(used_hist.sum())
    real = int((used_hist * np.arange(used_hist.size)).sum())
    n = int((nseg_hist * np.arange(nseg_hist.size)).sum())
    cap = R * seq_len
    eff = real / cap if cap else 0.0
    lb = lower_bound(real + slack, n, seq_len, S)
    fills = np.arange(seq_len + 1) / seq_len
    hist = np.histogram(fills, bins=_FILL_BINS, range=(0.0, 1.0), weights=used_hist)[0]
    quant = {k: _quantile(used_hist, q) / seq_len if R else 0.0 for k, q in _QUANTILES.items()}
    return PackingStats(
        num_rows=R,
        seq_len=int(seq_len),
        max_segments=int(S),
        num_segments=n,
        real_tokens=real,
        efficiency=float(eff),
        padding_fraction=float(1.0 - eff) if cap else 0.0,
        lower_bound_rows=int(lb),
        rows_over_lower_bound=float(R / lb - 1.0) if lb else 0.0,
        segments_per_row=nseg_hist.astype(int).tolist(),
        row_fill_histogram=[int(x) for x in hist],
        row_fill_quantiles=quant,
        counters=(counters or Counters()).to_dict(),
        **cost_fields(costs),
    )


def _feature(batch: dict) -> str:
    features = packed_features(batch)
    if len(features) != 1:
        found = [k for k in batch if k.endswith("_segment_lengths")]
        raise ValueError(
            f"batch must hold exactly one '<feature>_segment_lengths' key, found {found}; "
            "pass feature= to pick one"
        )
    return features[0]


def stats(
    batch: dict | PackPlan,
    *,
    seq_len: int | None = None,
    max_segments: int | None = None,
    counters: Counters | None = None,
    feature: str | None = None,
    cost: CostModel | None = None,
    alignment: int = 1,
) -> PackingStats:
    """Statistics of a packed batch (contract dict) or of a `PackPlan` (with its counters);
    with `cost` (a `CostModel`) the rows' attention and cost too (else those fields are None);
    `alignment` (`PackConfig.alignment`): the lower bound counts each segment rounded up to it.

    A plan does not know seq_len / max_segments: pass them. A batch knows both from its shapes;
    pass `counters` (e.g. `plan(...).counters`) to include truncated / dropped / split counts.
    """
    if isinstance(batch, PackPlan):
        if seq_len is None or max_segments is None:
            raise ValueError("stats(plan) needs seq_len= and max_segments=")
        return stats_of_pieces(batch.row, batch.length, batch.num_rows, seq_len, max_segments,
                               counters or batch.counters, cost=cost, alignment=alignment)
    k = keys(feature or _feature(batch))
    missing = [name for name in (k.values, k.segment_lengths) if name not in batch]
    if missing:
        raise ValueError(f"batch has no {missing[0]!r}; keys are {sorted(batch)}")
    seg = np.asarray(batch[k.segment_lengths])
    values = np.asarray(batch[k.values])
    return stats_from_lengths(seg, int(values.shape[-1]), counters, cost=cost,
                              alignment=alignment)
