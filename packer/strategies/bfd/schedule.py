"""The offline default, best fit decreasing: the one place that says which step runs when.

`assign_best_fit_decreasing` sorts the pieces largest first, decides once which limit binds
(`regime.Regime`) and then runs, each step only while the best plan so far is above its mark:

1. the deal (a whole plan where a row can run out of slots): the pieces dealt into the tight
   bound's rows (`deal`); where every row fits, that plan has the bound's rows, nothing follows;
2. the passes (`passes`) while the plan is above `gate` (the bound + 0.05%): plain BFD and the
   exact fill where the plan is one-dimensional, worst fit where the slots bind, the two-pool
   pass in between; the best plan wins;
3. the refine steps (`refine`) while it is above `repair_target` (the bound + 0.1%): the probes
   (the repair, or near the bound the merge; the exact fill, repaired), the sieve, the repair
   with the merge, the sample fills, the whole sieve, the swap search. A stream's window gets
   the repair alone where slots and tokens bind alike. No step runs on a plan at the floor
   no plan goes below (`bounds.dff_lower_bound`): where pieces do not combine (lengths just
   over L/3 come two a row, and the bound counts three) the target is out of reach.

Why each step is there, where it runs and what it gained: docs/offline_default.md.

Worked example (capacity 10, max_segments 4)::

    sizes (input order):    3  7  5  5  2  8
    sorted (largest first): 8  7  5  5  3  2     bound 3; the 5 smallest (22 tokens) overflow
                                                 a row: one-dimensional, no deal
    the exact fill (first: few pieces of each size):
    rows:                   0  1  2  2  1  0     [8, 2], [7, 3], [5, 5]: the bound, so no
                                                 other pass and no refine step runs
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from seqpack.packer.bounds import dff_lower_bound
from seqpack.packer.strategies.bfd.deal import deal_sorted
from seqpack.packer.strategies.bfd.fill import fill_sorted, sample_fill_sorted
from seqpack.packer.strategies.bfd.greedy import bfd_sorted, worst_fit_sorted
from seqpack.packer.strategies.bfd.refine import (
    Planner,
    in_groups,
    merge_repair,
    repair,
    sieve,
    sieve_all,
    sieve_window,
    swap_search,
)
from seqpack.packer.strategies.bfd.regime import Regime, gate, repair_target
from seqpack.packer.strategies.bfd.two_pool import two_pool_sorted

_FALLBACK = 100  # plain BFD after the two-pool pass only above the bound + 1/100
_FILL_FIRST = 32  # one-dimensional: the exact fill before plain BFD up to these pieces a size
_SEEDS = 2  # shuffles the whole sieve tries (its rows vary by a few tenths of a percent)
_MERGE_FIRST = 0.03  # the merge probes where the plan is within this share over the bound
# the sample fill's (ranks, seed), in the order tried; a sample plan further above the bound
# than _SAMPLE_SPREAD times the plan so far (and 5%) is dropped (the fill stops once it must be)
_SAMPLE_SPREAD = 16
_SAMPLE_MODES = (("middle", 0), ("span", 0), ("random", 0), ("random", 1))

Pass = tuple[Callable[[], tuple[np.ndarray, int]], Callable[[int], bool]]


def assign_best_fit_decreasing(
    sizes: np.ndarray, capacity: int, max_segments: int, *, slack: int | None = None,
    repair_rows: bool = True, window: int = 0,
) -> tuple[np.ndarray, int]:
    """Best fit decreasing (the steps of the module docstring); returns (row per piece, rows).

    `slack`: rows over the tight bound at which the passes and the refine steps stop (default:
    `gate` and `repair_target`); 0 runs them all unless one reaches the bound. `repair_rows`:
    refine after the passes (off for the sieve's windows). `window`: the pieces are planned for
    a `StreamPlanner` that adds `window` examples at a time, emits the rows that come out full
    and plans the others again with the next window (0: not a stream): no deal, the passes'
    window forms, and the repair alone."""
    sizes = np.asarray(sizes, np.int64)
    n = sizes.size
    if n == 0:
        return np.zeros(0, np.int64), 0
    small = sizes.astype(np.int32) if capacity < 2**31 else sizes.copy()  # sizes <= capacity
    small *= -1
    order = np.argsort(small, kind="stable")  # largest first, ties in input order
    del small
    sizes_desc = sizes[order]
    regime = Regime.of(sizes_desc, capacity, max_segments)
    bound = regime.bound
    enough = gate(bound) if slack is None else bound + slack
    target = repair_target(bound) if slack is None else bound + slack
    whole = repair_rows and not window  # a whole plan: offline, or a stream's last window
    best: tuple[object, int] | None = None
    if whole and regime.two_dimensional:
        best = deal_sorted(sizes_desc, capacity, max_segments, bound)  # the bound's rows, or None
    for run, worth in passes(sizes_desc, regime, window=window, whole=whole):
        if best is not None and (best[1] <= enough or not worth(best[1])):
            break
        got, num = run()
        if best is None or num < best[1]:
            best = (got, num)
    assert best is not None
    rows_desc, num_rows = np.asarray(best[0]), best[1]
    if repair_rows and num_rows > target:
        if not window:
            rows_desc, num_rows = refine(sizes_desc, rows_desc, num_rows, regime, target)
        elif regime.slots_bind_half:
            rows_desc, num_rows = repair(sizes_desc, rows_desc, num_rows, capacity, max_segments,
                                         target=target)
    rows = np.empty(n, np.int64)
    rows[order] = rows_desc
    return rows, num_rows


def passes(sizes_desc: np.ndarray, regime: Regime, *, window: int = 0, whole: bool = False
           ) -> list[Pass]:
    """The passes in the order they run, each a (run, worth) pair, run lazily: `worth(rows)`
    of the best plan so far says whether the pass is still worth running (every pass after the
    first runs only while that plan is above `gate`). `window`: planned for a stream of windows
    of that many examples; `whole`: worst fit deals into the tight bound's rows, not ceil(n / S).
    """
    L, S, bound = regime.capacity, regime.max_segments, regime.bound
    two_pool = lambda: two_pool_sorted(sizes_desc, L, S, bound)  # noqa: E731
    plain = lambda: bfd_sorted(sizes_desc, L, S)  # noqa: E731
    always = lambda rows: True  # noqa: E731
    gross = lambda rows: rows > bound + bound // _FALLBACK  # noqa: E731
    if not regime.two_dimensional:
        if window:
            return [(plain, always)]
        # offline: the row-by-row exact fill where plain BFD leaves its rows' last tokens;
        # first where it costs less than plain BFD (few pieces a size, `_FILL_FIRST`)
        fill = lambda: fill_sorted(sizes_desc, L, S)  # noqa: E731
        runs = 1 + int(np.count_nonzero(sizes_desc[1:] != sizes_desc[:-1]))
        if regime.pieces <= _FILL_FIRST * runs:
            return [(fill, always), (plain, always)]
        return [(plain, always), (fill, always)]
    # where pieces over L/2 are in a quarter of the bound's rows: worst fit into them, last
    extra: list[Pass] = [(lambda: worst_fit_sorted(sizes_desc.tolist(), L, S, bound),
                          always)] if regime.big else []
    if regime.slots_bind_all:
        # A window's worst fit, where its slots bind more than its tokens, fills only the rows
        # its pieces can fill (the rest opens rows of its own): rows balanced alike over
        # ceil(n / S) are all short, and a stream emits none.
        if window and regime.slots_over_tokens:
            deal = max(1, regime.pieces // S)
        else:
            deal = bound if whole else regime.slot_bound
        wf = lambda: worst_fit_sorted(sizes_desc.tolist(), L, S, deal)  # noqa: E731
        if deal == bound:
            extra = []  # the same pass
        if window and 4 * regime.pieces_per_row > window:
            # rows take more than a quarter of a window: plain BFD first would leave the
            # shortest pieces to rows of their own, window after window, until they came due
            return [(wf, always), (plain, always), (two_pool, always), *extra]
        return [(plain, always), (wf, always), (two_pool, always), *extra]
    if regime.two_pool_first:
        # plain BFD only where the two-pool pass missed by more than 1%
        return [(two_pool, always), (plain, gross), *extra]
    return [(plain, always), (two_pool, always)]  # (no `extra`: it needs a share of 0.5)


def sieve_planners(capacity: int, max_segments: int) -> tuple[Planner, Planner]:
    """(plan, last) for the sieve: a window by every pass (no refine step), and the rows left
    open at the end the same, then repaired."""

    def plan(sizes: np.ndarray) -> tuple[np.ndarray, int]:
        return assign_best_fit_decreasing(sizes, capacity, max_segments, slack=0,
                                          repair_rows=False)

    def last(sizes: np.ndarray) -> tuple[np.ndarray, int]:
        got, n = plan(sizes)
        return repair(sizes, np.asarray(got, np.int64), n, capacity, max_segments, target=0)

    return plan, last


def refine(sizes_desc: np.ndarray, rows: np.ndarray, num_rows: int, regime: Regime,
           target: int) -> tuple[np.ndarray, int]:
    """The refine steps on a plan above `target` (`rows` of the pieces `sizes_desc`, i64[P]
    sorted largest first): the probes (where slots and tokens both bind), the repair with the
    merge and the sieve in the regime's order, then the sample fills, the whole sieve and the
    swap search, each while the plan is still above `target` and above the floor (`_Steps`)."""
    steps = _Steps(sizes_desc, regime, target)
    stop = steps.stop  # the target, or the floor where no plan gets to the target
    early = (rows, num_rows)  # the probes' plan (where they miss, the sieve starts from rows)
    if num_rows <= stop:
        return rows, num_rows
    if not regime.two_dimensional:
        order = [steps.fix, steps.mix]
    elif regime.slots_bind_all:
        order = [steps.fix]  # every row is full in slots: the loose rows alone free no slot
    else:
        order = [steps.mix, steps.fix]
        if num_rows > stop:  # the probes, kept where they reach the target
            early = steps.probes(rows, num_rows)
            if early[1] <= target:
                rows, num_rows = early
    for step in order:
        if num_rows > stop:
            rows, num_rows = step(rows, num_rows)
    if early[1] < num_rows:
        rows, num_rows = early
    if num_rows > stop:
        rows, num_rows = steps.sample_fills(rows, num_rows)
    if num_rows > stop:
        rows, num_rows = steps.whole_sieve(rows, num_rows)
    if num_rows > stop:  # small plans: swaps between a row's pieces and the others'
        rows, num_rows = swap_search(sizes_desc, rows, num_rows, regime.capacity,
                                     regime.max_segments, target=target)
    return rows, num_rows


class _Steps:
    """The refine steps on one plan's pieces, each (rows, num_rows) -> (rows, num_rows)."""

    def __init__(self, sizes_desc: np.ndarray, regime: Regime, target: int) -> None:
        self.sizes, self.regime, self.target = sizes_desc, regime, target
        # no plan has fewer rows than the floor: past the target, the steps stop at it
        self.stop = max(target, regime.bound, dff_lower_bound(sizes_desc[::-1], regime.capacity))
        self.L, self.S = regime.capacity, regime.max_segments
        self.window = sieve_window(regime.pieces_per_row)
        self.plan, self.last = sieve_planners(self.L, self.S)

    def probe(self, rows: np.ndarray, n: int) -> tuple[np.ndarray, int]:
        """The repair alone: cheap."""
        return in_groups(repair, self.sizes, rows, n, self.L, self.S, target=self.target)

    def merge(self, rows: np.ndarray, n: int) -> tuple[np.ndarray, int]:
        return in_groups(merge_repair, self.sizes, rows, n, self.L, self.S, target=self.target)

    def fix(self, rows: np.ndarray, n: int) -> tuple[np.ndarray, int]:
        return self.merge(*self.probe(rows, n))

    def mix(self, rows: np.ndarray, n: int) -> tuple[np.ndarray, int]:
        return sieve(self.sizes, rows, n, self.L, self.plan, last=self.last, window=self.window)

    def probes(self, rows: np.ndarray, n: int) -> tuple[np.ndarray, int]:
        """Near the bound (`_MERGE_FIRST`) the merge (it gathers the room, then repairs), and
        the repair alone where it removes no row; further off the repair, then the merge if
        that brings the plan near. Where the slots bind little, the exact fill, repaired."""
        bound, target = self.regime.bound, self.target
        near = bound + _MERGE_FIRST * bound
        if n <= near:
            early = self.merge(rows, n)
            if early[1] == n:  # it removed no row (or found nothing to swap, and so did not
                early = self.probe(rows, n)  # repair): the repair alone
        else:
            early = self.probe(rows, n)
            if target < early[1] <= near:
                early = self.merge(*early)
        if early[1] > target and not self.regime.slots_bind_half:
            filled = self.fix(*fill_sorted(self.sizes, self.L, self.S))
            early = min(early, filled, key=lambda got: got[1])
        return early

    def sample_fills(self, rows: np.ndarray, n: int) -> tuple[np.ndarray, int]:
        """Rows as samples of the pieces left (`fill.sample_fill_sorted`, each rank mode in
        turn), then sieved and repaired (a plan another mode made already is not: the same
        steps would make the same rows), until one reaches the target."""
        bound, target = self.regime.bound, self.target
        limit = bound + max(_SAMPLE_SPREAD * (n - bound), bound // 20)
        tried: list[np.ndarray] = []  # the sample plans sieved so far
        for mode, seed in _SAMPLE_MODES:
            got, m = sample_fill_sorted(self.sizes, self.L, self.S, bound, mode=mode, seed=seed,
                                        limit=limit)
            if m > limit:
                continue  # too far off to be worth the sieve (long pieces crowd the samples)
            if any(np.array_equal(got, plan) for plan in tried):
                continue  # another mode's plan (one short piece a row: gsm8k at L=320 / S=64)
            tried.append(got)
            for step in (self.mix, self.fix):
                if m > target:
                    got, m = step(got, m)
            if m < n:
                rows, n = got, m
            if n <= self.stop:
                break
        return rows, n

    def whole_sieve(self, rows: np.ndarray, n: int) -> tuple[np.ndarray, int]:
        """Every piece through the sieve (`_SEEDS` shuffles), repaired where still above."""
        every, m = min((sieve_all(self.sizes, self.L, self.plan, last=self.last,
                                  window=self.window, seed=seed) for seed in range(_SEEDS)),
                       key=lambda got: got[1])
        if m < n:
            return self.fix(every, m) if m > self.target else (every, m)
        return rows, n
