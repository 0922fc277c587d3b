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
    seg = np.asarray(segment_lengths, np.int64).reshape(-1, np.shape(segment_lengths)[-1])
    return _stats(seg.sum(axis=1), (seg > 0).sum(axis=1), seq_len, seg.shape[1], counters)


def stats_of_pieces(row: np.ndarray, length: np.ndarray, num_rows: int, seq_len: int,
                    max_segments: int, counters: Counters | None = None) -> PackingStats:
    """Statistics from each piece's row and length (any order): 16 bytes a row, no [R, S]."""
    row = np.asarray(row)
    length = np.asarray(length, np.int64)
    used = np.bincount(row, weights=length, minlength=num_rows).astype(np.int64)
    nseg = np.bincount(row[length > 0], minlength=num_rows)
    return _stats(used, nseg, seq_len, max_segments, counters)


def _stats(per_row: np.ndarray, nseg: np.ndarray, seq_len: int, S: int,
           counters: Counters | None) -> PackingStats:
    R = int(per_row.size)
    real = int(per_row.sum())
    n = int(nseg.sum())
    cap = R * seq_len
    eff = real / cap if cap else 0.0
    lb = lower_bound(real, n, seq_len, S)
    fill = per_row / seq_len if R else np.zeros(0)
    hist = np.histogram(fill, bins=_FILL_BINS, range=(0.0, 1.0))[0] if R else np.zeros(_FILL_BINS)
    qs = {"min": 0.0, "p1": 1.0, "p10": 10.0, "p50": 50.0, "p90": 90.0, "max": 100.0}
    quant = {k: float(np.percentile(fill, q)) if R else 0.0 for k, q in qs.items()}
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
        segments_per_row=np.bincount(nseg, minlength=S + 1).astype(int).tolist(),
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
