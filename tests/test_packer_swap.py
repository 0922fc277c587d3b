"""The swap search, the offline default's last step on small plans above the target."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from benchmarks.corpora import small_lognormal
from seqpack.packer import tight_lower_bound
from seqpack.packer.strategies.bfd import schedule as bfd
from seqpack.packer.strategies.bfd.refine import swap
from tests.helpers.packer import bfd_plan, instances
from tests.helpers.packer import check_rows as _check


@settings(max_examples=150, deadline=None)
@given(instances)
def test_swap_search_keeps_every_piece_and_never_adds_rows(inst):
    L, S, desc, rows, n = bfd_plan(inst)
    bound = tight_lower_bound(desc, L, S)
    with pytest.MonkeyPatch.context() as mp:  # on every plan, however full in slots
        mp.setattr(swap, "_SLOT_SHARE", float("inf"))
        mp.setattr(swap, "_PER_ROW", 10**9)
        got, m = swap.swap_search(desc, rows, n, L, S, target=bound)
        _check(desc, got, m, L, S)
        assert bound <= m <= n
        again = swap.swap_search(desc, rows, n, L, S, target=bound)  # deterministic (seeded)
        assert again[1] == m and np.array_equal(again[0], got)


def test_swap_search_gathers_room_between_rows_first():
    # capacity 10: A = [5, 4] and B = [6, 3] have room 1 each, the victim V = [2] fits in
    # neither; swapping B's 6 for A's 5 gives B room 2, and the 2 goes in: two rows
    desc = np.array([6, 5, 4, 3, 2], np.int64)
    rows = np.array([1, 0, 0, 1, 2], np.int64)
    got, m = swap.swap_search(desc, rows, 3, 10, 8, target=2)
    assert m == 2
    _check(desc, got, m, 10, 8)
    assert sorted(sorted(desc[got == r].tolist()) for r in range(2)) == [[2, 3, 5], [4, 6]]


def test_swap_search_is_the_last_step_and_reaches_the_target(monkeypatch):
    # 1,477 lognormal lengths (mean about 690) at 2048 / 8: 500.3 rows' worth of tokens, the
    # bound 501, the target 502. Everything before the swap search ends at 504 rows; it
    # gets to the target
    lengths = small_lognormal(141, 2048, (5.0, 6.5))[2]
    bound = tight_lower_bound(np.sort(lengths)[::-1], 2048, 8)
    calls = []
    run = bfd.swap_search

    def spy(*a, **k):
        out = run(*a, **k)
        calls.append((a[2], out[1]))
        return out

    monkeypatch.setattr(bfd, "swap_search", spy)
    rows, n = bfd.assign_best_fit_decreasing(lengths, 2048, 8)
    _check(lengths, rows, n, 2048, 8)
    assert (bound, bfd.repair_target(bound)) == (501, 502)
    assert calls == [(504, n)] and n <= 502


def test_swap_search_leaves_big_plans_alone():
    rng = np.random.default_rng(0)
    desc = np.sort(rng.integers(1, 100, 3 * (swap._MAX_ROWS + 1)))[::-1]
    rows = np.arange(desc.size) // 3  # 3 pieces a row, more rows than the search takes
    got, m = swap.swap_search(desc, rows, int(rows[-1]) + 1, 1000, 8, target=0)
    assert m == rows[-1] + 1 and got is rows
