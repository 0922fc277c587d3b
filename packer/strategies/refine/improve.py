"""Improving a plan above its target: the offline default's steps after its passes.

The passes of `best_fit_decreasing` (plain BFD, worst fit, the two-pool pass, the exact fill) leave
a plan; while it is above its target (`best_fit_decreasing.repair_target`: the bound + 0.1%, at
least one row), `improve` works on it with the steps below, each only while the plan is still above
the target, the best plan winning. Two steps do most of it: `sieve` plans the loose rows
(those with room) again in windows of a seeded shuffle, keeping rows that are not exactly full open
for the next window, and `repair` moves pieces out of the emptiest rows into the room
the others have left. Where the slots can bind the sieve does most: there the room is spread thinly
over many rows, full in slots or short of room for any piece left, and only mixing sizes again
gathers it (chat_dev at L=4096 / S=12: the passes +53 rows, the repair alone +45, the sieve +1). A
probe runs first there: it costs a few to tens of ms where the sieve costs about three plans of the
loose rows, and it often reaches the target by itself. Within 3% of the bound (`_MERGE_FIRST`) the
probe is the repair with the merge (below): near the bound the room left is spread thin, and
gathering it costs less than mixing (gsm8k at 2048 / 16: the passes +14 rows, the merge +1, the
target; chat_dev at 2048 / 16: +18 to +5, the target; at 8192 / 32: +2 to +1), and where it removes
no row the repair alone follows (a merge that finds nothing to swap does not repair). Further off
the repair alone goes first, and the merge after it where the repair brings the plan within 3%;
there the merge misses at a cost that grows faster than the corpus (chat_dev eight times over at
2048 / 6, 6% over the bound: the merge 3 s to +1442 rows, the sieve 1.6 s to +83). (Until
2026-12-03 the repair alone always went first: the same rows on every cell measured, in 1.3x the
time at gsm8k 2048 / 16, where the merge's own repair then did that work again.) A probe's plan is
kept only where it reaches the target; otherwise the sieve starts from the passes' plan (from the
repaired one it has fewer loose rows to mix: 1,682 lognormal lengths at 2048 / 8, +2 rows over the
bound against +1) and the repair with the merge follows. Where the slot share is under 0.5 the
exact fill of `strategies.fill` (the one-dimensional plan's second pass), repaired, is a third
probe: on small corpora of about three pieces a row, few of each size, the passes' rows end with
room no later piece fits (2,031 chat-like lengths of mean 676 at 2048 / 8: the two-pool pass +5
rows, the repair and the merge +2, the sieve and the sample fills no better; the fill +0; 9 of 360
seeded corpora of 500 to 3,000 lengths above the target before it, none after). Where the plan is
one-dimensional the repair goes first (gsm8k at L=2048: +3 to +1 in a few ms), and where the slots
bind for the whole corpus only the repair runs (every row is full in slots: mixing them frees
none).

A repair that leaves the plan above the target gathers the room first and tries again
(`merge.merge_repair`): swaps of one piece for one that fill a row exactly and hand its
room to another that has room, and of one piece for two that bring a free slot to a row full in
slots with room (lognormal lengths of mean 420 at L=2048 / S=5: +10 rows over the bound to +5, the
target; 24 of 432 seeded lognormal cells above the target before, 13 after).

A plan still above the target after that is planned again from scratch, row by row, each row a
sample of the pieces left ended with exactly its room (`strategies.fill.sample_fill_sorted`, with
the ranks of `_SAMPLE_MODES` in turn), then sieved and repaired, until one reaches the target:
where every row must be near-full in both limits, no largest-first order gets there (chat_turns at
2048 / 49 and 4096 / 97: +20 and +11 rows over the bound, +0 with it; eight copies of gsm8k at 2048
/ 13 to 24: +7 to +18, +2 to +4 with it, the target; chat_dev at 4096 / 11: +9, +1).

As a last resort, the best plan so far still above the target, every piece goes through the sieve
(`sieve.sieve_all`: windows of a seeded shuffle, planned as a stream is). A small plan
still above the target after all that (at most 1,024 rows of a few pieces each, the slots binding
little) goes to the swap search (`swap`): a row's pieces are taken out and moved back
into the others by swaps of up to two pieces for two, the room gathered by swaps between rows where
none fits (1,477 lognormal lengths of mean 690 at 2048 / 8, 500.3 rows' worth of tokens: every step
before it ends at 504 rows, the bound is 501, the search gets to the target, 502, in 2 s; 6 of
2,100 seeded small corpora cells above the target before it, none after). The sieve's windows hold
at least 64 rows' worth of pieces (`sieve_window`).

Where slots and tokens bind about equally every greedy order leaves rows short in one or the other
(lognormal lengths of mean 270 at L=2048 / S=8: worst fit into ceil(n / S) rows +52 rows over the
bound, 6.5%, the repair +44), and mixing sizes window by window gets to +3 (worst fit into the
tight bound's rows, where pieces over L/2 are in 31% of them, to +1).

On plans of more than 8,192 rows the repair and the merge run on strided groups of at most that
many rows (`in_groups`): a victim costs work in proportion to the plan, so on a
whole plan of chat_dev 128 times over at L=2048 / S=8 (733,349 rows in the bound) the two took 52 s
and missed the target (+2,511 rows; the sieve then got to +366 in 7 s); in groups they reach it
(+733) in 9.5 s, and the plan takes 18 to 23 s (two runs) instead of 72.

Worked example (capacity 10, max_segments 3; pieces 6 5 4 3 2, the bound 2), asked for 2 rows::

    the plan:       A = [6, 3]  B = [5, 4]  C = [2]      (no row can run out of slots first:
                                                          the one-dimensional steps)
    the repair:     C's 2 finds no room; A's 6 swaps for B's 5 (B has room 1 for the
                    difference): A = [5, 3, 2]  B = [6, 4], 2 rows, the target (the merge
                    leaves the plan as it is; the sieve and every later step do not run)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from seqpack.packer.bounds import SLOTS_BIND_ALL, SLOTS_BIND_HALF, sizes_slot_share, slots_can_bind
from seqpack.packer.strategies.fill import fill_sorted, sample_fill_sorted
from seqpack.packer.strategies.refine.merge import merge_repair
from seqpack.packer.strategies.refine.repair import repair
from seqpack.packer.strategies.refine.sieve import _WINDOW as _SIEVE_WINDOW
from seqpack.packer.strategies.refine.sieve import sieve, sieve_all
from seqpack.packer.strategies.refine.swap import swap_search

Planner = Callable[[np.ndarray], tuple[np.ndarray, int]]  # sizes -> (row per piece, rows)

_SEEDS = 2  # shuffles the whole sieve tries (its rows vary by a few tenths of a percent)
_GROUP_ROWS = 8192  # plans of more rows are repaired in strided groups of at most this many
_MERGE_FIRST = 0.03  # the merge probes where the plan is within this share over the bound
_WINDOW_ROWS = 64  # a sieve window holds at least this many rows' worth of pieces
# the sample fill's (ranks, seed), in the order tried; a sample plan further above the bound
# than _SAMPLE_SPREAD times the plan so far (and 5%) is dropped (the fill stops once it must be)
_SAMPLE_SPREAD = 16
_SAMPLE_MODES = (("middle", 0), ("span", 0), ("random", 0), ("random", 1))


def in_groups(step, sizes: np.ndarray, rows: np.ndarray, num_rows: int, capacity: int,
              max_segments: int, *, target: int, group_rows: int | None = None
              ) -> tuple[np.ndarray, int]:
    """`step` (`repair.repair` or `merge.merge_repair`) on a plan of more than `group_rows` rows
    (`_GROUP_ROWS`) one group of rows at a time: rows r with r % k == g for k groups of at most
    that many, each group a cross-section of the plan (rows are numbered as the passes opened
    them, big pieces first). Each group is asked for its share of the rows still to go (the
    plan's rows over `target`, less what the groups before removed); the rows come out group
    by group. Smaller plans go to `step` whole.

    Both steps cost work in proportion to the plan for every row they empty (a victim looks at
    every piece in a row with room), so on a whole plan their time grows with the square of
    its rows, and their work budget (`repair._BUDGET` per piece) runs out after a fixed number of
    victims: chat_dev 128 times over at L=2048 / S=8 (733,349 rows in the bound), the repair
    4.8 s for 40 of the 4,717 rows over, the merge 47 s to +2,511 against a target of +733.
    A group costs what a plan of its size does."""
    limit = _GROUP_ROWS if group_rows is None else group_rows
    if num_rows <= limit or num_rows <= target:
        return step(sizes, rows, num_rows, capacity, max_segments, target=target)
    k = -(-num_rows // limit)
    rows = np.asarray(rows, np.int64)
    group = rows % k
    order = np.argsort(group, kind="stable")  # pieces group by group, in their order within
    ends = np.searchsorted(group[order], np.arange(1, k + 1))
    out = np.empty_like(rows)
    start, total, left = 0, 0, num_rows - target  # rows still to go
    for g in range(k):
        idx = order[start : ends[g]]
        start = int(ends[g])
        n = (num_rows - g + k - 1) // k  # rows g, g + k, ...: locally 0 .. n - 1
        want = min(n, -(-left // (k - g)))
        got, m = step(sizes[idx], rows[idx] // k, n, capacity, max_segments,
                      target=max(0, n - want))
        left -= n - m
        out[idx] = np.asarray(got, np.int64) + total
        total += m
    return out, total


def sieve_window(sizes: np.ndarray, capacity: int, max_segments: int) -> int:
    """Pieces a window of the sieve adds: `sieve._WINDOW`, or `_WINDOW_ROWS` rows' worth
    (`max_segments` pieces, or `capacity` tokens at the mean piece) where that is more. A
    window of a few rows' worth cannot mix sizes within a row: chat_turns at L=8192 / S=194
    (194 pieces a row), the whole sieve +134 rows over the bound of 1433 with windows of 512
    pieces, +1 with windows of 64 rows' worth (`StreamPlanner`'s `window_rows`, 128, is the
    stream's form of this rule)."""
    per_row = min(max_segments, capacity * sizes.size / max(1, int(sizes.sum())))
    return max(_SIEVE_WINDOW, int(_WINDOW_ROWS * per_row))


def improve(sizes_desc: np.ndarray, rows: np.ndarray, num_rows: int, capacity: int,
            max_segments: int, bound: int, target: int, *, plan: Planner, last: Planner
            ) -> tuple[np.ndarray, int]:
    """The probes (the repair, or near the bound the merge; then where the slots bind little
    the exact fill), the sieve and the repair with the merge, then the sample fills, then the
    whole sieve, then on small plans the swap search (module docstring), each while the plan
    (`rows` of the pieces `sizes_desc`, i64[P] sorted largest first; `num_rows` rows) is above
    `target`; `bound` is the tight lower bound. `plan` / `last`: how the sieve plans a window
    and the rows left open at the end (`sieve.sieve`)."""
    window = sieve_window(sizes_desc, capacity, max_segments)

    def probe(r: np.ndarray, n: int) -> tuple[np.ndarray, int]:  # the repair alone: cheap
        return in_groups(repair, sizes_desc, r, n, capacity, max_segments, target=target)

    def merge(r: np.ndarray, n: int) -> tuple[np.ndarray, int]:
        return in_groups(merge_repair, sizes_desc, r, n, capacity, max_segments, target=target)

    def fix(r: np.ndarray, n: int) -> tuple[np.ndarray, int]:
        return merge(*probe(r, n))

    def mix(r: np.ndarray, n: int) -> tuple[np.ndarray, int]:
        return sieve(sizes_desc, r, n, capacity, plan, last=last, window=window)

    early = (rows, num_rows)  # the probes' plan (where they miss, the sieve starts from rows)
    if not slots_can_bind(sizes_desc[::-1], capacity, max_segments):
        steps = [fix, mix]
    elif (share := sizes_slot_share(sizes_desc, capacity, max_segments)) >= SLOTS_BIND_ALL:
        steps = [fix]  # every row is full in slots: the loose rows alone free no slot
    else:
        steps = [mix, fix]
        if num_rows > target:  # the probes, kept where they reach the target
            near = bound + _MERGE_FIRST * bound
            if num_rows <= near:  # the merge gathers the room, then repairs: no repair first
                early = merge(rows, num_rows)
                if early[1] == num_rows:  # it removed no row (or found nothing to swap, and
                    early = probe(rows, num_rows)  # so did not repair): the repair alone
            else:
                early = probe(rows, num_rows)
                if target < early[1] <= near:
                    early = merge(*early)
            if early[1] > target and share < SLOTS_BIND_HALF:  # the exact fill, repaired
                filled = fix(*fill_sorted(sizes_desc, capacity, max_segments))
                early = min(early, filled, key=lambda got: got[1])
            if early[1] <= target:
                rows, num_rows = early
    for step in steps:
        if num_rows > target:
            rows, num_rows = step(rows, num_rows)
    if early[1] < num_rows:
        rows, num_rows = early
    if num_rows > target:
        limit = bound + max(_SAMPLE_SPREAD * (num_rows - bound), bound // 20)
        for mode, seed in _SAMPLE_MODES:  # rows as samples of the pieces left, then as above
            got, n = sample_fill_sorted(sizes_desc, capacity, max_segments, bound, mode=mode,
                                        seed=seed, limit=limit)
            if n > limit:
                continue  # too far off to be worth the sieve (long pieces crowd the samples)
            for step in (mix, fix):
                if n > target:
                    got, n = step(got, n)
            if n < num_rows:
                rows, num_rows = got, n
            if num_rows <= target:
                break
    if num_rows > target:  # every piece through the sieve, two seeds
        every, n = min((sieve_all(sizes_desc, capacity, plan, last=last, window=window,
                                  seed=seed)
                        for seed in range(_SEEDS)), key=lambda got: got[1])
        if n < num_rows:
            rows, num_rows = fix(every, n) if n > target else (every, n)
    if num_rows > target:  # small plans: swaps between a row's pieces and the others'
        rows, num_rows = swap_search(sizes_desc, rows, num_rows, capacity, max_segments,
                                     target=target)
    return rows, num_rows
