"""The offline default's probes before the sieve (`strategies.refine.improve`): near the bound the
merge, further off the repair (and the merge where that brings the plan near the bound), then
where the slots bind little the exact fill; each kept only where it reaches the target, else the
sieve starts from the passes' plan."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.corpora import small_lognormal
from seqpack.packer import tight_lower_bound
from seqpack.packer.bounds import SLOTS_BIND_HALF, sizes_slot_share, slots_can_bind
from seqpack.packer.strategies.bfd import schedule as bfd
from tests.helpers.packer import check_rows as _check


def _seeded_lognormal(seed: int, L: int, mu: tuple[float, float]) -> np.ndarray:
    return small_lognormal(seed, L, mu)[2]  # the corpora of `--synthetic --small`


def _spy_steps(monkeypatch) -> list[tuple[str, int, int]]:
    """(step, rows in, rows out) of each call of the repair, the merge and the sieve."""
    calls: list[tuple[str, int, int]] = []

    def spy(name):
        run = getattr(bfd, name)

        def call(*a, **k):
            out = run(*a, **k)
            calls.append((name, a[2], out[1]))
            return out
        return call

    for name in ("repair", "sieve", "merge_repair"):
        monkeypatch.setattr(bfd, name, spy(name))
    return calls


def _planned_seeded(monkeypatch, seed: int, L: int, mu: tuple[float, float], S: int):
    """The offline default on `_seeded_lognormal(seed, L, mu)` at L / S, its steps spied:
    (sorted lengths, bound, target, steps, rows), the plan checked."""
    lengths = _seeded_lognormal(seed, L, mu)
    desc = np.sort(lengths)[::-1]
    bound = tight_lower_bound(desc, L, S)
    calls = _spy_steps(monkeypatch)
    rows, n = bfd.assign_best_fit_decreasing(lengths, L, S)
    _check(lengths, rows, n, L, S)
    return desc, bound, bfd.repair_target(bound), calls, n


def test_repair_alone_runs_before_the_sieve_and_ends_there_at_the_target(monkeypatch):
    # where the slots can bind (not for the whole corpus) and the passes are more than
    # _MERGE_FIRST over the bound, the cheap repair runs first; where it reaches the target the
    # sieve (about three plans of the loose rows) never runs
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(rng.uniform(3.5, 4.5), rng.uniform(0.5, 1.0),
                                    int(rng.integers(300, 1500))).astype(np.int64), 1, 512)
    desc = np.sort(lengths)[::-1]
    bound = tight_lower_bound(desc, 512, 8)
    target = bfd.repair_target(bound)
    calls = _spy_steps(monkeypatch)
    rows, n = bfd.assign_best_fit_decreasing(lengths, 512, 8)
    _check(lengths, rows, n, 512, 8)
    assert calls and calls[0][0] == "repair"
    assert calls[0][1] > bound + bfd._MERGE_FIRST * bound  # the passes missed, far off
    assert [c for c, _, _ in calls] == ["repair"] and n <= target


def test_merge_alone_near_the_bound_ends_there_at_the_target(monkeypatch):
    # the passes leave the plan within _MERGE_FIRST of the bound (395 rows, the bound 387, the
    # target 388): the merge is the probe (its own repair after gathering the room), no repair
    # alone before it, and it gets to the target; the sieve never runs
    _, bound, target, calls, n = _planned_seeded(monkeypatch, 4, 512, (3.5, 4.5), 8)
    assert [c for c, _, _ in calls] == ["merge_repair"]
    assert target < calls[0][1] <= bound + bfd._MERGE_FIRST * bound  # the passes missed
    assert n == calls[0][2] <= target


def test_repair_alone_where_the_merge_near_the_bound_removes_no_row(monkeypatch):
    # the same corpus, the merge made to find nothing (as where no row's room matches a size):
    # merge_repair then never repairs, so the repair alone runs after it, on the passes' plan
    monkeypatch.setattr(bfd, "merge_repair",
                        lambda sizes, rows, n, *a, **k: (rows, n))
    _, bound, target, calls, n = _planned_seeded(monkeypatch, 4, 512, (3.5, 4.5), 8)
    (first, passes, merged), (second, repair_in, _) = calls[:2]
    assert passes <= bound + bfd._MERGE_FIRST * bound  # near the bound: the merge first
    assert (first, second) == ("merge_repair", "repair") and merged == repair_in == passes
    assert n <= target


def test_merge_after_the_repair_near_the_bound_ends_there_at_the_target(monkeypatch):
    # the passes are further off (492 rows, the bound 476): the repair alone first (to 483, the
    # target is 477), which leaves the plan within _MERGE_FIRST of the bound; then the merge
    # gathers the room the repair could not use, and the sieve never runs
    _, bound, target, calls, n = _planned_seeded(monkeypatch, 15, 512, (3.5, 4.5), 8)
    near = bound + bfd._MERGE_FIRST * bound
    assert [c for c, _, _ in calls] == ["repair", "merge_repair"]
    assert calls[0][1] > near and target < calls[0][2] <= near  # the repair missed
    assert n <= target


def test_probes_that_miss_leave_the_sieve_the_passes_plan(monkeypatch):
    # 420 rows from the passes at 512 / 8 (the bound 405, the target 406): the repair (to 412)
    # and the merge (to 407) miss; the sieve starts from the passes' plan of 420 rows, not the
    # repaired one, and the repair with the merge after it gets to the target
    _, bound, target, calls, n = _planned_seeded(monkeypatch, 99, 512, (3.5, 4.5), 8)
    (first, passes, repaired), (second, _, merged) = calls[:2]
    assert (first, second) == ("repair", "merge_repair") and merged > target
    sieved = [rows_in for step, rows_in, _ in calls if step == "sieve"]
    assert sieved[0] == passes > repaired
    assert n <= target


@pytest.mark.parametrize("seed, gap", [(12, 0), (7, 1)])
def test_exact_fill_is_a_probe_where_the_slots_bind_little(monkeypatch, seed, gap):
    # chat-like lengths (2,031 of mean 676; 2,862 of mean 725) at 2048 / 8: slot share under
    # 0.5, about 3 pieces a row, few of each size. The two-pool pass is 5 and 9 rows over the
    # bound, the merge leaves +2 in both (the target is +1; the sieve and the sample fills after
    # it did no better). The exact fill (rows ended with a piece or a pair of exactly the room
    # left), repaired, gets to +0 and +1, the sieve never runs; in the second corpus the fill
    # alone is further off (+15) than the two-pool pass
    desc, bound, target, calls, n = _planned_seeded(monkeypatch, seed, 2048, (5.0, 6.5), 8)
    assert sizes_slot_share(desc, 2048, 8) < SLOTS_BIND_HALF
    assert slots_can_bind(desc[::-1], 2048, 8)  # not the one-dimensional plan
    two_pool = bfd.two_pool_sorted(desc, 2048, 8, bound)[1]
    filled = bfd.fill_sorted(desc, 2048, 8)[1]
    assert two_pool > target and (filled > two_pool) == (seed == 7)
    assert n == bound + gap <= target
    # the passes are near the bound: the merge is the first probe, and misses
    assert calls[0][0] == "merge_repair" and calls[0][2] > target
    assert "sieve" not in [c for c, _, _ in calls]
