"""The room merge (`strategies.refine.merge`): swaps between rows that gather the room of a plan."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.packer import tight_lower_bound
from seqpack.packer.strategies.bfd import schedule as bfd
from seqpack.packer.strategies.bfd.refine import merge as merge_mod
from tests.helpers.packer import bfd_plan, instances
from tests.helpers.packer import check_rows as _check

# the module (the refine package exports its function under the same name)
repair_mod = importlib.import_module("seqpack.packer.strategies.bfd.refine.repair")


@settings(max_examples=150, deadline=None)
@given(instances)
def test_merge_rooms_keeps_rows_and_slot_counts_and_fills_one_row_a_swap(inst):
    L, S, desc, rows, n = bfd_plan(inst)
    merged, swaps = merge_mod.merge_rooms(desc, rows, n, L)
    _check(desc, merged, n, L, S)
    assert np.array_equal(np.bincount(merged, minlength=n), np.bincount(rows, minlength=n))
    room = L - np.bincount(rows, weights=desc, minlength=n)
    after = L - np.bincount(merged, weights=desc, minlength=n)
    assert after.sum() == room.sum()  # the room moves, none is lost
    assert (after > 0).sum() == (room > 0).sum() - swaps  # each swap fills a row exactly
    again = merge_mod.merge_rooms(desc, rows, n, L)  # deterministic
    assert again[1] == swaps and np.array_equal(again[0], merged)


@settings(max_examples=100, deadline=None)
@given(instances)
def test_merge_repair_keeps_every_piece_and_never_adds_rows(inst):
    L, S, desc, rows, n = bfd_plan(inst)
    fixed, m = merge_mod.merge_repair(desc, rows, n, L, S, target=0)
    _check(desc, fixed, m, L, S)
    assert tight_lower_bound(desc, L, S) <= m <= n


def _merge_rooms_direct(sizes, rows, num_rows, capacity):
    """merge_rooms as first written (the module docstring, step by step): every row with room
    looked at in every pass, the index of pieces by size as dicts, a full row's pieces deleted
    from it one by one. The pass's skips and lazy dicts must give the same swaps."""
    rows = np.asarray(rows, np.int64).copy()
    room = capacity - np.bincount(rows, weights=sizes, minlength=num_rows).astype(np.int64)
    roomy = np.flatnonzero(room[rows] > 0)
    members, by_size = {}, {}
    for p in roomy[np.argsort(rows[roomy], kind="stable")].tolist():
        members.setdefault(int(rows[p]), []).append(p)
        by_size.setdefault(int(sizes[p]), {})[p] = None
    swaps = 0
    for _ in range(merge_mod._MERGE_PASSES):
        before = swaps
        for A in sorted(members, key=lambda r: (int(room[r]), r)):
            if A not in members:
                continue
            r = int(room[A])
            for a in members[A]:
                best, b, seen = -1, -1, 0
                for q in by_size.get(int(sizes[a]) + r, {}):
                    if rows[q] != A:
                        if room[rows[q]] > best:
                            best, b = int(room[rows[q]]), q
                        seen += 1
                        if seen == merge_mod._MERGE_CANDIDATES:
                            break
                if b < 0:
                    continue
                B = int(rows[b])
                rows[a], rows[b] = B, A
                room[A], room[B] = 0, room[B] + r
                members[B][members[B].index(b)] = a
                for q in members.pop(A):
                    if q != a:
                        del by_size[int(sizes[q])][q]
                del by_size[int(sizes[b])][b]
                swaps += 1
                break
        if swaps == before:
            break
    return rows, swaps


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_merge_rooms_swaps_as_the_direct_version(seed):
    # plans with room in many rows (a random first fit, each fitting row skipped at random), so
    # that many swaps chain: rows whose room grows are looked at again, the others not
    rng = np.random.default_rng(seed)
    L = int(rng.choice([16, 64, 256, 2048]))
    n = int(rng.integers(2, 400))
    sizes = np.minimum(L, np.maximum(1, rng.lognormal(rng.uniform(0.5, np.log(L)), 0.8, n)))
    sizes = np.sort(sizes.astype(np.int64))[::-1]
    rows, rooms = np.empty(n, np.int64), []
    for p in rng.permutation(n):
        r = next((r for r, rm in enumerate(rooms) if rm >= sizes[p] and rng.random() < 0.7),
                 len(rooms))
        if r == len(rooms):
            rooms.append(L)
        rooms[r] -= sizes[p]
        rows[p] = r
    got, swaps = merge_mod.merge_rooms(sizes, rows, len(rooms), L)
    want, want_swaps = _merge_rooms_direct(sizes, rows, len(rooms), L)
    assert swaps == want_swaps and np.array_equal(got, want)


def test_merge_rooms_worked_example():
    # capacity 10: A = [5, 4] has room 1, B = [6, 2] room 2; A's 5 for B's 6 = 5 + 1
    sizes = np.array([6, 5, 4, 2])
    rows = np.array([1, 0, 0, 1])
    merged, swaps = merge_mod.merge_rooms(sizes, rows, 2, 10)
    assert swaps == 1
    assert merged.tolist() == [0, 1, 0, 1]  # A = [6, 4] full, B = [5, 2] with room 3


