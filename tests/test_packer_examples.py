"""Worked examples, column-aligned as in the module docstrings (seqio style)."""

from __future__ import annotations

import numpy as np
import pytest

from seqpack.packer import PackConfig, StreamPlanner, pack, plan
from seqpack.packer.strategies import (
    assign_best_fit,
    assign_best_fit_decreasing,
    assign_first_fit,
    concat_split_pieces,
)


def test_first_fit_vs_best_fit_worked_example():
    sizes = np.array([5, 6, 2, 3])
    rows, n = assign_first_fit(sizes, 8, 3)
    assert rows.tolist() == [0, 1, 0, 2] and n == 3
    rows, n = assign_best_fit(sizes, 8, 3)
    assert rows.tolist() == [0, 1, 1, 0] and n == 2


def test_best_fit_decreasing_worked_example():
    from seqpack.packer.strategies.bfd import greedy, regime
    from seqpack.packer.strategies.bfd import schedule as bfd

    sizes = np.array([3, 7, 5, 5, 2, 8])
    rows, n = assign_best_fit_decreasing(sizes, 10, 4)
    # sorted 8 7 5 5 3 2 -> row 0 = [8, 2], row 1 = [7, 3], row 2 = [5, 5]
    assert n == 3
    assert rows.tolist() == [1, 1, 2, 2, 0, 0]
    desc = np.sort(sizes)[::-1]
    plans = regime.Regime.of(desc, 10, 4)
    assert plans.bound == 3 and not plans.two_dimensional  # 2 3 5 5 7 overflow a row
    (first, _), (second, _) = bfd.passes(desc, plans)  # few pieces a size: the fill first
    assert first()[0].tolist() == [0, 1, 2, 2, 1, 0] and first()[1] == 3
    assert greedy.bfd_sorted(desc, 10, 4)[0].tolist() == [0, 1, 2, 2, 1, 0]  # plain BFD
    assert greedy.worst_fit_sorted(desc.tolist(), 10, 4, 3) == ([0, 1, 2, 2, 1, 0], 3)


def test_regime_worked_example():
    from seqpack.packer.strategies.bfd import regime

    plans = regime.Regime.of(np.array([6, 5, 2, 1, 1]), 10, 2)
    assert (plans.tokens, plans.pieces, plans.bound, plans.slot_bound) == (15, 5, 3, 3)
    assert plans.slot_share == 1.5 and plans.slots_bind_all and plans.two_dimensional
    assert plans.big_pieces == 1 and plans.big  # the 6, in a third of the bound's rows


def test_refine_worked_example(monkeypatch):
    # capacity 10, max_segments 3: A = [6, 3], B = [5, 4], C = [2], asked for 2 rows (the
    # bound): the repair empties C, A's 6 swapping for B's 5; no later step runs
    from seqpack.packer.strategies.bfd import regime
    from seqpack.packer.strategies.bfd import schedule as bfd

    sizes = np.array([6, 5, 4, 3, 2])
    ran = []

    def spy(name, run):
        def call(*a, **k):
            ran.append((name, a[2]))  # (step, rows it was given)
            return run(*a, **k)
        return call

    for name in ("repair", "merge_repair", "sieve", "sample_fill_sorted", "sieve_all",
                 "swap_search"):
        monkeypatch.setattr(bfd, name, spy(name, getattr(bfd, name)))
    plans = regime.Regime.of(sizes, 10, 3)
    assert plans.bound == 2 and not plans.two_dimensional
    rows, n = bfd.refine(sizes, np.array([0, 1, 1, 0, 2]), 3, plans, 2)
    assert n == 2 and ran == [("repair", 3), ("merge_repair", 2)]  # the merge: at the target
    assert [sorted(sizes[rows == r].tolist()) for r in range(2)] == [[2, 3, 5], [4, 6]]


