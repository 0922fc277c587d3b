"""The row-by-row exact fills: one-dimensional (`fill_sorted`) and sample (`sample_fill_sorted`)."""

from __future__ import annotations

import hashlib
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.packer import tight_lower_bound
from seqpack.packer.bounds import slots_can_bind
from seqpack.packer.strategies.bfd import fill as fill_mod
from seqpack.packer.strategies.bfd import greedy
from seqpack.packer.strategies.bfd import schedule as bfd
from tests.helpers.packer import check_rows as _check
from tests.helpers.packer import instances


@settings(max_examples=150, deadline=None)
@given(instances)
def test_fill_keeps_every_piece_within_both_limits(inst):
    L, S, sizes = inst
    desc = np.sort(np.asarray(sizes, np.int64))[::-1]
    rows, n = fill_mod.fill_sorted(desc, L, S)
    _check(desc, rows, n, L, S)
    assert n >= tight_lower_bound(desc, L, S)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 300), st.integers(1, 12), st.data())
def test_fill_at_rows_far_longer_than_its_pieces(top, per_row, data):
    # the fill's tables go up to twice the largest piece, not to the row length: rows of
    # 1 to 12 times the largest piece (the rooms a row's last pieces see pass it): every piece
    # placed, both limits kept
    sizes = data.draw(st.lists(st.integers(1, top), min_size=1, max_size=300))
    L = top * per_row + data.draw(st.integers(0, top))
    S = data.draw(st.integers(1, 400))
    desc = np.sort(np.asarray(sizes, np.int64))[::-1]
    rows, n = fill_mod.fill_sorted(desc, L, S)
    _check(desc, rows, n, L, S)
    assert n >= tight_lower_bound(desc, L, S)


def test_fill_worked_example():
    rows, n = fill_mod.fill_sorted(np.array([8, 6, 5, 4, 3, 2, 2]), 10, 4)
    assert n == 3 and rows.tolist() == [0, 1, 2, 1, 2, 0, 2]  # [8, 2] [6, 4] [5, 3, 2]


def test_fill_ends_rows_exactly_where_bfd_leaves_their_last_tokens():
    # gsm8k-like lengths (55 to 450 tokens) at L=2048 / S=64, one-dimensional: plain BFD
    # leaves about 12 tokens a row whatever the corpus size (+0.6% of rows here); the fill
    # ends rows with a piece or a pair of exactly their room (+1 of 4707; +12 without it)
    rng = np.random.default_rng(0)
    lengths = np.round(rng.lognormal(5.0, 0.4, 60_000)).astype(np.int64).clip(55, 450)
    desc = np.sort(lengths)[::-1]
    assert not slots_can_bind(desc[::-1], 2048, 64)
    bound = tight_lower_bound(desc, 2048, 64)
    plain = greedy.bfd_sorted(desc, 2048, 64)[1]
    assert plain > bound * 1.004
    rows, n = bfd.assign_best_fit_decreasing(lengths, 2048, 64)
    _check(lengths, rows, n, 2048, 64)
    assert n <= bfd.repair_target(bound)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=200), st.integers(2, 600))