@settings(max_examples=150, deadline=None)
@given(instances)
def test_share_slots_keeps_rows_within_limits_and_moves_room_not_tokens(inst):
    L, S, desc, rows, n = bfd_plan(inst)
    shared, swaps = merge_mod.share_slots(desc, rows, n, L, S)
    _check(desc, shared, n, L, S)
    assert (shared != rows).sum() == 3 * swaps  # three pieces a swap, each moved once
    before, after = np.bincount(rows, minlength=n), np.bincount(shared, minlength=n)
    assert (after != before).sum() == 2 * swaps and np.abs(after - before).max(initial=0) <= 1
    again = merge_mod.share_slots(desc, rows, n, L, S)
    assert again[1] == swaps and np.array_equal(again[0], shared)


def test_share_slots_worked_example():
    # capacity 10, 3 slots: A = [6, 4] (a free slot, no room), B = [3, 2, 2] (full in slots,
    # room 3): A's 4 for B's 2 + 2; B then has a free slot beside its room
    sizes = np.array([6, 4, 3, 2, 2])
    rows = np.array([0, 0, 1, 1, 1])
    shared, swaps = merge_mod.share_slots(sizes, rows, 2, 10, 3)
    assert swaps == 1
    assert shared.tolist() == [0, 1, 1, 0, 0]  # A = [6, 2, 2], B = [4, 3] with room 3


def _no_share(sizes, rows, num_rows, L, S):
    return np.asarray(rows, np.int64), 0


@pytest.mark.parametrize("mu, sigma, n, seed, S, patch", [
    # lognormal lengths of mean ~360 at L=2048 / S=8: the plan's room lies in many rows, each
    # too little for any piece; gathered, the repair empties one more row
    (5.6, 0.75, 12_000, 0, 8, ("_MERGE_ROUNDS", 0)),
    # mean ~430 at S=5: the room lies in rows full in slots, the free slots in rows full in
    # tokens; brought together, the repair reaches the target
    (5.82, 0.71, 8_000, 1, 5, ("share_slots", _no_share)),
])
def test_merge_reaches_the_target_where_the_repair_alone_does_not(mu, sigma, n, seed, S, patch,
                                                                  monkeypatch):
    lengths = np.round(np.random.default_rng(seed).lognormal(mu, sigma, n)).astype(np.int64)
    lengths = lengths.clip(1, 2048)
    target = bfd.repair_target(tight_lower_bound(lengths, 2048, S))
    rows, got = bfd.assign_best_fit_decreasing(lengths, 2048, S)
    _check(lengths, rows, got, 2048, S)
    assert got <= target
    monkeypatch.setattr(merge_mod, *patch)  # without the merge, or without the shared slots
    # (and without the swap search after everything, which reaches the target on its own in
    # the second case: the merge gets there before it)
    monkeypatch.setattr(bfd, "swap_search", lambda sizes, rows, n, *a, **k: (rows, n))
    assert bfd.assign_best_fit_decreasing(lengths, 2048, S)[1] > target


@settings(max_examples=150, deadline=None)
@given(instances, st.integers(1, 4), st.integers(0, 3))
def test_repair_in_groups_keeps_every_piece_and_never_adds_rows(inst, group_rows, slack):
    """Repair and merge over groups of 1 to 4 rows: a plan within both limits, no more rows
    than before, every group handed rows 0 .. n - 1 of its own and its pieces largest first."""
    L, S, desc, rows, n = bfd_plan(inst)
    target = tight_lower_bound(desc, L, S) + slack
    for step in (repair_mod.repair, merge_mod.merge_repair):
        calls = []

        def spy(sizes, r, m, *args, step=step, calls=calls, **kw):
            calls.append((sizes, r, m))
            return step(sizes, r, m, *args, **kw)

        got, m = bfd.in_groups(spy, desc, rows, n, L, S, target=target,
                                      group_rows=group_rows)
        _check(desc, got, m, L, S)
        assert tight_lower_bound(desc, L, S) <= m <= n
        if n <= group_rows or n <= target:
            assert len(calls) == 1 and calls[0][2] == n
            continue
        k = -(-n // group_rows)
        assert [c[2] for c in calls] == [len(range(g, n, k)) for g in range(k)]
        assert sum(c[0].size for c in calls) == desc.size
        for sizes, r, m_g in calls:
            assert sorted(set(r.tolist())) == list(range(m_g))  # the group's own rows
            assert (np.diff(sizes) <= 0).all()


def test_repair_in_groups_takes_strided_rows_and_shares_out_the_rows_to_go():
    """Rows r with r % k == g make group g; each group is asked for its share of the rows
    still to go (what groups before it did not remove moves on to the next)."""
    L, S = 10, 4
    # 6 rows: 0, 2, 4 hold one 5 each, 1, 3, 5 one 6 each: three rows of [5, 5] would do
    desc = np.array([6, 6, 6, 5, 5, 5], np.int64)
    rows = np.array([1, 3, 5, 0, 2, 4], np.int64)
    seen = []

    def spy(sizes, r, m, capacity, max_segments, *, target):
        seen.append((sizes.tolist(), r.tolist(), m, target))
        return repair_mod.repair(sizes, r, m, capacity, max_segments, target=target)

    got, m = bfd.in_groups(spy, desc, rows, 6, L, S, target=4, group_rows=3)
    # k = 2: group 0 = rows 0, 2, 4 (the 5s), group 1 = rows 1, 3, 5 (the 6s, no two fit)
    assert seen[0] == ([5, 5, 5], [0, 1, 2], 3, 2)  # 2 rows to go: 1 from each group
    assert seen[1] == ([6, 6, 6], [0, 1, 2], 3, 2)  # group 0 removed 1: 1 left, asked of it
    assert m == 5  # the 5s in two rows, the 6s stay in three
    _check(desc, got, m, L, S)
