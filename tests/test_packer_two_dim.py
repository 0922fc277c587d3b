"""The two-dimensional planner: tight bound, two-pool pass (lists and numpy), repair, cascade."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.packer import PackConfig, StreamPlanner, bounds, plan, tight_lower_bound
from seqpack.packer.bounds import SLOTS_BIND_ALL, lower_bound, sizes_slot_share, slots_can_bind
from seqpack.packer.online import stream as stream_mod
from seqpack.packer.plan import apply_overflow
from seqpack.packer.strategies.bfd import greedy, regime, two_pool
from seqpack.packer.strategies.bfd import schedule as bfd
from tests.helpers.packer import check_rows as _check
from tests.helpers.packer import instances

# the modules (the refine package exports their functions under the same names)
repair_mod = importlib.import_module("seqpack.packer.strategies.bfd.refine.repair")
sieve_mod = importlib.import_module("seqpack.packer.strategies.bfd.refine.sieve")


@settings(max_examples=120, deadline=None)
@given(instances)
def test_cascade_packs_within_limits_at_or_above_the_bound(inst):
    L, S, sizes = inst
    sizes = np.asarray(sizes, np.int64)
    rows, n = bfd.assign_best_fit_decreasing(sizes, L, S)
    _check(sizes, rows, n, L, S)
    bound = tight_lower_bound(sizes, L, S)
    assert lower_bound(int(sizes.sum()), sizes.size, L, S) <= bound <= n
    again = bfd.assign_best_fit_decreasing(sizes, L, S)  # deterministic
    assert again[1] == n and np.array_equal(again[0], rows)


@settings(max_examples=120, deadline=None)
@given(instances, st.integers(0, 5))
def test_two_pool_lists_and_numpy_place_the_same_rows(inst, extra):
    L, S, sizes = inst
    desc = np.sort(np.asarray(sizes, np.int64))[::-1]
    open_rows = tight_lower_bound(desc, L, S) + extra
    got = {}
    for mode, (long_run, short_run) in {"lists": (10**9, 0), "numpy": (0, 0),
                                        "mixed": (3, 2)}.items():
        saved = two_pool._LONG_RUN, two_pool._SHORT_RUN, two_pool._SPREAD
        two_pool._LONG_RUN, two_pool._SHORT_RUN, two_pool._SPREAD = long_run, short_run, 10**9
        try:
            got[mode] = two_pool.two_pool_sorted(desc, L, S, open_rows)
        finally:
            two_pool._LONG_RUN, two_pool._SHORT_RUN, two_pool._SPREAD = saved
        _check(desc, *got[mode], L, S)
    for mode in ("numpy", "mixed"):
        assert got[mode][1] == got["lists"][1]
        assert np.array_equal(got[mode][0], got["lists"][0]), mode


@settings(max_examples=100, deadline=None)
@given(instances)
def test_repair_keeps_every_piece_and_never_adds_rows(inst):
    L, S, sizes = inst
    sizes = np.asarray(sizes, np.int64)
    desc = np.sort(sizes)[::-1]
    rows, n = greedy.bfd_sorted(desc, L, S)
    fixed, m = repair_mod.repair(desc, np.asarray(rows, np.int64), n, L, S, target=0)
    _check(desc, fixed, m, L, S)
    assert tight_lower_bound(desc, L, S) <= m <= n


@settings(max_examples=120, deadline=None)
@given(instances)
def test_one_dimensional_gate_is_exact_and_only_plain_bfd_and_the_fill_run(inst):
    L, S, sizes = inst
    asc = np.sort(np.asarray(sizes, np.int64))
    assert bounds.sorted_lower_bound(asc, L, S) == tight_lower_bound(asc[::-1], L, S)
    desc = asc[::-1]
    can_bind = slots_can_bind(asc, L, S)
    rows, n = greedy.bfd_sorted(desc, L, S)
    counts = np.bincount(rows, minlength=n)
    room = L - np.bincount(rows, weights=desc, minlength=n)
    outside = np.array([desc[rows != r].min(initial=L + 1) for r in range(n)])  # smallest other
    starved = (counts == S) & (room >= outside)  # full in slots with room for another piece
    if not can_bind:
        assert not starved.any()
        plan = regime.Regime.of(desc, L, S)
        assert len(bfd.passes(desc, plan, window=1024)) == 1  # plain BFD alone
        passes = bfd.passes(desc, plan)
        assert len(passes) == 2  # offline: plain BFD and the exact fill, the cheaper first
        few = desc.size <= bfd._FILL_FIRST * np.unique(desc).size  # few pieces a size
        first = (bfd.fill_sorted if few else greedy.bfd_sorted)(desc, L, S)
        got = passes[0][0]()
        assert got[1] == first[1] and np.array_equal(got[0], first[0])
    if starved.any():
        assert can_bind


def _window_plan(L, S):
    return lambda s: bfd.assign_best_fit_decreasing(s, L, S, slack=0, repair_rows=False)


@settings(max_examples=100, deadline=None)
@given(instances, st.integers(1, 9))
def test_sieve_keeps_every_piece_and_never_adds_rows(inst, window):
    L, S, sizes = inst
    desc = np.sort(np.asarray(sizes, np.int64))[::-1]
    rows, n = greedy.bfd_sorted(desc, L, S)
    got, m = sieve_mod.sieve(desc, np.asarray(rows, np.int64), n, L, _window_plan(L, S),
                             window=window)
    _check(desc, got, m, L, S)
    assert tight_lower_bound(desc, L, S) <= m <= n
    if m == n:
        assert np.array_equal(got, rows)  # not fewer rows: the plan as it was
    again = sieve_mod.sieve(desc, np.asarray(rows, np.int64), n, L, _window_plan(L, S),
                            window=window)
    assert again[1] == m and np.array_equal(again[0], got)  # seeded: deterministic
    every, k = sieve_mod.sieve_all(desc, L, _window_plan(L, S), window=window)
    _check(desc, every, k, L, S)


def test_sieve_worked_example():
    # the example of strategies/bfd/refine/sieve.py: capacity 10, 3 slots, windows of 4, plain
    # BFD's plan
    sizes = np.array([6, 3, 3, 2, 2, 2])
    rows, n = greedy.bfd_sorted(sizes, 10, 3)
    assert n == 3 and rows.tolist() == [0, 0, 1, 1, 1, 2]  # [6, 3] [3, 2, 2] [2]
    got, m = sieve_mod.sieve(sizes, np.asarray(rows, np.int64), n, 10, _window_plan(10, 3),
                             window=4)
    assert m == 2
    assert sorted(sorted(sizes[got == r].tolist()) for r in range(m)) == [[2, 2, 6], [2, 3, 3]]


def test_keep_open_keeps_rows_not_exactly_full_least_filled_first():
    used = np.array([10, 7, 9, 3, 10, 5, 8, 9])
    count = np.array([2, 3, 1, 2, 3, 1, 2, 2])
    assert sieve_mod.keep_open(used, count, 10, 10, 100).tolist() == [3, 5, 1, 6, 2, 7]
    assert sieve_mod.keep_open(used, count, 10, 2, 100).tolist() == [3, 5]  # max_rows
    # up to 2 * window = 4 pieces (rows 3, 5), or while the rows before hold under 2 rows of
    # tokens (3, 5, 1, 6: 0, 3, 8, 15 tokens before; 2 has 23 before it)
    assert sieve_mod.keep_open(used, count, 10, 10, 2).tolist() == [3, 5, 1, 6]


@pytest.mark.parametrize("mu, sigma, L, S", [(5.8, 1.0, 4096, 12), (6.0, 0.8, 4096, 16)])
def test_offline_default_near_the_bound_where_room_spreads_thin(mu, sigma, L, S):
    # chat-like lognormal lengths with slots and tokens both binding: the first pass (two-pool)
    # and the repair alone stay above the target (a few tokens of room in many rows); the sieve
    # gets there
    rng = np.random.default_rng(0)
    lengths = np.minimum(np.maximum(rng.lognormal(mu, sigma, 8000).astype(np.int64), 1), L)
    desc = np.sort(lengths)[::-1]
    bound = tight_lower_bound(desc, L, S)
    target = bfd.repair_target(bound)
    rows, n = bfd.assign_best_fit_decreasing(lengths, L, S)
    _check(lengths, rows, n, L, S)
    assert n <= target
    first = bfd.passes(desc, regime.Regime.of(desc, L, S))[0][0]()
    repaired = repair_mod.repair(desc, np.asarray(first[0], np.int64), first[1], L, S,
                                 target=target)
    assert repaired[1] > target


def test_offline_default_near_the_bound_where_slots_and_tokens_bind_alike(monkeypatch):
    # slots bind for the whole corpus (ceil(n / S) is 98% of the token bound): plain BFD, worst
    # fit into ceil(n / S) rows and the two-pool pass stay 5-10% above the bound, and the
    # repair after them. Worst fit into the tight bound's rows (pieces over L/2 are in 31% of
    # them) reaches the target; without it the whole corpus through the sieve (the last
    # resort) gets within 1%
    rng = np.random.default_rng(0)
    lengths = np.minimum(np.maximum(rng.lognormal(5.0, 1.1, 6000).astype(np.int64), 1), 2048)
    desc = np.sort(lengths)[::-1]
    bound = tight_lower_bound(desc, 2048, 8)
    rows, n = bfd.assign_best_fit_decreasing(lengths, 2048, 8)
    _check(lengths, rows, n, 2048, 8)
    assert n <= bfd.repair_target(bound)
    monkeypatch.setattr(regime, "big_pieces", lambda sizes_desc, capacity: 0)
    passes = [run() for run, _ in bfd.passes(desc, regime.Regime.of(desc, 2048, 8))]
    assert len(passes) == 3 and min(m for _, m in passes) > bound * 1.05
    best = min(passes, key=lambda p: p[1])
    repaired = repair_mod.repair(desc, np.asarray(best[0], np.int64), best[1], 2048, 8,
                                 target=bfd.repair_target(bound))
    assert repaired[1] > bound * 1.05
    passes_of = bfd.passes
    monkeypatch.setattr(bfd, "passes", lambda *a, whole=False, **k: passes_of(*a, **k))
    rows, n = bfd.assign_best_fit_decreasing(lengths, 2048, 8)
    _check(lengths, rows, n, 2048, 8)
    assert n <= bound * 1.01


def test_worst_fit_deals_into_the_tight_bounds_rows(monkeypatch):
    # long-file-like lognormal lengths at 8192 / 5: the slots bind for the whole corpus
    # (ceil(n / S) is 91% of the token bound), and the tight bound (912) counts the pieces over
    # L/2 that ceil(n / S) (800) does not. Dealt into 800 rows, those pieces open rows of their
    # own late and the short tail fills them; dealt into the tight bound's rows, every row
    # gets one big piece and its share of the tail.
    rng = np.random.default_rng(1)
    lengths = np.clip(np.exp(rng.normal(7.0, 1.1, 4000)).astype(np.int64), 1, 8192)
    desc = np.sort(lengths)[::-1]
    bound = tight_lower_bound(desc, 8192, 5)
    assert sizes_slot_share(desc, 8192, 5) >= SLOTS_BIND_ALL
    assert -(-lengths.size // 5) < bound - 100

    def worst_fit(deal_bound):
        passes = bfd.passes(desc, regime.Regime.of(desc, 8192, 5), whole=deal_bound)
        return passes[1][0]()[1]  # plain BFD, then worst fit

    assert worst_fit(True) <= bound + 5 and worst_fit(False) > bound + 100
    rows, n = bfd.assign_best_fit_decreasing(lengths, 8192, 5)
    _check(lengths, rows, n, 8192, 5)
    assert n <= bfd.repair_target(bound)
    # without it (and without pass 4, which deals into the same rows where pieces over L/2
    # are in a quarter of them: here in half, and the sample fill, which gets there too) the
    # plan stays above the target
    passes = bfd.passes
    monkeypatch.setattr(bfd, "passes", lambda *a, whole=False, **k: passes(*a, **k))
    monkeypatch.setattr(regime, "big_pieces", lambda sizes_desc, capacity: 0)
    monkeypatch.setattr(bfd, "_SAMPLE_MODES", ())
    assert bfd.assign_best_fit_decreasing(lengths, 8192, 5)[1] > bfd.repair_target(bound)


def test_sieve_windows_hold_rows_worth_where_a_row_takes_hundreds_of_pieces():
    # dialogue-turn-like lengths (mean 41) at L=8192 / S=203: a row takes 200 pieces, and
    # windows of 512 cannot mix sizes within a row (+7 rows of 99); 64 rows' worth can
    rng = np.random.default_rng(0)
    lengths = np.clip(np.rint(rng.lognormal(3.2, 1.0, 20_000)), 1, 8192).astype(np.int64)
    S = round(8192 / lengths.mean())
    bound = tight_lower_bound(lengths, 8192, S)
    desc = np.sort(lengths)[::-1]
    window = sieve_mod.sieve_window(regime.Regime.of(desc, 8192, S).pieces_per_row)
    assert window == int(64 * min(S, 8192 * lengths.size / lengths.sum()))
    plan_window, last = bfd.sieve_planners(8192, S)
    rows, n = sieve_mod.sieve_all(lengths, 8192, plan_window, last=last, window=window)
    _check(lengths, rows, n, 8192, S)
    assert n <= bound + 1
    assert sieve_mod.sieve_all(lengths, 8192, plan_window, last=last, window=512)[1] > bound + 3
    per_row = regime.Regime.of(desc, 8192, 4).pieces_per_row
    assert sieve_mod.sieve_window(per_row) == sieve_mod._WINDOW  # 64 x 4 pieces: 512


def test_tight_bound_worked_example():
    # 10 10 10 fill their rows; the four 1s need two more rows of two slots
    assert lower_bound(34, 7, 10, 2) == 4
    assert tight_lower_bound([10, 10, 10, 1, 1, 1, 1], 10, 2) == 5
    with pytest.raises(ValueError, match=r"sizes must lie in \[1, 10\]"):
        tight_lower_bound([11], 10, 2)


def test_repair_worked_example():
    # the example of strategies/bfd/refine/repair.py: capacity 10, 3 slots, bound 2
    sizes = np.array([6, 3, 5, 4, 2])
    rows = np.array([0, 0, 1, 1, 2])  # A = [6, 3], B = [5, 4], C = [2]
    fixed, m = repair_mod.repair(sizes, rows, 3, 10, 3, target=2)
    assert m == 2
    assert fixed.tolist() == [1, 0, 0, 1, 0]  # A = [3, 5, 2], B = [6, 4]


@pytest.mark.parametrize("L, S", [(512, 8), (4096, 64)])
def test_two_dimensional_passes_reach_the_bound_where_the_cap_binds(L, S):
    # short dialogue turns (mean ~40): plain best fit decreasing fills the last rows' slots
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.geometric(1 / 40, 20_000), L)
    p = plan(lengths, PackConfig(L, max_segments=S))
    bound = tight_lower_bound(lengths, L, S)
    assert p.num_rows <= bound + max(1, bound // 1000)
    rows, n = greedy.bfd_sorted(np.sort(lengths)[::-1], L, S)  # plain BFD: far from it
    assert n > p.num_rows


def _stream_rows(lengths, cfg, window=1024, **kwargs):
    """Rows a StreamPlanner (default but for `kwargs`) emits for `lengths`, fed one window at
    a time."""
    planner = StreamPlanner(cfg, window=window, **kwargs)
    rows = 0
    for a in range(0, lengths.size, window):
        rows += planner.add_plan(np.arange(a, min(a + window, lengths.size)),
                                 lengths[a : a + window]).num_rows
    return rows + planner.finish_plan().num_rows


def test_stream_planner_near_the_bound_where_the_cap_binds():
    rng = np.random.default_rng(1)
    lengths = np.minimum(rng.geometric(1 / 40, 30_000), 512)
    cfg = PackConfig(512, max_segments=8)
    rows = _stream_rows(lengths, cfg)
    bound = tight_lower_bound(lengths, 512, 8)
    assert rows <= bound * 1.003 + 1


def test_stream_planner_near_the_bound_where_rows_end_with_a_little_room():
    # gsm8k-like (55 to 450 tokens, slots never bind at L=2048): rows left with less room than
    # the smallest piece stay open, so the next window's pieces can pack them tighter
    rng = np.random.default_rng(2)
    lengths = np.round(rng.lognormal(5.0, 0.4, 8_000)).astype(np.int64).clip(55, 450)
    cfg = PackConfig(2048, max_segments=64)
    rows = _stream_rows(lengths, cfg)
    bound = tight_lower_bound(lengths, 2048, 64)
    assert rows <= bound * 1.003 + 1


def test_stream_planner_near_the_bound_where_the_slots_hardly_bind():
    # source-file-like lengths split at L (2,000 examples, 2,048-token pieces and the rest):
    # L < 0.15 S x the mean piece. Extending the open rows by best fit left rows a few tokens
    # short (+5 rows of 970); planning them again with each window reaches the bound
    rng = np.random.default_rng(2)
    lengths = np.maximum(rng.lognormal(6.0, 1.4, 2000).astype(np.int64), 1)
    cfg = PackConfig(2048, max_segments=16, overflow="split")
    bound = tight_lower_bound(apply_overflow(lengths, cfg)[2], 2048, 16)
    assert _stream_rows(lengths, cfg) <= bound * 1.003


def test_stream_planner_near_the_bound_where_most_rows_hold_a_long_piece(monkeypatch):
    # source-file-like lengths (median 590, a tenth over 4,000) split at L=8192, S=6: pieces
    # over L/2 are in 69% of the bound's rows and the slot bound is 70% of the token bound.
    # Without worst fit into the bound's rows the windows' plans fill rows with the short
    # pieces, full in slots with half their tokens free (+111 rows of 1701); with it +1
    rng = np.random.default_rng(1)
    lengths = np.maximum(np.exp(rng.normal(6.38, 1.6, 6000)).astype(np.int64), 1)
    cfg = PackConfig(8192, max_segments=6, overflow="split")
    sizes = np.sort(apply_overflow(lengths, cfg)[2])[::-1]
    bound = tight_lower_bound(sizes, 8192, 6)
    assert regime.big_pieces(sizes, 8192) >= regime.BIG_ROWS * bound
    assert regime.big_pieces(sizes, 8192) == int((sizes > 4096).sum())
    assert _stream_rows(lengths, cfg) <= bound + max(1, 3 * bound // 1000)
    monkeypatch.setattr(regime, "big_pieces", lambda sizes_desc, capacity: 0)
    assert _stream_rows(lengths, cfg) > bound + 50


@pytest.mark.parametrize("L, share, n", [(8192, 1.0, 40_000), (2048, 0.9, 40_000),
                                         (32768, 0.8, 60_000)])
def test_stream_planner_near_the_bound_where_slots_and_tokens_bind_alike(L, share, n):
    # dialogue-turn-like lengths (median 25, mean 41) with S about L / mean: each window's slots
    # bind, and worst fit balanced its pieces over ceil(n / S) rows, none of them full, so the
    # rows kept open overflowed and the stream emitted them short (+5 rows of 197 at 8192 / 202,
    # +7 of 870 at 2048 / 45, +11 of 92 at 32768 / 648). Dealing into the rows the window can
    # fill reaches the target. (Seed 0 was the case until rows full in tokens but short in
    # slots stayed open: its 8192 case is +2 with that, +1 without, either way noise against
    # +6.) window_rows=0: every call is a window (by default they would wait for 128 rows'
    # worth, most of these corpora, and the window's rules would hardly run)
    rng = np.random.default_rng(1)
    lengths = np.clip(np.rint(rng.lognormal(3.2, 1.0, n)), 1, L).astype(np.int64)
    S = round(share * L / lengths.mean())
    bound = tight_lower_bound(lengths, L, S)
    rows = _stream_rows(lengths, PackConfig(L, max_segments=S), window_rows=0)
    assert rows <= bound + max(1, 3 * bound // 1000)


@pytest.mark.parametrize("seed", [0, 1])
def test_stream_planner_repairs_windows_where_slots_and_tokens_bind_alike(seed):
    # lognormal lengths of mean 450 at L=2048 / S=4 (L / mean = 4.5): every window's plan leaves
    # rows short in tokens or in slots, and the emitted ones stay so (+17 rows of 5171, +16 of
    # 5170) unless the repair empties the emptiest into the others' room
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.rint(rng.lognormal(5.8, 0.8, 20_000)), 1, 2048).astype(np.int64)
    S = round(0.9 * 2048 / lengths.mean())
    bound = tight_lower_bound(lengths, 2048, S)
    rows = _stream_rows(lengths, PackConfig(2048, max_segments=S))
    assert rows <= bound + max(1, 3 * bound // 1000)


@pytest.mark.slow
def test_stream_planner_plans_windows_of_rows_worth_where_a_row_takes_much_of_a_call():
    # dialogue-turn-like lengths (mean 41) with S = L / mean: a row takes 800 pieces, most of
    # a call's 1024 examples. Planned call by call the windows cannot mix sizes within a row
    # (+4 rows of 75; at L=131072 / S=3242, +4 of 31). Windows of 32 rows' worth reach the
    # target (the default, 128, needs a corpus of more than 128 rows to plan before the end)
    L, n, k = 32768, 60_000, 32
    rng = np.random.default_rng(0)
    lengths = np.clip(np.rint(rng.lognormal(3.2, 1.0, n)), 1, L).astype(np.int64)
    S = round(L / lengths.mean())
    bound = tight_lower_bound(lengths, L, S)
    assert StreamPlanner(PackConfig(L, max_segments=S)).window_rows == 128
    planner = StreamPlanner(PackConfig(L, max_segments=S), window_rows=k)
    rows, waited = 0, 0
    for a in range(0, n, 1024):
        got = planner.add_plan(np.arange(a, min(a + 1024, n)), lengths[a : a + 1024])
        rows += got.num_rows
        state = planner.get_state()
        if state["pending"]:  # what waits is less than k rows' worth, in pieces and tokens
            waited += 1
            pending = np.asarray(state["rows"][-1]["pieces"])
            assert got.num_rows == 0
            assert len(pending) < k * S and pending[:, 2].sum() < k * L
    assert waited > 0 and rows > 0  # windows waited, and were planned before the end
    rows += planner.finish_plan().num_rows
    assert rows <= bound + max(1, 3 * bound // 1000)


def test_stream_planner_keeps_rows_short_in_slots_open_where_slots_bind():
    # lengths drifting with the position (mean piece from 170 to 600 and back, every 6,000
    # examples, as a corpus in its own order) at L=8192 / S=16: rows full in tokens with few
    # pieces spend the long examples the short ones of later windows need; emitting them
    # left +4 rows of 1251, keeping them open +1
    rng = np.random.default_rng(0)
    n = 20_000
    mu = 5.6 + 0.6 * np.sin(2 * np.pi * np.arange(n) / 6000)
    lengths = np.clip(np.rint(rng.lognormal(mu, 0.9)), 1, 8192).astype(np.int64)
    S = round(0.9 * 8192 / lengths.mean())
    bound = tight_lower_bound(lengths, 8192, S)
    assert _stream_rows(lengths, PackConfig(8192, max_segments=S)) <= bound + 3 * bound // 1000
    used = np.array([8192, 8192, 8000, 8192])
    count = np.array([3, 16, 12, 11])  # mean 10.5: the first is short in slots, the last not
    got = stream_mod._slot_poor_open(used, count, 8192, 16)
    assert got.tolist() == [8191, 8192, 8000, 8192]
    assert stream_mod._slot_poor_open(used, count, 8192, 64) is used  # slots do not bind
