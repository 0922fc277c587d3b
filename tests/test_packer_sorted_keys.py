"""The two-pool pass's sorted keys: flat and in blocks, against a sorted list, and the pass's
rows the same with either."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from seqpack.packer import tight_lower_bound
from seqpack.packer.strategies.bfd import sorted_keys, two_pool
from tests.helpers.packer import check_rows, instances


@pytest.fixture
def tiny_blocks(monkeypatch):
    """Blocks of 2 to 4 keys, and blocks from the first row on: splits and empty blocks on
    every few keys (the same for every example: hypothesis may share the fixture)."""
    monkeypatch.setattr(sorted_keys, "_BLOCK", 2)
    monkeypatch.setattr(sorted_keys, "_SPLIT", 4)
    monkeypatch.setattr(sorted_keys, "_BLOCK_ROWS", 0)


# ops on a set of keys below 64: ("add", k), ("many", ks), ("run", first, m), ("remove", ks),
# ("pop", x), ("pop_ge", x), ("delete", x, m)
_ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 63)),
    st.tuples(st.just("many"), st.lists(st.integers(0, 63), max_size=8)),
    st.tuples(st.just("run"), st.integers(0, 63), st.integers(1, 8)),
    st.tuples(st.just("remove"), st.lists(st.integers(0, 63), max_size=8)),
    st.tuples(st.just("pop"), st.integers(0, 64)),
    st.tuples(st.just("pop_ge"), st.integers(0, 64)),
    st.tuples(st.just("delete"), st.integers(0, 64), st.integers(0, 9)),
), max_size=60)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(0, 63), unique=True), _ops)
def test_keys_flat_and_in_blocks_keep_a_sorted_list(tiny_blocks, start, ops):
    ref = sorted(start)
    pools = [sorted_keys.FlatKeys(ref), sorted_keys.BlockKeys(ref)]
    for op in ops:
        if op[0] == "add":
            if op[1] not in ref:
                ref.append(op[1])
                for pool in pools:
                    pool.add(op[1])
        elif op[0] == "many":
            new = sorted(set(op[1]) - set(ref))
            ref += new
            for pool in pools:
                pool.add_many(new[::-1])  # any order
        elif op[0] == "run":
            # keys first .. first + m - 1 with no present key between them: the gap after first
            first, m = op[1], op[2]
            run = []
            for k in range(first, first + m):
                if k in ref:
                    break
                run.append(k)
            if run:
                ref += run
                for pool in pools:
                    pool.add_run(run)
        elif op[0] == "remove":
            gone = sorted(set(op[1]) & set(ref))
            ref = [k for k in ref if k not in gone]
            for pool in pools:
                pool.remove_many(gone)
        elif op[0] == "pop":
            ref.sort()
            want = next((k for k in ref if k >= op[1]), None)
            for pool in pools:
                at = pool.find(op[1])
                assert (at is None) == (want is None)
                if at is not None:
                    assert next(iter(pool.iter_from(at))) == want
                    assert pool.pop_at(at) == want
            if want is not None:
                ref.remove(want)
        elif op[0] == "pop_ge":  # find and pop_at in one call
            ref.sort()
            want = next((k for k in ref if k >= op[1]), None)
            for pool in pools:
                assert pool.pop_ge(op[1]) == want
            if want is not None:
                ref.remove(want)
        elif op[0] == "delete":  # the first m keys >= x, as the pass does after iterating them
            ref.sort()
            after = [k for k in ref if k >= op[1]]
            m = min(op[2], len(after))
            for pool in pools:
                at = pool.find(op[1])
                if at is None:
                    assert not after
                    continue
                assert list(pool.iter_from(at)) == after
                pool.delete_from(at, m)
            ref = [k for k in ref if k not in after[:m]]
        ref.sort()
        for pool in pools:
            assert pool.tolist() == ref and len(pool) == len(ref)
    blocks = pools[1]
    assert all(1 <= len(b) <= sorted_keys._SPLIT for b in blocks.blocks)
    assert blocks.maxes == [b[-1] for b in blocks.blocks]


def test_keys_for_picks_blocks_for_plans_of_many_rows():
    assert sorted_keys.keys_for(sorted_keys._BLOCK_ROWS) is sorted_keys.BlockKeys
    assert sorted_keys.keys_for(sorted_keys._BLOCK_ROWS - 1) is sorted_keys.FlatKeys


@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(instances, st.integers(0, 5), st.booleans())
def test_two_pool_rows_the_same_with_keys_flat_or_in_blocks(tiny_blocks, inst, extra, mixed):
    """The pools in blocks of 2 to 4 keys place the rows the flat lists do, alone and with
    the numpy path for runs of 3 or more (`mixed`: the rows go from lists to arrays and back,
    keeping their class of pools)."""
    L, S, sizes = inst
    desc = np.sort(np.asarray(sizes, np.int64))[::-1]
    open_rows = tight_lower_bound(desc, L, S) + extra
    got = {}
    for pool in (sorted_keys.FlatKeys, sorted_keys.BlockKeys):
        with pytest.MonkeyPatch.context() as mp:
            if mixed:
                for name, value in (("_LONG_RUN", 3), ("_SHORT_RUN", 2), ("_SPREAD", 10**9)):
                    mp.setattr(two_pool, name, value)
            mp.setattr(two_pool, "keys_for", lambda rows, pool=pool: pool)
            got[pool] = two_pool.two_pool_sorted(desc, L, S, open_rows)
        check_rows(desc, *got[pool], L, S)
    flat, blocks = got[sorted_keys.FlatKeys], got[sorted_keys.BlockKeys]
    assert blocks[1] == flat[1]
    assert np.array_equal(blocks[0], flat[0])
