"""benchmarks/lp_bound.py: the configuration LP bound (column generation) is a lower bound."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.lp_bound import lp_bound
from seqpack.packer import lower_bound, tight_lower_bound
from seqpack.packer.strategies.bfd import schedule as bfd

small = st.integers(4, 12).flatmap(lambda L: st.tuples(
    st.just(L), st.integers(1, 4), st.lists(st.integers(1, L), min_size=1, max_size=8)))


def optimum(sizes: list[int], L: int, S: int) -> int:
    """The fewest rows, by exhaustive search (largest first; rows of equal fill tried once)."""
    sizes = sorted(sizes, reverse=True)
    best = [len(sizes)]

    def go(i: int, rows: list[list[int]]) -> None:
        if len(rows) >= best[0]:
            return
        if i == len(sizes):
            best[0] = len(rows)
            return
        tried = set()
        for r in rows:
            if (r[0], r[1]) in tried or r[0] + sizes[i] > L or r[1] == S:
                continue
            tried.add((r[0], r[1]))
            r[0] += sizes[i]
            r[1] += 1
            go(i + 1, rows)
            r[0] -= sizes[i]
            r[1] -= 1
        rows.append([sizes[i], 1])
        go(i + 1, rows)
        rows.pop()

    go(0, [])
    return best[0]


@settings(max_examples=80, deadline=None)
@given(small)
def test_lp_bound_lies_between_the_simple_bound_and_the_optimum(inst):
    L, S, sizes = inst
    got = lp_bound(sizes, L, S, seconds=10)
    assert got.converged
    assert lower_bound(sum(sizes), len(sizes), L, S) <= got.bound <= optimum(sizes, L, S)
    assert got.bound == int(np.ceil(got.master - 1e-6))  # converged: the bound meets the master


def test_lp_bound_worked_example_beats_the_tight_bound():
    sizes = [8, 4, 4, 4, 4, 2]  # the module docstring's: L 9, S 3
    assert tight_lower_bound(sizes, 9, 3) == 3
    got = lp_bound(sizes, 9, 3)
    assert got.converged and got.bound == 4 and abs(got.master - 3.25) < 1e-9
    assert optimum(sizes, 9, 3) == 4


def test_lp_bound_seeded_with_a_plan_on_a_lognormal_corpus_at_three_slots():
    # long pieces, three slots a row: the tight bound misses that mid-size pieces pair but do
    # not come in threes; the plan's rows seed the master
    lengths = np.round(np.random.default_rng(0).lognormal(6.3, 1.0, 600)).astype(np.int64)
    lengths = lengths.clip(1, 2048)
    rows, n = bfd.assign_best_fit_decreasing(lengths, 2048, 3)
    tight = tight_lower_bound(lengths, 2048, 3)
    got = lp_bound(lengths, 2048, 3, rows=rows, seconds=30)
    assert got.converged
    assert tight < got.bound <= n
