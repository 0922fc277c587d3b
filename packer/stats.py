"""Packing statistics of a batch or a plan: efficiency, padding, histograms."""

from __future__ import annotations

import dataclasses

import numpy as np

from seqpack.packer.contract import Counters, keys, packed_features
from seqpack.packer.plan import PackPlan

_FILL_BINS = 20


def lower_bound(total_tokens: int, num_segments: int, seq_len: int, max_segments: int) -> int:
    """No packing needs fewer rows: max(ceil(tokens / L), ceil(segments / S))."""
    return max(-(-total_tokens // seq_len), -(-num_segments // max_segments))


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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def stats_from_lengths(
    segment_lengths: np.ndarray,  # i32[R, S]
    seq_len: int,
    counters: Counters | None = None,
) -> PackingStats:
    """Statistics from the per-row segment lengths alone."""
    return stats_from_histograms(*length_histograms(segment_lengths, seq_len), seq_len, counters)


def length_histograms(segment_lengths: np.ndarray, seq_len: int
                      ) -> tuple[np.ndarray, np.ndarray]:
    """`row_histograms` of rows given by their `[R, S]` segment lengths."""
    seg = np.asarray(segment_lengths, np.int64).reshape(-1, np.shape(segment_lengths)[-1])
    return _histograms(seg.sum(axis=1), (seg > 0).sum(axis=1), seq_len, seg.shape[1])


def stats_of_pieces(row: np.ndarray, length: np.ndarray, num_rows: int, seq_len: int,
                    max_segments: int, counters: Counters | None = None) -> PackingStats:
    """Statistics from each piece's row and length (any order): 16 bytes a row, no [R, S]."""
    return stats_from_histograms(*row_histograms(row, length, num_rows, seq_len, max_segments),
                                 seq_len, counters)


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
                          counters: Counters | None = None) -> PackingStats:
    """Statistics from `row_histograms` (summed over any parts of a packing)."""
    used_hist = np.asarray(used_hist, np.int64)
    nseg_hist = np.asarray(nseg_hist, np.int64)
    S = nseg_hist.size - 1
    R = int(used_hist.sum())
    real = int((used_hist * np.arange(used_hist.size)).sum())
    n = int((nseg_hist * np.arange(nseg_hist.size)).sum())
    cap = R * seq_len
    eff = real / cap if cap else 0.0
    lb = lower_bound(real, n, seq_len, S)
    fills = np.arange(seq_len + 1) / seq_len
    hist = np.histogram(fills, bins=_FILL_BINS, range=(0.0, 1.0), weights=used_hist)[0]
    qs = {"min": 0.0, "p1": 1.0, "p10": 10.0, "p50": 50.0, "p90": 90.0, "max": 100.0}
    quant = {k: _quantile(used_hist, q) / seq_len if R else 0.0 for k, q in qs.items()}
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
) -> PackingStats:
    """Statistics of a packed batch (contract dict) or of a `PackPlan` (with its counters).

    A plan does not know seq_len / max_segments: pass them. A batch knows both from its shapes;
    pass `counters` (e.g. `plan(...).counters`) to include truncated / dropped / split counts.
    """
    if isinstance(batch, PackPlan):
        if seq_len is None or max_segments is None:
            raise ValueError("stats(plan) needs seq_len= and max_segments=")
        return stats_of_pieces(batch.row, batch.length, batch.num_rows, seq_len, max_segments,
                               counters or batch.counters)
    k = keys(feature or _feature(batch))
    missing = [name for name in (k.values, k.segment_lengths) if name not in batch]
    if missing:
        raise ValueError(f"batch has no {missing[0]!r}; keys are {sorted(batch)}")
    seg = np.asarray(batch[k.segment_lengths])
    values = np.asarray(batch[k.values])
    return stats_from_lengths(seg, int(values.shape[-1]), counters)
