"""The ordering stage: permutation, row orders per block and global, queries, balance helpers."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.packer import (
    CostModel,
    PackConfig,
    Permutation,
    RowOrder,
    balance_slices,
    block_layout,
    global_order,
    ordered,
    plan_rows,
    step_balance,
)
from seqpack.packer.order import StepBalance

modes = st.sampled_from([("shuffle", None, 1), ("plan", None, 1), ("balanced", 1, 1),
                         ("balanced", 2, 1), ("balanced", 3, 2), ("balanced", 4, 3)])
block_costs = st.lists(st.lists(st.floats(0, 100), max_size=30), min_size=1, max_size=5)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 3000), st.integers(0, 2**63 - 1))
def test_permutation_is_a_deterministic_bijection(n, seed):
    p = Permutation(n, seed)
    x = np.arange(n)
    y = p(x)
    assert np.array_equal(np.sort(y), x)
    assert np.array_equal(p.inverse(y), x)
    assert np.array_equal(Permutation(n, seed)(x), y)
    if n >= 8:
        assert not np.array_equal(Permutation(n, seed ^ 1)(x), y)  # the seed changes it


@settings(max_examples=150, deadline=None)
@given(modes, block_costs, st.integers(0, 99), st.data())
def test_row_orders_are_bijections_any_shard_range_agrees(mode, blocks, seed, data):
    m, D, b = mode
    order = RowOrder(mode=m, seed=seed, data_parallel=D, batch_size=b)
    g, layouts = ordered([np.asarray(c) for c in blocks], order)
    n = g.num_rows
    full = g.plan_rows_at(0, n, layouts)
    assert np.array_equal(np.sort(full), np.arange(n))
    assert np.array_equal(g.output_positions(full, layouts), np.arange(n))
    a = data.draw(st.integers(0, n))
    z = data.draw(st.integers(a, n))  # a shard's range, e.g. resuming at shard a
    assert np.array_equal(g.plan_rows_at(a, z, layouts), full[a:z])
    again, _ = ordered([np.asarray(c) for c in blocks], order)
    assert np.array_equal(again.plan_rows_at(0, n, layouts), full)  # deterministic
    # Beam: summaries arrive in any order, only the layouts of the blocks queried are needed
    shuffled = [lay.summary() for lay in layouts][::-1]
    g2 = global_order(shuffled, order)
    assert np.array_equal(g2.plan_rows_at(0, n, dict(enumerate(layouts))), full)
    j = data.draw(st.integers(0, len(layouts) - 1))
    rows_j = np.arange(g.row_base[j], g.row_base[j + 1])
    np.testing.assert_array_equal(g2.output_positions(rows_j, {j: layouts[j]}),
                                  g.output_positions(rows_j, layouts))
    if m == "balanced" and n:  # the last step is the only incomplete one, at the end
        G = D * b
        assert g.num_full_steps == n // G


def test_balanced_one_block_is_the_one_block_computation():
    costs = np.random.default_rng(0).lognormal(8, 1, 103)
    order = RowOrder(mode="balanced", seed=3, data_parallel=4, batch_size=2)
    lay = block_layout(costs, order, block=0)
    g = global_order([lay.summary()], order)
    g1, lays = ordered([costs], order)
    np.testing.assert_array_equal(g.plan_rows_at(0, 103, [lay]), g1.plan_rows_at(0, 103, lays))
    assert lay.rows.size == 96 and lay.leftover.size == 7  # 103 = 12 steps of 8 + 7
    assert lay.rows.dtype == np.int32  # 4 bytes a row


def test_balanced_order_worked_example():
    order = RowOrder(mode="balanced", seed=0, data_parallel=2)
    g, lays = ordered([np.array([9, 1, 5, 8, 2, 4, 6.0])], order)
    assert lays[0].rows.tolist() == [0, 3, 2, 6, 5, 4] and lays[0].leftover.tolist() == [1]
    assert g.plan_rows_at(0, 7, lays).tolist() == [5, 4, 0, 3, 2, 6, 1]


def _wide_spread_rows():
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(5, 1.3, 40_000).astype(np.int64) + 1, 8192)
    cfg = PackConfig(8192, max_segments=64)
    a = plan_rows(lengths, cfg)
    nseg = np.bincount(a.row, minlength=a.num_rows)
    return a, lengths, nseg


def test_shuffle_composition_is_uncorrelated_with_the_row_index():
    a, _, nseg = _wide_spread_rows()
    n = a.num_rows
    idx = np.arange(n)

    def corr(order):
        g, lays = ordered([np.zeros(n)], order)
        seg = nseg[g.plan_rows_at(0, n, lays)]
        return abs(np.corrcoef(idx, seg)[0, 1]), seg

    c_plan, _ = corr(RowOrder(mode="plan"))
    c_shuf, seg = corr(RowOrder())
    assert c_plan > 0.5  # the planner's order: a length curriculum
    assert c_shuf < 0.1
    tenths = np.array([part.mean() for part in np.array_split(seg, 10)])
    spread = seg.std() / np.sqrt(n / 10)  # of a tenth's mean, were rows drawn at random
    assert np.abs(tenths - seg.mean()).max() < 4 * spread  # every tenth has the same mix
    plan_tenths = np.array([part.mean() for part in np.array_split(nseg, 10)])
    assert np.abs(plan_tenths - nseg.mean()).max() > 10 * spread


def test_balanced_steps_are_even_under_the_model():
    a, lengths, _ = _wide_spread_rows()
    from seqpack.packer.plan import pieces

    length = np.concatenate([ln for _, _, ln in pieces(lengths, PackConfig(8192))])
    costs = CostModel().row_costs(a.row, length, a.num_rows)
    for D, b in [(8, 1), (64, 1), (8, 4)]:
        order = RowOrder(mode="balanced", data_parallel=D, batch_size=b)
        g, lays = ordered([costs], order)
        out = costs[g.plan_rows_at(0, a.num_rows, lays)]
        shuffled = costs[ordered([costs], RowOrder())[0].plan_rows_at(0, a.num_rows)]
        assert step_balance(out, D, b).mean() <= 1.02
        assert step_balance(out, D, b).mean() < step_balance(shuffled, D, b).mean()


def test_row_order_checks_and_manifest_form():
    o = RowOrder(mode="balanced", seed=7, data_parallel=8, batch_size=2,
                 cost=CostModel(d_model=1024))
    assert RowOrder.from_dict(o.to_dict()) == o and o.step_rows == 16
    assert RowOrder.from_dict(RowOrder().to_dict()) == RowOrder()
    with pytest.raises(ValueError, match="data_parallel=None must be an int >= 1"):
        RowOrder(mode="balanced")
    with pytest.raises(ValueError, match="are for mode='balanced' only"):
        RowOrder(data_parallel=8)
    with pytest.raises(ValueError, match="mode='sorted' is not known"):
        RowOrder(mode="sorted")
    with pytest.raises(ValueError, match="seed=-1"):
        RowOrder(seed=-1)
    g, lays = ordered([np.ones(40)], o)
    with pytest.raises(ValueError, match="needs the blocks' layouts"):
        g.plan_rows_at(0, 5)
    with pytest.raises(ValueError, match="a summary"):
        g.plan_rows_at(0, 5, [lays[0].summary()])
    with pytest.raises(ValueError, match=r"output rows \[0, 41\) must lie in \[0, 40\]"):
        g.plan_rows_at(0, 41, lays)
    with pytest.raises(ValueError, match=r"blocks \[0, 0\] must be of blocks 0..1, each once"):
        global_order([lays[0].summary(), lays[0].summary()], o)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.integers(0, 40), st.integers(0, 2**32))
def test_balance_slices_is_an_even_permutation(parts, per, seed):
    rng = np.random.default_rng(seed)
    costs = rng.lognormal(5, 1.5, parts * per)
    p = balance_slices(costs, parts)
    assert np.array_equal(np.sort(p), np.arange(costs.size))
    sums = costs[p].reshape(parts, per).sum(axis=1) if per else np.zeros(parts)
    naive = costs.reshape(parts, per).sum(axis=1) if per else np.zeros(parts)
    assert sums.max() - sums.min() <= naive.max() - naive.min() + 1e-9
    if per >= 8:
        assert sums.max() <= sums.mean() + costs.max()  # the LPT bound
    assert np.array_equal(balance_slices(costs, parts), p)


def test_balance_slices_worked_example_and_metric():
    p = balance_slices([7, 1, 4, 4, 2, 6], 2)
    assert p.tolist() == [3, 4, 5, 0, 1, 2]
    with pytest.raises(ValueError, match="multiple of parts=4"):
        balance_slices(np.ones(6), 4)
    np.testing.assert_allclose(step_balance([1, 3, 2, 2, 5], 2, 1), [1.5, 1.0])
    np.testing.assert_allclose(step_balance([1, 3, 2, 2], 2, 2), [1.0])


def test_step_balance_of_a_layout_and_its_sum_over_parts():
    costs = np.array([4.0, 4.0, 1.0, 1.0, 3.0, 1.0])
    even = StepBalance.of(costs, [0, 1, 2, 3], [0, 2, 1, 3], 2, 1)  # steps (4, 4), (1, 1)
    d = even.to_dict()
    assert d["steps"] == 2 and d["mean"] == d["max"] == d["p99"] == 1.0
    assert d["random_order"] == {"mean": 1.6, "p99": 1.6, "max": 1.6}  # (4, 1): 4 / 2.5
    part = StepBalance.of(costs, [4, 5], [5, 4], 2, 1)  # (3, 1): 3 / 2
    both = (even + part).to_dict()
    assert both["steps"] == 3 and both["max"] == 1.5
    assert both["mean"] == pytest.approx((1 + 1 + 1.5) / 3, abs=1e-6)
    assert both["p99"] == 1.5  # the top bin: capped at the max
    assert StepBalance.of(costs, [], [], 2, 1).to_dict()["mean"] == 1.0  # no full step
    with pytest.raises(ValueError, match="steps against"):
        StepBalance.of(costs, [0, 1, 2, 3], [0, 1], 2, 1)


def _spread(out, nseg, D, b):
    steps = out.size // (D * b)
    return nseg[out[: steps * D * b]].reshape(steps, -1).mean(axis=1).std()


@pytest.mark.parametrize("D, b", [(8, 2), (8, 4), (4, 4)])
def test_balanced_steps_of_several_rows_a_rank_stay_random_samples(D, b):
    # with b >= 2 rows a rank, a step is a random draw of rows dealt to the ranks by cost: the
    # steps' mean segments per row spread like a random order's (at most 1.5 times), not like
    # steps of like rows, and the ranks still balance
    a, lengths, nseg = _wide_spread_rows()
    from seqpack.packer.plan import pieces

    length = np.concatenate([ln for _, _, ln in pieces(lengths, PackConfig(8192))])
    costs = CostModel().row_costs(a.row, length, a.num_rows)
    order = RowOrder(mode="balanced", data_parallel=D, batch_size=b)
    g, lays = ordered([costs], order, [nseg])
    out = g.plan_rows_at(0, a.num_rows, lays)
    shuffled = ordered([costs], RowOrder())[0].plan_rows_at(0, a.num_rows)
    assert _spread(out, nseg, D, b) <= 1.5 * _spread(shuffled, nseg, D, b)
    balance = step_balance(costs[out], D, b)
    assert balance.mean() <= 1.02 < step_balance(costs[shuffled], D, b).mean() + 0.02
    # the manifest's figures say both: the ranks' balance and the steps' spread
    stats = g.balance.to_dict()
    spread = stats["segments_per_row_spread"]
    assert spread["output"] <= 1.5 * spread["random_order"]
    assert stats["mean"] <= 1.02
    # one row a rank: grouping rows of like cost is the only lever, and it shows
    grouped = ordered([costs], RowOrder(mode="balanced", data_parallel=D), [nseg])[0]
    figures = grouped.balance.to_dict()
    assert figures["mean"] < 1.005
    assert figures["segments_per_row_spread"]["output"] > \
        1.5 * figures["segments_per_row_spread"]["random_order"]


def test_balanced_steps_without_segment_counts_balance_first():
    # without the rows' segment counts the spread is not measured: the heaviest rows are
    # grouped until every drawn step balances
    a, lengths, nseg = _wide_spread_rows()
    from seqpack.packer.plan import pieces

    length = np.concatenate([ln for _, _, ln in pieces(lengths, PackConfig(8192))])
    costs = CostModel().row_costs(a.row, length, a.num_rows)
    order = RowOrder(mode="balanced", data_parallel=8, batch_size=2)
    lay = block_layout(costs, order)
    steps = costs[lay.rows].reshape(-1, 8, 2).sum(axis=2)
    drawn = steps.max(axis=1) / steps.mean(axis=1)
    assert (drawn <= 1.02 + 1e-9).mean() > 0.95
    assert "segments_per_row_spread" not in lay.balance.to_dict()
    with pytest.raises(ValueError, match="one count per row"):
        block_layout(costs, order, segments=nseg[:-1])