def test_fill_pair_search_is_the_largest_pair_left(sizes, room):
    # the pair that ends a row: the largest a <= room / 2 with a and room - a both left (two of
    # it where they are equal), by a few sizes one at a time and then the rest at once; rooms
    # with many sizes below half and no pair near it reach the second part
    count = np.bincount(np.asarray(sizes), minlength=room + 1)
    cnt = count.tolist()
    avail = np.flatnonzero(count).tolist()
    pairs = [a for a in range(1, room // 2 + 1)
             if cnt[a] and cnt[room - a] and (a != room - a or cnt[a] >= 2)]
    assert fill_mod._pair(avail, cnt, count > 0, room) == (pairs[-1] if pairs else 0)


def test_fill_pair_search_past_the_sizes_tried_one_by_one():
    # every size from 1 to 80 left, and one of 150: room 190 pairs only 40 + 150, 40 sizes
    # after the 80 the search starts at (more than _PAIR_TRIES)
    sizes = list(range(1, 81)) + [150]
    count = np.bincount(sizes, minlength=191)
    assert 80 - 40 > fill_mod._PAIR_TRIES
    assert fill_mod._pair(np.flatnonzero(count).tolist(), count.tolist(), count > 0, 190) == 40
    count[40] = 0
    assert fill_mod._pair(np.flatnonzero(count).tolist(), count.tolist(), count > 0, 190) == 0


@settings(max_examples=150, deadline=None)
@given(instances, st.integers(0, 3), st.sampled_from(["random", "middle", "span"]))
def test_sample_fill_keeps_every_piece_within_both_limits(inst, extra, mode):
    L, S, sizes = inst
    desc = np.sort(np.asarray(sizes, np.int64))[::-1]
    bound = tight_lower_bound(desc, L, S)
    rows, n = fill_mod.sample_fill_sorted(desc, L, S, bound + extra, mode=mode)
    _check(desc, rows, n, L, S)
    assert n >= bound
    again = fill_mod.sample_fill_sorted(desc, L, S, bound + extra, mode=mode)
    assert again[1] == n and np.array_equal(again[0], rows)
    # a limit it stays within changes nothing; below its rows it gives up (over the limit)
    same = fill_mod.sample_fill_sorted(desc, L, S, bound + extra, mode=mode, limit=n)
    assert same[1] == n and np.array_equal(same[0], rows)
    assert fill_mod.sample_fill_sorted(desc, L, S, bound + extra, mode=mode, limit=n - 1)[1] >= n


@pytest.mark.parametrize("L, S, spread, want", [
    (512, 256, (165, 225), "2c625c7d5c6a1770"), (320, 64, (1, 320), "dd5e2b6d00f73945"),
    (2048, 8, (424, 834), "7211ba3d1e04ae01"), (64, 300, (1, 64), "34ece1f6858a0d97"),
    (2048, 64, (1, 2048), "625c39a8ce2aabbc"), (8192, 256, (1, 200), "353cc8ae7054b765")])
def test_sample_fill_plans_are_pinned(L, S, spread, want):
    # the sample fill's rows, every mode of the schedule, with and without a limit, pinned
    # (benchmarks/plan_digests.json pins whole plans only at L >= 2048): a faster fill must
    # make the same rows
    rng = np.random.default_rng(L + S)
    desc = np.sort(rng.integers(spread[0], spread[1] + 1, 2_000))[::-1]
    bound = tight_lower_bound(desc, L, S)
    h = hashlib.sha256()
    for (mode, seed), limit in itertools.product(bfd._SAMPLE_MODES, (None, bound + 3)):
        rows, n = fill_mod.sample_fill_sorted(desc, L, S, bound, mode=mode, seed=seed,
                                              limit=limit)
        h.update(rows.astype(np.int64).tobytes())
        h.update(str(n).encode())
    assert h.hexdigest()[:16] == want


@pytest.mark.parametrize("mode", ["middle", "span", "random"])
def test_sample_ranks_in_python_are_numpy_s(mode):
    # few ranks are worked out in Python, many in numpy: the same float64 steps, the same
    # ranks and the same draws from the generator
    for pool in (1, 2, 3, 7, 64, 1000, 12_345):
        for k in range(1, min(pool, 40)):
            a, b = np.random.default_rng(pool + k), np.random.default_rng(pool + k)
            got = fill_mod._ranks(k, pool, mode, a)
            assert got == fill_mod._ranks_array(k, pool, mode, b).tolist(), (pool, k)
            assert a.random() == b.random()
            assert got == sorted(set(got)) and 0 <= got[0] and got[-1] < pool


def test_sample_fill_worked_example():
    desc = np.array([6, 5, 4, 3, 3, 3, 2, 2, 1, 1])
    rows, n = fill_mod.sample_fill_sorted(desc, 10, 4, 3, mode="middle")
    assert n == 3
    assert [sorted(desc[rows == r].tolist()) for r in range(3)] == [[1, 1, 2, 6], [3, 3, 4],
                                                                    [2, 3, 5]]
    assert greedy.bfd_sorted(desc, 10, 4)[1] == 4


def test_sample_fill_reaches_the_target_where_slots_and_tokens_bind_alike(monkeypatch):
    # gsm8k-like lengths at L=2048 / S=20 (slots and tokens bind alike): the passes, the sieve
    # and the repair (with its room merge) +2 rows over the bound of 1571; rows as samples of
    # the pieces left, ended exactly, then the repair: +1, the target
    rng = np.random.default_rng(0)
    lengths = np.round(rng.lognormal(5.0, 0.4, 20_000)).astype(np.int64).clip(55, 450)
    bound = tight_lower_bound(lengths, 2048, 20)
    rows, n = bfd.assign_best_fit_decreasing(lengths, 2048, 20)
    _check(lengths, rows, n, 2048, 20)
    assert n <= bfd.repair_target(bound)
    monkeypatch.setattr(bfd, "_SAMPLE_MODES", ())  # without it
    assert bfd.assign_best_fit_decreasing(lengths, 2048, 20)[1] > bfd.repair_target(bound)
