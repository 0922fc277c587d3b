"""Cost model and the cost statistics: formula, checks, manifest form, summaries that add up."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.packer import (
    CostKind,
    CostModel,
    PackConfig,
    cost_summary,
    pack,
    plan,
    stats,
)
from seqpack.packer.stats import row_histograms, stats_from_histograms


def test_cost_worked_example():
    m = CostModel()  # d_model 4096: k = 49152
    assert m.k == 49152
    np.testing.assert_allclose(m.segment_costs([8192]), [8192 * (1 + 8192 / 49152)])
    one, many = m.row_costs([0] + [1] * 40, [8192] + [200] * 40, 2)
    assert one == pytest.approx(9557.33, abs=0.01) and many == pytest.approx(8032.55, abs=0.01)
    assert CostModel(kind="tokens").row_costs([0, 0, 1], [3, 4, 5], 2).tolist() == [7, 5]
    verl = CostModel(d_model=2048)  # veRL's 7B: 24576 l + l^2, up to the factor 24576
    np.testing.assert_allclose(verl.segment_costs([1000]) * 24576, [24576 * 1000 + 1000**2])


def test_cost_model_checks_and_manifest_form():
    m = CostModel(kind="tokens", d_model=np.int64(1024))
    assert m.kind is CostKind.TOKENS and m.d_model == 1024
    assert CostModel.from_dict(m.to_dict()) == m
    with pytest.raises(ValueError, match="kind='flops' is not known"):
        CostModel(kind="flops")
    with pytest.raises(ValueError, match="d_model=0 must be an int >= 1"):
        CostModel(d_model=0)
    with pytest.raises(ValueError, match="unknown cost model fields"):
        CostModel.from_dict({"kind": "tokens", "width": 3})
    with pytest.raises(ValueError, match=r"row indices must lie in \[0, 2\)"):
        m.row_costs([0, 2], [1, 1], 2)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=60), st.integers(1, 5),
       st.sampled_from(["attention", "tokens"]))
def test_cost_summaries_of_parts_add_up_to_the_whole(lengths, parts, kind):
    cfg = PackConfig(64, max_segments=5, overflow="split")
    p = plan(lengths, cfg)
    if not p.num_rows:
        return
    model = CostModel(kind=kind, d_model=3)
    whole = cost_summary(p.row, p.length, p.num_rows, 64, model)
    cuts = np.linspace(0, p.num_rows, parts + 1).astype(int)  # parts of rows, rows from 0
    total = None
    for a, b in zip(cuts[:-1], cuts[1:]):
        sel = (p.row >= a) & (p.row < b)
        part = cost_summary(p.row[sel] - a, p.length[sel], b - a, 64, model)
        total = part if total is None else total + part
    assert total.num_rows == whole.num_rows and total.sum_sq == whole.sum_sq
    assert total.total_cost == pytest.approx(whole.total_cost)
    assert total.max_row_cost == pytest.approx(whole.max_row_cost)
    np.testing.assert_array_equal(total.cost_hist, whole.cost_hist)
    np.testing.assert_array_equal(total.attention_hist, whole.attention_hist)
    merged = stats_from_histograms(*row_histograms(p.row, p.length, p.num_rows, 64, 5), 64,
                                   costs=total).to_dict()
    direct = stats(p, seq_len=64, max_segments=5, cost=model).to_dict()
    assert merged.keys() == direct.keys()
    assert merged["attention_sum_sq"] == direct["attention_sum_sq"]
    assert merged["row_cost_quantiles"] == pytest.approx(direct["row_cost_quantiles"])
    # The least and most attention of a row are exact (before: bin centres, 20% off at L=32k).
    sq = np.bincount(p.row, weights=p.length.astype(float) ** 2, minlength=p.num_rows) / 64**2
    assert merged["row_attention_quantiles"]["min"] == pytest.approx(sq.min())
    assert merged["row_attention_quantiles"]["max"] == pytest.approx(sq.max())


def test_stats_report_attention_against_whole_rows():
    b = pack([np.arange(8), np.arange(4), np.arange(4)], PackConfig(8, max_segments=4))
    assert stats(b).attention_sum_sq is None  # costs are asked for
    s = stats(b, cost=CostModel())  # rows [8] and [4, 4]
    assert s.attention_sum_sq == 64 + 16 + 16
    assert s.attention_full_sq == 2 * 64
    assert s.attention_fraction == pytest.approx(96 / 128)
    assert s.cost_model == CostModel().to_dict()
    assert s.row_cost_quantiles["max"] == pytest.approx(CostModel().full_row_cost(8))
    assert s.row_cost_max_over_mean > 1
    assert stats(b, cost=CostModel(kind="tokens")).row_cost_quantiles["min"] == 8
    old = stats_from_histograms(np.array([0, 0, 1]), np.array([0, 1]), 2).to_dict()
    assert old["attention_sum_sq"] is None  # without a cost summary: the fields are there, None
    with pytest.raises(ValueError, match="cannot add cost summaries"):
        cost_summary([0], [2], 1, 8) + cost_summary([0], [2], 1, 16)

