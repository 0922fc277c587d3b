"""What the offline default's refine steps cost where they cannot gain: the floor no plan goes
below (`bounds.dff_lower_bound`) ends them, a sample plan another mode made already is not
sieved again, and the sample's ranks are the same in Python and in numpy."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.packer import tight_lower_bound
from seqpack.packer.bounds import dff_lower_bound
from seqpack.packer.strategies.bfd import fill as fill_mod
from seqpack.packer.strategies.bfd import schedule as bfd
from tests.helpers.packer import check_rows as _check


def _optimum(sizes: list[int], L: int) -> int:
    """The fewest rows of `L` tokens that hold these pieces (any number a row): exhaustive."""
    best = len(sizes)

    def place(i: int, rooms: list[int]) -> None:
        nonlocal best
        if len(rooms) >= best:
            return
        if i == len(sizes):
            best = len(rooms)
            return
        seen = set()
        for r, room in enumerate(rooms):
            if room >= sizes[i] and room not in seen:
                seen.add(room)
                rooms[r] -= sizes[i]
                place(i + 1, rooms)
                rooms[r] += sizes[i]
        place(i + 1, rooms + [L - sizes[i]])

    place(0, [])
    return best


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 30).flatmap(
    lambda L: st.tuples(st.just(L), st.lists(st.integers(1, L), min_size=1, max_size=9))))
def test_dff_bound_is_a_lower_bound(inst):
    L, sizes = inst
    asc = np.sort(np.asarray(sizes, np.int64))
    assert dff_lower_bound(asc, L) <= _optimum(sorted(sizes, reverse=True), L)


def test_dff_bound_worked_example_and_pieces_just_over_a_third():
    # eight 4s at L=11: three rows by tokens (the tight bound), two a row: four
    assert tight_lower_bound([4] * 8, 11, 64) == 3
    assert dff_lower_bound(np.full(8, 4), 11) == 4
    assert dff_lower_bound(np.zeros(0, np.int64), 11) == 0
    rng = np.random.default_rng(0)
    asc = np.sort(rng.integers(683, 700, 10_001))  # two a row at 2048, never three
    assert tight_lower_bound(asc, 2048, 64) < 6_000
    assert dff_lower_bound(asc, 2048) == 5_001


def test_refine_stops_at_the_floor_where_the_bound_is_loose(monkeypatch):
    # lengths just over L/3 (QA's cliff): the tight bound counts tokens (2/3 of the rows), so
    # every refine step used to run, each sample fill row by row, to no gain (10^5 lengths:
    # 38 s); the passes' plan is at the floor (two a row), so none runs now
    rng = np.random.default_rng(0)
    lengths = rng.integers(683, 700, 20_000)
    ran: list[str] = []
    for name in ("probes", "fix", "mix", "sample_fills", "whole_sieve"):
        monkeypatch.setattr(bfd._Steps, name, lambda self, *a, _n=name: ran.append(_n) or a)
    monkeypatch.setattr(bfd, "swap_search", lambda *a, **k: ran.append("swap") or a[1:3])
    rows, n = bfd.assign_best_fit_decreasing(lengths, 2048, 64)
    _check(lengths, rows, n, 2048, 64)
    assert n == 10_000 and ran == []


def test_refine_runs_as_before_above_the_floor(monkeypatch):
    # the floor only stops steps where the plan is at it: below it the steps run as they did
    # (the sample fills' own test: lognormal lengths at L=2048 / S=20 need them)
    rng = np.random.default_rng(0)
    lengths = np.round(rng.lognormal(5.0, 0.4, 20_000)).astype(np.int64).clip(55, 450)
    asc = np.sort(lengths)
    floor = max(tight_lower_bound(asc, 2048, 20), dff_lower_bound(asc, 2048))
    calls: list[int] = []
    run = bfd._Steps.sample_fills
    monkeypatch.setattr(bfd._Steps, "sample_fills",
                        lambda self, rows, n: calls.append(n) or run(self, rows, n))
    rows, n = bfd.assign_best_fit_decreasing(lengths, 2048, 20)
    assert calls and calls[0] > floor and n <= bfd.repair_target(floor)


def test_a_sample_plan_made_again_is_not_sieved_again(monkeypatch):
    # every mode makes the same rows (as on gsm8k at L=320 / S=64): the sieve and the repair
    # run on them once, not once a mode (the same steps would make the same rows again)
    rng = np.random.default_rng(1)
    lengths = np.round(rng.lognormal(5.0, 0.4, 3_000)).astype(np.int64).clip(55, 450)
    desc = np.sort(lengths)[::-1]
    regime = bfd.Regime.of(desc, 2048, 20)
    steps = bfd._Steps(desc, regime, regime.bound)
    same = fill_mod.sample_fill_sorted(desc, 2048, 20, regime.bound, mode="middle")
    assert same[1] > max(regime.bound, dff_lower_bound(desc[::-1], 2048))  # none ends it
    monkeypatch.setattr(bfd, "sample_fill_sorted", lambda *a, **k: (same[0].copy(), same[1]))
    sieved: list[int] = []
    monkeypatch.setattr(steps, "mix", lambda rows, n: sieved.append(n) or (rows, n))
    monkeypatch.setattr(steps, "fix", lambda rows, n: (rows, n))
    got, n = steps.sample_fills(np.zeros(desc.size, np.int64), same[1] + 1)
    assert sieved == [same[1]] and len(bfd._SAMPLE_MODES) > 1
    assert n == same[1] and np.array_equal(got, same[0])


@pytest.mark.parametrize("L, S, spread", [(512, 256, (165, 225)), (320, 64, (1, 320)),
                                          (2048, 8, (424, 834)), (64, 300, (1, 64)),
                                          (8192, 256, (1, 200))])
def test_sample_ranks_in_python_and_numpy_agree(monkeypatch, L, S, spread):
    # the sample's ranks are worked out in Python for few ranks and in numpy for many: the
    # same rows either way, every mode, with and without a limit
    rng = np.random.default_rng(L + S)
    desc = np.sort(rng.integers(spread[0], spread[1] + 1, 2_000))[::-1]
    bound = tight_lower_bound(desc, L, S)
    for (mode, seed), limit in itertools.product(bfd._SAMPLE_MODES, (None, bound + 3)):
        got = []
        for many in (10**9, 0):  # always Python, always numpy
            monkeypatch.setattr(fill_mod, "_NUMPY_RANKS", many)
            got.append(fill_mod.sample_fill_sorted(desc, L, S, bound, mode=mode, seed=seed,
                                                   limit=limit))
        assert got[0][1] == got[1][1] and np.array_equal(got[0][0], got[1][0])
