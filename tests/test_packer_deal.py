"""The deal into the tight bound's rows (`strategies.deal`), and where the offline default deals."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.packer import tight_lower_bound
from seqpack.packer.bounds import slots_can_bind
from seqpack.packer.strategies.bfd import deal, greedy
from seqpack.packer.strategies.bfd import schedule as bfd
from tests.helpers.packer import check_rows, instances


@settings(max_examples=200, deadline=None)
@given(instances, st.integers(0, 3), st.booleans(), st.booleans())
def test_deal_keeps_every_piece_in_the_rows_it_is_given(inst, extra, close, even):
    L, S, sizes = inst
    desc = np.sort(np.asarray(sizes, np.int64))[::-1]
    R = tight_lower_bound(desc, L, S) + extra
    saved = deal._CLOSE, deal._EVEN_ROWS
    # the balanced deal after every snake that misses; the even deal at any number of rows
    deal._CLOSE = 1.0 if close else saved[0]
    deal._EVEN_ROWS = 1 if even else saved[1]
    try:
        got = deal.deal_sorted(desc, L, S, R)
    finally:
        deal._CLOSE, deal._EVEN_ROWS = saved
    snake = deal.snake_rows(desc.size, R)
    if got is None:  # only where the snake misses (or there are fewer pieces than rows)
        assert desc.size < R or np.bincount(snake, weights=desc).max() > L
        return
    rows, n = got
    assert n == R
    check_rows(desc, rows, n, L, S)
    if not even and np.bincount(snake, weights=desc, minlength=R).max() <= L:
        assert np.array_equal(rows, snake)  # the snake first, below `_EVEN_ROWS` rows


def _even_reference(sizes_desc, R, S):
    # the even deal one piece at a time: blocks of R // 2, each to the rows of fewest tokens
    # (then lowest number) among those with a free slot
    load, count, rows, a = [0] * R, [0] * R, [], 0
    while a < len(sizes_desc):
        free = sorted((load[r], r) for r in range(R) if count[r] < S)
        block = free[: min(max(1, R // 2), len(sizes_desc) - a)]
        for (_, r), s in zip(block, sizes_desc[a : a + len(block)]):
            rows.append(r)
            load[r] += int(s)
            count[r] += 1
        a += len(block)
    return rows


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 30), st.integers(1, 8), st.data())
def test_even_deal_gives_each_block_to_the_emptiest_rows(R, S, data):
    n = data.draw(st.integers(1, R * S))
    sizes = np.sort(np.asarray(data.draw(st.lists(st.integers(1, 50), min_size=n,
                                                  max_size=n)), np.int64))[::-1]
    rows = deal.even_rows(sizes, R, S)
    assert rows.tolist() == _even_reference(sizes.tolist(), R, S)
    assert np.bincount(rows, minlength=R).max() <= S


def test_even_deal_refuses_more_pieces_than_slots():
    with pytest.raises(ValueError, match="7 pieces do not fit 3 rows of 2 slots"):
        deal.even_rows(np.ones(7, np.int64), 3, 2)


def test_even_deal_worked_example():
    # the example of strategies/bfd/deal.py: 4 rows, blocks of 2
    sizes = np.array([6, 5, 3, 3, 2, 2, 1, 1])
    rows = deal.even_rows(sizes, 4, 4)
    assert rows.tolist() == [0, 1, 2, 3, 2, 3, 1, 2]
    assert np.bincount(rows, weights=sizes).tolist() == [6, 6, 6, 5]
    assert np.bincount(deal.snake_rows(8, 4), weights=sizes).tolist() == [7, 6, 5, 5]


def test_even_deal_rows_cost_alike_where_a_few_pieces_are_long():
    # chat-like lengths at 32768 / 64: the snake's costliest rows are those holding the
    # longest pieces, one piece of every round on top; the even deal spreads them like worst
    # fit. Cost: l + l^2 / 24576 a piece (veRL's 7B model)
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5.0, 1.2, 25_600).astype(np.int64), 1, 32768)
    desc = np.sort(lengths)[::-1]
    L, S = 32768, 64
    R = tight_lower_bound(desc, L, S)
    assert R >= deal._EVEN_ROWS
    rows, n = deal.deal_sorted(desc, L, S, R)
    check_rows(desc, rows, n, L, S)
    cost = desc + desc.astype(float) ** 2 / 24576

    def p99(r):
        row_cost = np.bincount(r, weights=cost, minlength=R)
        return np.quantile(row_cost / row_cost.mean(), 0.99)

    wf = np.asarray(greedy.worst_fit_sorted(desc.tolist(), L, S, R)[0])
    assert p99(rows) <= p99(wf) + 0.01
    assert p99(deal.snake_rows(desc.size, R)) > p99(rows) + 0.05


@given(st.integers(1, 400), st.integers(1, 50))
def test_snake_gives_every_row_one_piece_a_round(n, R):
    rows = deal.snake_rows(n, R)
    for a in range(0, n, R):
        got = rows[a : a + R]
        assert np.unique(got).size == got.size  # no row twice in a round
        if a // R % 2 == 0:
            assert got.tolist() == list(range(got.size))
        else:
            assert got.tolist() == list(range(R - 1, R - 1 - got.size, -1))
    assert np.bincount(rows, minlength=R).max() == -(-n // R)


def test_deal_worked_example():
    # the example of strategies/bfd/deal.py: capacity 10, 4 slots, bound 3
    sizes = np.array([5, 4, 4, 3, 3, 3, 2, 2, 1])
    assert tight_lower_bound(sizes, 10, 4) == 3
    rows, n = deal.deal_sorted(sizes, 10, 4, 3)
    assert n == 3 and rows.tolist() == [0, 1, 2, 2, 1, 0, 0, 1, 2]
    assert np.bincount(rows, weights=sizes).tolist() == [10, 9, 8]


def test_balanced_deal_fits_where_the_snake_does_not(monkeypatch):
    # capacity 9, bound 2: the snake gives row 0 4 + 3 + 3 = 10; the balanced deal gives the
    # third round's 3 to row 1 (7 against row 0's 4 + 3) and its 2 to row 0: 9 and 9
    sizes = np.array([4, 3, 3, 3, 3, 2])
    assert np.bincount(deal.snake_rows(6, 2), weights=sizes).tolist() == [10, 8]
    assert deal.balanced_rows(sizes, 2, 4).tolist() == [0, 1, 1, 0, 1, 0]
    assert deal.deal_sorted(sizes, 9, 4, 2) is None  # the snake is 11% over: not tried
    monkeypatch.setattr(deal, "_CLOSE", 0.2)
    rows, n = deal.deal_sorted(sizes, 9, 4, 2)
    assert n == 2 and rows.tolist() == [0, 1, 1, 0, 1, 0]


def test_deal_needs_room_for_a_piece_a_round_in_every_row():
    sizes = np.full(9, 1)
    assert deal.deal_sorted(sizes, 10, 2, 4) is None  # 3 a row: over the 2 slots
    assert deal.deal_sorted(sizes, 10, 3, 3)[1] == 3
    assert deal.deal_sorted(sizes, 10, 3, 10) is None  # more rows than pieces


def _many_short(seed: int = 0) -> np.ndarray:
    # grade-school-math-like lengths (mean ~160): a row of 32768 takes about 200
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(5.0, 0.4, 7000).astype(np.int64), 20, 1000)


def test_offline_default_is_the_deal_where_it_fits(monkeypatch):
    lengths = _many_short()
    L, S = 32768, 256
    bound = tight_lower_bound(lengths, L, S)
    assert -(-lengths.size // S) < bound  # slots bind in part: the two-pool pass would run
    desc = np.sort(lengths)[::-1]
    assert np.bincount(deal.snake_rows(desc.size, bound), weights=desc).max() <= L

    def no_pass(*args, **kwargs):
        raise AssertionError("a pass ran")

    for name in ("two_pool_sorted", "bfd_sorted", "fill_sorted", "worst_fit_sorted"):
        monkeypatch.setattr(bfd, name, no_pass)
    rows, n = bfd.assign_best_fit_decreasing(lengths, L, S)
    check_rows(lengths, rows, n, L, S)
    assert n == bound


@pytest.mark.parametrize("kwargs", [{"repair_rows": False, "slack": 0}, {"window": 1024}])
def test_deal_is_not_for_a_windows_plan(monkeypatch, kwargs):
    # not for a sieve's windows (repair_rows=False) nor a stream's (window, but its last):
    # rows balanced alike would leave none full to keep or emit
    lengths = _many_short()

    def no_deal(*args, **kwargs):
        raise AssertionError("the deal ran")

    monkeypatch.setattr(bfd, "deal_sorted", no_deal)
    rows, n = bfd.assign_best_fit_decreasing(lengths, 32768, 256, **kwargs)
    check_rows(lengths, rows, n, 32768, 256)


def test_offline_default_runs_its_passes_where_the_deal_misses():
    # 3 slots a row, slots can bind; the snake gives row 0 70 + 20 + 20 = 110; best fit
    # [70, 30] [50, 50] [20, 20, 20]
    lengths = np.array([20, 50, 70, 30, 20, 50, 20])
    L, S = 100, 3
    assert slots_can_bind(np.sort(lengths), L, S)
    assert deal.deal_sorted(np.sort(lengths)[::-1], L, S, 3) is None
    rows, n = bfd.assign_best_fit_decreasing(lengths, L, S)
    check_rows(lengths, rows, n, L, S)
    assert n == tight_lower_bound(lengths, L, S) == 3


def test_a_stream_deals_its_last_window_only(monkeypatch):
    from seqpack.packer import PackConfig, StreamPlanner

    calls = []
    real = bfd.deal_sorted

    def recording(sizes_desc, *args):
        calls.append(int(sizes_desc.size))
        return real(sizes_desc, *args)

    monkeypatch.setattr(bfd, "deal_sorted", recording)
    lengths = _many_short()
    planner = StreamPlanner(PackConfig(32768, max_segments=256), window=1024)
    rows = 0
    for a in range(0, lengths.size, 1024):
        rows += planner.add_plan(np.arange(a, min(a + 1024, lengths.size)),
                                 lengths[a : a + 1024]).num_rows
    assert not calls  # the windows: rows are emitted when full, so none are dealt
    rows += planner.finish_plan().num_rows
    assert len(calls) == 1  # the last window (every row it makes is emitted)
    assert rows <= tight_lower_bound(lengths, 32768, 256) + 1