def test_best_fit_decreasing_segment_bound_uses_every_slot():
    # 8 pieces, 2 slots per row: 4 rows are needed for the slots alone. BFD by size would pair
    # the two 9s with nothing (9 + anything > 10 except 1) and waste slots; worst fit pairs
    # each big piece with a small one.
    sizes = np.array([9, 9, 8, 8, 1, 1, 2, 2])
    rows, n = assign_best_fit_decreasing(sizes, 10, 2)
    assert n == 4
    assert np.bincount(rows).tolist() == [2, 2, 2, 2]
    assert np.bincount(rows, weights=sizes).max() <= 10


def test_concat_split_worked_example():
    ex, st, ln, rw = concat_split_pieces(np.array([3, 4, 2]), 4, 4)
    assert ex.tolist() == [0, 1, 1, 2, 2]
    assert st.tolist() == [0, 0, 1, 0, 1]
    assert ln.tolist() == [3, 1, 3, 1, 1]
    assert rw.tolist() == [0, 0, 1, 1, 2]


def test_concat_split_loop_and_dense_paths_agree():
    from seqpack.packer.strategies import concat_split as cs

    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 40, 200)
    dense = cs._concat_split_dense(lengths, 16)
    loop = concat_split_pieces(lengths, 16, 15, alignment=1)  # S < L: the general loop
    assert np.bincount(loop[3]).max() < 15  # the cap never bound, so the layouts must agree
    for x, y in zip(dense, loop):
        np.testing.assert_array_equal(x, y)


def test_split_plan_worked_example():
    cfg = PackConfig(8, max_segments=4, overflow="split")
    p = plan([5, 11, 0, 3], cfg)
    got = list(zip(p.example.tolist(), p.start.tolist(), p.length.tolist(), p.row.tolist(),
                   p.offset.tolist()))
    #          example start length row offset
    assert got == [(1, 0, 8, 0, 0),
                   (0, 0, 5, 1, 0),
                   (1, 8, 3, 1, 5),
                   (3, 0, 3, 2, 0)]
    assert p.counters.empty_examples == 1
    assert p.counters.split_examples == 1 and p.counters.split_pieces == 2


def test_assemble_worked_example():
    b = pack([np.array([7, 8, 9]), np.array([5, 6]), np.array([4])],
             PackConfig(6, max_segments=2, strategy="first_fit"))
    assert b["tokens"].tolist() == [[7, 8, 9, 5, 6, 0], [4, 0, 0, 0, 0, 0]]
    assert b["tokens_segment_ids"].tolist() == [[1, 1, 1, 2, 2, 0], [1, 0, 0, 0, 0, 0]]
    assert b["tokens_positions"].tolist() == [[0, 1, 2, 0, 1, 0], [0, 0, 0, 0, 0, 0]]
    assert b["tokens_segment_lengths"].tolist() == [[3, 2], [1, 0]]
    assert b["tokens_segment_offsets"].tolist() == [[0, 3], [0, 1]]
    assert b["segment_source_index"].tolist() == [[0, 1], [2, -1]]
    assert b["segment_source_start"].tolist() == [[0, 0], [0, 0]]
    assert b["tokens"].dtype == np.int64 or b["tokens"].dtype == np.array([1]).dtype
    assert b["segment_source_index"].dtype == np.int64
    assert b["tokens_segment_lengths"].dtype == np.int32


def test_alignment_leaves_padding_gaps():
    b = pack([np.array([7, 8, 9]), np.array([5, 6]), np.array([4])],
             PackConfig(8, max_segments=3, segment_alignment=4, strategy="first_fit", pad_id=1))
    assert b["tokens"].tolist() == [[7, 8, 9, 1, 5, 6, 1, 1], [4, 1, 1, 1, 1, 1, 1, 1]]
    assert b["tokens_segment_ids"].tolist()[0] == [1, 1, 1, 0, 2, 2, 0, 0]
    assert b["tokens_segment_offsets"].tolist() == [[0, 4, 6], [0, 1, 1]]


def test_feature_name_prefixes_keys():
    b = pack([np.array([1, 2])], PackConfig(4, feature="inputs"))
    assert set(b) == {"inputs", "inputs_segment_ids", "inputs_positions",
                      "inputs_segment_lengths", "inputs_segment_offsets",
                      "segment_source_index", "segment_source_start"}


def test_token_id_zero_is_a_real_token():
    b = pack([np.array([0, 0, 0])], PackConfig(4, max_segments=2))
    assert b["tokens_segment_lengths"].tolist() == [[3, 0]]
    assert b["tokens_segment_ids"].tolist() == [[1, 1, 1, 0]]


def test_stream_planner_worked_example_of_a_window_planned_from_rows_worth():
    planner = StreamPlanner(PackConfig(8, max_segments=4), window=3, window_rows=2)
    assert planner.add([0, 1, 2], [5, 2, 6]) == []  # 13 tokens, 3 pieces: less than 2 rows
    assert planner.num_open_rows == 0 and planner.oldest_open_id() == 0  # yet held
    state = planner.get_state()
    assert state["pending"] == 1 and [p[0] for p in state["rows"][0]["pieces"]] == [0, 1, 2]
    restored = StreamPlanner(PackConfig(8, max_segments=4), window=3, window_rows=2)
    restored.set_state(state)
    for p in (planner, restored):
        rows = p.add([3, 4, 5], [3, 4, 1])  # 21 tokens: one window of six pieces
        assert [r.length.tolist() for r in rows] == [[2, 6], [5, 3]]
        assert p.num_open_rows == 1 and p.oldest_open_id() == 4  # [4, 1] stays open
        assert [r.index.tolist() for r in p.finish()] == [[4, 5]]


def test_stream_planner_worked_example():
    cfg = PackConfig(8, max_segments=4)
    planner = StreamPlanner(cfg, window=3, max_open_rows=1, window_rows=0)
    rows = planner.add([0, 1, 2], [5, 2, 6])
    assert [r.index.tolist() for r in rows] == [[1, 2]]  # [6, 2] full, [5] carried over
    assert planner.num_open_rows == 1 and planner.oldest_open_id() == 0
    rows = planner.add([3, 4, 5], [3, 4, 1])  # a row takes a third of a window: extended
    assert [r.index.tolist() for r in rows] == [[0, 3]]  # 5 + 3 = 8: full
    rows = planner.finish()
    assert [r.index.tolist() for r in rows] == [[4, 5]]
    assert rows[0].offset.tolist() == [0, 4]


def test_stream_planner_plans_open_rows_again_where_slots_bind():
    # seq_len 8, 2 slots: pieces of mean 3 need 1.3 slots per row's worth of tokens
    planner = StreamPlanner(PackConfig(8, max_segments=2), window=8, window_rows=0)
    rows = planner.add(list(range(8)), [7, 1, 1, 5, 2, 6, 3, 4])
    assert [r.length.tolist() for r in rows] == [[7, 1], [2, 6], [5, 3]]  # full rows out
    assert planner.num_open_rows == 1 and planner.oldest_open_id() == 2  # [1, 4] stays open
    rows = planner.add([8, 9], [4, 3])  # planned again with the open row's pieces
    assert [r.index.tolist() for r in rows] == [[7, 8]]  # 4 + 4: the open row gave up its 4
    assert [p[0] for row in planner.get_state()["rows"] for p in row["pieces"]] == [2, 9]


@pytest.mark.parametrize("max_carry", [0, 1, 2])
def test_stream_rows_never_stay_open_longer_than_max_carry(max_carry):
    # A row opened in window w takes pieces in windows w .. w + max_carry, then is emitted
    # (window_rows=0: every call is a window).
    planner = StreamPlanner(PackConfig(100, max_segments=50), window=2, max_carry=max_carry,
                            window_rows=0)
    for w in range(max_carry):
        assert planner.add([2 * w, 2 * w + 1], [10, 10]) == []
    w = max_carry
    rows = planner.add([2 * w, 2 * w + 1], [10, 10])
    assert [r.index.tolist() for r in rows] == [list(range(2 * w + 2))]
    assert planner.num_open_rows == 0


@pytest.mark.parametrize("strategy", ["first_fit", "best_fit", "best_fit_decreasing"])
def test_segment_cap_is_respected(strategy):
    p = plan([1] * 50, PackConfig(100, max_segments=7, strategy=strategy))
    assert np.bincount(p.row).max() <= 7
    assert p.num_rows == 8
