"""Best fit decreasing: the offline, near-optimal strategy (tokens and segment slots).

A row holds `capacity` tokens in at most `max_segments` slots; the plan is measured against the
tight lower bound of `packer.bounds`. Up to four passes, each run only if the ones before it are
further from the bound than `gate` (0.05%, at least one row), the best plan winning:

1. plain best fit decreasing (largest first, into the row it leaves with the least room), run by
   run of equal sizes (below): the best plan wherever the segment cap hardly binds;
2. where the slots bind for the whole corpus (`ceil(n / S)` is at least 90% of the token bound),
   worst fit into the tight bound's rows (`_worst_fit_sorted`): every row a mix of big and
   small. Into `ceil(n / S)` rows instead, the pieces over L/2 that the tight bound counts
   open rows of their own late, and the short tail fills those (chat_turns at 2048 / 53: +1371
   rows instead of +0; stdlib_source 8 times over at 8192 / 6: +615 instead of +0). The
   sieve's windows still deal into `ceil(n / S)` (the tight bound there: chat_dev 2048 / 6
   +15 instead of +6), and a window of a stream into the rows it can fill
   (`assign_best_fit_decreasing`);
3. the two-dimensional pass (`strategies.two_pool`), which keeps slots for the short tail.
   Corpora whose slot bound is 15% to 90% of the token bound start with it: plain BFD fails
   there, its last rows filling their slots with short pieces long before their tokens, and
   runs after it only where the two-pool plan is more than 1% above the bound;
4. where the slot bound is at least half the token bound and pieces over L/2 (no two share a
   row: `big_pieces`) are in at least a quarter of the tight bound's rows, worst fit into those
   rows, last, in every context (offline, the sieve's windows, a stream's windows): one long
   piece a row and the short ones dealt over them. Long files at L=8192 / S=7 (stdlib_source,
   62% of the rows hold a piece over L/2) came out +9 to +122 rows over the bound in a stream
   without it (the short pieces pile up in rows full in slots, with half their tokens free),
   +0 to +1 with it; the offline plan of 8 copies of it +32 instead of +9.

Where no row can run out of slots before tokens (its `max_segments` + 1 smallest pieces do not
fit: `slots_can_bind`), the plan is one-dimensional: pass 1, then (offline, not in a stream's
windows) the row-by-row exact fill of `strategies.fill`, which ends rows with a piece or a pair
of exactly the room left (eight copies of gsm8k at L=2048 / S=64: +2 rows over the bound of
4619 instead of +28, and +20 after the repair and the sieve).

Then, while the plan is above `repair_target` (0.1%, at least one row), two steps improve it:
`strategies.sieve` plans the loose rows (those with room) again in windows of a seeded shuffle,
keeping rows that are not exactly full open for the next window, and `strategies.repair` moves
pieces out of the emptiest rows into the room the others have left. Where the slots can bind
the sieve does most: there the room is spread thinly over many rows, full in slots or short of
room for any piece left, and only mixing sizes again gathers it (chat_dev at L=4096 / S=12:
the passes +53 rows, the repair alone +45, the sieve +1). The repair alone still runs first
there, as a probe: it costs a few to tens of ms where the sieve costs about three plans of the
loose rows, and it often reaches the target by itself (chat_dev at 8192 / 32: +2 to +1, half
the plan time; at 2048 / 16: +18 to +5, the target). Where it does not but leaves the plan
within 3% of the bound (`_MERGE_FIRST`), the repair with the merge (below) is a second probe:
near the bound the room left is spread thin, and gathering it costs less than mixing (gsm8k
at 2048 / 16: the passes +14 rows, the repair +11, the merge +1, the target, in 8 ms where the
sieve takes 35; chat_dev at 2048 / 8: +8 to +5 in 16 ms, the sieve 62). Further off the merge
misses at a cost that grows faster than the corpus (chat_dev eight times over at 2048 / 6, 6%
over the bound: the merge 3 s to +1442 rows, the sieve 1.6 s to +83). A probe's plan is kept
only where it reaches the target; otherwise the sieve starts from the passes' plan (from the
repaired one it has fewer loose rows to mix: 1,682 lognormal lengths at 2048 / 8, +2 rows over
the bound against +1) and the repair with the merge follows. Where the slot share is under 0.5
the exact fill of `strategies.fill` (the one-dimensional plan's second pass), repaired, is a
third probe: on small corpora of about three pieces a row, few of each size, the passes' rows
end with room no later piece fits (2,031 chat-like lengths of mean 676 at 2048 / 8: the
two-pool pass +5 rows, the repair and the merge +2, the sieve and the sample fills no better;
the fill +0; 9 of 360 seeded corpora of 500 to 3,000 lengths above the target before it, none
after). Where the plan is one-dimensional
the repair goes first (gsm8k at L=2048: +3 to +1 in a few ms), and where the slots bind for
the whole corpus only the repair runs (every row is full in slots: mixing them frees none).
A repair that leaves the plan above the target gathers the room first and tries again
(`strategies.repair.merge_repair`): swaps of one piece for one that fill a row exactly and
hand its room to another that has room, and of one piece for two that bring a free slot to a
row full in slots with room (lognormal lengths of mean 420 at L=2048 / S=5: +10 rows over the
bound to +5, the target; 24 of 432 seeded lognormal cells above the target before, 13 after).
A plan still above the target after that is planned again from scratch, row by row, each row
a sample of the pieces left ended with exactly its room (`strategies.fill.sample_fill_sorted`,
with the ranks of `_SAMPLE_MODES` in turn), then sieved and repaired, until one reaches the
target: where every row must be near-full in both limits, no largest-first order gets there
(chat_turns at 2048 / 49 and 4096 / 97: +20 and +11 rows over the bound, +0 with it; eight
copies of gsm8k at 2048 / 13 to 24: +7 to +18, +2 to +4 with it, the target; chat_dev at
4096 / 11: +9, +1). As a last resort, the best plan so far still above the target, every piece
goes through the sieve (`strategies.sieve.sieve_all`: windows of a seeded shuffle, planned as
a stream is). A small plan still above the target after all that (at most 1,024 rows of a few
pieces each, the slots binding little) goes to the swap search (`strategies.swap`): a row's
pieces are taken out and moved back into the others by swaps of up to two pieces for two,
the room gathered by swaps between rows where none fits (1,477 lognormal lengths of mean 690
at 2048 / 8, 500.3 rows' worth of tokens: every step before it ends at 504 rows, the bound is
501, the search gets to the target, 502, in 2 s; 6 of 2,100 seeded small corpora cells above
the target before it, none after). The sieve's windows hold at least 64 rows' worth of
pieces (`sieve_window`).
Where slots and tokens bind about equally every greedy order leaves rows short in one or the
other (lognormal lengths of mean 270 at L=2048 / S=8: worst fit into ceil(n / S) rows +52
rows over the bound, 6.5%, the repair +44), and mixing sizes window by window gets to +3
(worst fit into the tight bound's rows, where pieces over L/2 are in 31% of them, to +1).
On plans of more than 8,192 rows the repair and the merge run on strided groups of at most
that many rows (`strategies.repair.in_groups`): a victim costs work in proportion to the plan,
so on a whole plan of chat_dev 128 times over at L=2048 / S=8 (733,349 rows in the bound) the
two took 52 s and missed the target (+2,511 rows; the sieve then got to +366 in 7 s); in
groups they reach it (+733) in 9.5 s, and the plan takes 18 to 23 s (two runs) instead of 72.

Plain BFD by runs: pieces of equal size are placed without a search per piece: best fit puts
consecutive equal pieces into the same row until it is full, so each open row takes
`min(room // s, S - count)` of the run in order of (room, row), and the rest open new rows
holding `min(capacity // s, S)` each.

Worked example (capacity 10, max_segments 4)::

    sizes (input order):   3  7  5  5  2  8
    sorted (largest first): 8  7  5  5  3  2
    rows:                   0  1  2  2  1  0     row 0 = [8, 2], row 1 = [7, 3], row 2 = [5, 5]
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort

import numpy as np

from seqpack.packer.bounds import slot_share, sorted_lower_bound
from seqpack.packer.strategies.best_fit import _MASK, _SHIFT
from seqpack.packer.strategies.fill import fill_sorted, sample_fill_sorted
from seqpack.packer.strategies.repair import in_groups, merge_repair, repair
from seqpack.packer.strategies.sieve import _WINDOW as _SIEVE_WINDOW
from seqpack.packer.strategies.sieve import sieve, sieve_all
from seqpack.packer.strategies.swap import swap_search
from seqpack.packer.strategies.two_pool import two_pool_sorted

_WORST_FIT_RATIO = 0.9  # try worst fit when the slot bound is at least this share of the token one
_TWO_POOL_FIRST = 0.15  # ... and the two-pool pass first from this share on
WINDOW_SLOTS_BIND = 0.5  # from this share on a stream's window is repaired (`slot_share`)
_FALLBACK = 100  # plain BFD after the two-pool pass only above the bound + 1/100
_SEEDS = 2  # shuffles the whole sieve tries (its rows vary by a few tenths of a percent)
_BIG_ROWS = 0.25  # worst fit into the bound's rows where pieces over L/2 are in this share
_MERGE_FIRST = 0.03  # the merge probes where the repair leaves the plan this share over the bound
_WINDOW_ROWS = 64  # a sieve window holds at least this many rows' worth of pieces
# the sample fill's (ranks, seed), in the order tried; a sample plan further above the bound
# than _SAMPLE_SPREAD times the plan so far (and 5%) is dropped (the fill stops once it must be)
_SAMPLE_SPREAD = 16
_SAMPLE_MODES = (("middle", 0), ("span", 0), ("random", 0), ("random", 1))


def _bfd_sorted(sizes_desc: np.ndarray, capacity: int, max_segments: int
                ) -> tuple[np.ndarray, int]:
    """Best fit over sizes already sorted largest first; returns (row per piece, rows).

    Works run by run (pieces of one size): Python steps per run and per row a run touches,
    numpy per piece, so memory is a few bytes a piece.
    """
    n = int(sizes_desc.size)
    out = np.empty(n, np.int32 if n < 2**31 else np.int64)  # rows <= pieces
    if n == 0:
        return out, 0
    cut = np.flatnonzero(sizes_desc[1:] != sizes_desc[:-1]) + 1
    starts = [0, *cut.tolist()]
    ends = [*cut.tolist(), n]
    run_sizes = sizes_desc[starts].tolist()
    keys: list[int] = []  # sorted `room << 32 | row` of rows that can still take a piece
    count: list[int] = []
    min_size = int(sizes_desc[-1])  # rooms smaller than every piece are closed for good
    num_rows = 0
    for s, i, j in zip(run_sizes, starts, ends):
        # Place the run sizes_desc[i:j] of equal pieces: first into open rows, by best fit.
        k = bisect_left(keys, s << _SHIFT)
        touched = []
        while i < j and k < len(keys):
            key = keys[k]
            r = key & _MASK
            room = key >> _SHIFT
            take = min(room // s, max_segments - count[r], j - i)
            out[i : i + take] = r
            i += take
            count[r] += take
            touched.append((r, room - take * s))
            k += 1
        # Update the rows the run went into (remove their keys, re-insert the new rooms).
        if touched:
            del keys[k - len(touched) : k]
            for r, room in touched:
                if room >= min_size and count[r] < max_segments:
                    insort(keys, (room << _SHIFT) | r)
        if i < j:  # the rest of the run opens new rows, each taking as many as fit
            per_row = min(capacity // s, max_segments)
            full, rest = divmod(j - i, per_row)
            out[i : i + full * per_row] = num_rows + np.arange(full * per_row) // per_row
            i += full * per_row
            room = capacity - per_row * s
            if full and room >= min_size and per_row < max_segments:
                # New rows have the highest numbers: their equal keys go in one block.
                new = [(room << _SHIFT) | r for r in range(num_rows, num_rows + full)]
                at = bisect_left(keys, new[0])
                keys[at:at] = new
            count.extend([per_row] * full)
            num_rows += full
            if rest:
                out[i : i + rest] = num_rows
                i += rest
                room = capacity - rest * s
                count.append(rest)
                if room >= min_size and rest < max_segments:
                    insort(keys, (room << _SHIFT) | num_rows)
                num_rows += 1
    return out, num_rows


def _worst_fit_sorted(sizes_desc: list[int], capacity: int, max_segments: int, num_rows: int):
    """Each piece (largest first) into the open row with the most room; opens rows as needed.

    Starting from `num_rows` empty rows, this deals big pieces out one per row and lets small
    pieces top up the emptiest rows: loads stay balanced and every row's slots get used.
    """
    heap = [(-capacity, r) for r in range(num_rows)]  # (-room, row) of rows with a free slot
    room = [capacity] * num_rows
    count = [0] * num_rows
    out = [0] * len(sizes_desc)
    for i, s in enumerate(sizes_desc):
        if heap and -heap[0][0] >= s:
            r = heap[0][1]
            room[r] -= s
            count[r] += 1
            if count[r] < max_segments:
                heapq.heapreplace(heap, (-room[r], r))
            else:
                heapq.heappop(heap)
        else:
            r = len(room)
            room.append(capacity - s)
            count.append(1)
            if max_segments > 1:
                heapq.heappush(heap, (-room[r], r))
        out[i] = r
    used = sorted({r for r in out})  # rows that stayed empty are dropped and renumbered
    if len(used) < len(room):
        remap = {r: k for k, r in enumerate(used)}
        out = [remap[r] for r in out]
    return out, len(used)


def gate(bound: int) -> int:
    """The most rows a pass may leave before the next one runs: the bound + 0.05%, at least
    + 1 (one row on a plan of fewer than 2,000)."""
    return bound + max(1, bound // 2000)


def repair_target(bound: int) -> int:
    """The rows the repair pass works down to: the bound + 0.1%, at least + 1."""
    return bound + max(1, bound // 1000)


def slots_can_bind(sizes_asc: np.ndarray, capacity: int, max_segments: int) -> bool:
    """Whether a row can run out of slots before tokens: its `max_segments` + 1 smallest
    pieces (`sizes_asc`, i64[n] ascending) fit in `capacity`. If not, the plan is a
    one-dimensional one and only plain BFD (and the repair) run."""
    k = max_segments + 1
    return sizes_asc.size >= k and int(sizes_asc[:k].sum()) <= capacity


def _slot_share(sizes_desc: np.ndarray, capacity: int, max_segments: int) -> float:
    """`bounds.slot_share` of the pieces `sizes_desc`. From 0.9 on the slots bind for the
    whole corpus (worst fit runs); from 0.5 (`WINDOW_SLOTS_BIND`) on a stream's window is
    repaired (its rows come out short in one limit or the other, and the repair gathers them)
    and keeps its rows short in slots open (`stream._slot_poor_open`)."""
    return slot_share(int(sizes_desc.size), int(sizes_desc.sum()), capacity, max_segments)


def big_pieces(sizes_desc: np.ndarray, capacity: int) -> int:
    """How many of the pieces (sorted largest first) are over capacity / 2: no two share a row."""
    return int(np.searchsorted(-sizes_desc, -(capacity // 2), side="left"))


def _passes(sizes_desc: np.ndarray, capacity: int, max_segments: int, bound: int, *,
            window: int = 0, deal_bound: bool = False):
    """The passes in the order they run (see the module docstring), lazily, each with a test of
    the best plan so far (its rows) that says whether the pass is still worth running; every
    pass after the first runs only while that plan is above `gate`. `window`: the pieces are
    planned for a stream of windows of that many examples (`assign_best_fit_decreasing`).
    `deal_bound`: worst fit deals into the tight bound's rows, not ceil(n / S)."""
    n, tokens = int(sizes_desc.size), int(sizes_desc.sum())
    slot_bound = -(-n // max_segments)
    share = _slot_share(sizes_desc, capacity, max_segments)
    two_pool = lambda: two_pool_sorted(sizes_desc, capacity, max_segments, bound)  # noqa: E731
    plain = lambda: _bfd_sorted(sizes_desc, capacity, max_segments)  # noqa: E731
    always = lambda rows: True  # noqa: E731
    gross = lambda rows: rows > bound + bound // _FALLBACK  # noqa: E731
    if not slots_can_bind(sizes_desc[::-1], capacity, max_segments):
        if window:
            return [(plain, always)]
        # offline: the row-by-row exact fill where plain BFD leaves its rows' last tokens
        return [(plain, always), (lambda: fill_sorted(sizes_desc, capacity,  # noqa: E731
                                                      max_segments), always)]
    big = share >= WINDOW_SLOTS_BIND and big_pieces(sizes_desc, capacity) >= _BIG_ROWS * bound
    # where pieces over L/2 are in a quarter of the bound's rows: worst fit into the bound's
    # rows, last (pass 4 of the module docstring)
    extra = [(lambda: _worst_fit_sorted(sizes_desc.tolist(), capacity, max_segments,  # noqa: E731
                                        bound), always)] if big else []
    if share >= _WORST_FIT_RATIO:
        # A window's worst fit, where its slots bind more than its tokens, fills only the rows
        # its pieces can fill (the rest opens rows of its own): rows balanced alike over
        # ceil(n / S) are all short, and a stream emits none.
        if window and n * capacity > tokens * max_segments:
            deal = max(1, n // max_segments)
        else:
            deal = bound if deal_bound else slot_bound
        wf = lambda: _worst_fit_sorted(sizes_desc.tolist(), capacity, max_segments,  # noqa: E731
                                       deal)
        if deal == bound:
            extra = []  # the same pass
        if window and 4 * min(max_segments, capacity * n / tokens) > window:
            # rows take more than a quarter of a window: plain BFD first would leave the
            # shortest pieces to rows of their own, window after window, until they came due
            return [(wf, always), (plain, always), (two_pool, always)] + extra
        return [(plain, always), (wf, always), (two_pool, always)] + extra
    if share >= _TWO_POOL_FIRST:
        # Plain BFD only where the two-pool pass missed by more than 1%: short of that it has
        # not once done better here (the sieve closes the rest: chat_dev at 2048 / 8, two-pool
        # + 35 rows, plain + 517), and it would cost a fifth of the two-pool pass's time.
        return [(two_pool, always), (plain, gross)] + extra
    return [(plain, always), (two_pool, always)]  # (no `extra`: it needs a share of 0.5)


def _sieve_planners(capacity: int, max_segments: int):
    """(plan, last) for the sieve: a window by every pass (no repair, no sieve), and the rows
    left open at the end the same, then repaired."""

    def plan(sizes: np.ndarray) -> tuple[np.ndarray, int]:
        return assign_best_fit_decreasing(sizes, capacity, max_segments, slack=0,
                                          repair_rows=False)

    def last(sizes: np.ndarray) -> tuple[np.ndarray, int]:
        got, n = plan(sizes)
        return repair(sizes, np.asarray(got, np.int64), n, capacity, max_segments, target=0)

    return plan, last


def sieve_window(sizes: np.ndarray, capacity: int, max_segments: int) -> int:
    """Pieces a window of the sieve adds: `sieve._WINDOW`, or `_WINDOW_ROWS` rows' worth
    (`max_segments` pieces, or `capacity` tokens at the mean piece) where that is more. A
    window of a few rows' worth cannot mix sizes within a row: chat_turns at L=8192 / S=194
    (194 pieces a row), the whole sieve +134 rows over the bound of 1433 with windows of 512
    pieces, +1 with windows of 64 rows' worth (`StreamPlanner`'s `window_rows`, 128, is the
    stream's form of this rule)."""
    per_row = min(max_segments, capacity * sizes.size / max(1, int(sizes.sum())))
    return max(_SIEVE_WINDOW, int(_WINDOW_ROWS * per_row))


def _improve(sizes_desc: np.ndarray, rows: np.ndarray, num_rows: int, capacity: int,
             max_segments: int, bound: int, target: int) -> tuple[np.ndarray, int]:
    """The probes (the repair, then near the bound the merge, then where the slots bind little
    the exact fill), the sieve and the repair with the merge, then the sample fills, then the
    whole sieve, then on small plans the swap search (module docstring), each while the plan
    is above `target`."""
    plan, last = _sieve_planners(capacity, max_segments)
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
    elif (share := _slot_share(sizes_desc, capacity, max_segments)) >= _WORST_FIT_RATIO:
        steps = [fix]  # every row is full in slots: the loose rows alone free no slot
    else:
        steps = [mix, fix]
        if num_rows > target:  # the probes, kept where they reach the target
            early = probe(rows, num_rows)
            if target < early[1] <= bound + _MERGE_FIRST * bound:
                early = merge(*early)
            if early[1] > target and share < WINDOW_SLOTS_BIND:  # the exact fill, repaired
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


def assign_best_fit_decreasing(
    sizes: np.ndarray, capacity: int, max_segments: int, *, slack: int | None = None,
    repair_rows: bool = True, window: int = 0,
) -> tuple[np.ndarray, int]:
    """Best fit decreasing (the passes of the module docstring); returns (row per piece, rows).

    `slack`: rows over the tight bound at which the passes and the repair stop (default: `gate`
    and `repair_target`); 0 runs them all unless one reaches the bound. `repair_rows`: run the
    sieve and the repair after the passes (off for the sieve's windows; a stream's window gets
    the repair alone, below).
    `window`: the pieces are planned for a `StreamPlanner` that adds `window` examples at a
    time, emits the rows that come out full and plans the others again with the next window
    (0: not a stream). Where the slots bind for the whole window:
    - if they bind more than its tokens (n / S > T / L), worst fit deals into floor(n / S) rows
      instead of ceil(n / S): those come out full in slots, and the pieces that fit none open
      rows of their own (chat_turns shuffled at L=8192 / S=192: +4 rows instead of +47, where
      every window's rows came out balanced alike, none full, and were emitted so);
    - where a row takes more than a quarter of a window's pieces, worst fit runs before plain
      BFD (chat_turns shuffled at 32768 / 619: +1 instead of +27).
    From a slot share of 0.5 (`_slot_share`) the repair runs on the window's plan (without the
    sieve): chat_turns shuffled at 2048 / 48 +21 instead of +56, chat_dev at 2048 / 6 +6
    instead of +12."""
    sizes = np.asarray(sizes, np.int64)
    n = sizes.size
    if n == 0:
        return np.zeros(0, np.int64), 0
    small = sizes.astype(np.int32) if capacity < 2**31 else sizes.copy()  # sizes <= capacity
    small *= -1
    order = np.argsort(small, kind="stable")  # largest first, ties in input order
    del small
    sizes_desc = sizes[order]
    bound = sorted_lower_bound(sizes_desc[::-1], capacity, max_segments)
    enough = gate(bound) if slack is None else bound + slack
    target = repair_target(bound) if slack is None else bound + slack
    best: tuple[object, int] | None = None
    for run, worth in _passes(sizes_desc, capacity, max_segments, bound, window=window,
                              deal_bound=repair_rows and not window):
        if best is not None and (best[1] <= enough or not worth(best[1])):
            break
        got, num = run()
        if best is None or num < best[1]:
            best = (got, num)
    assert best is not None
    rows_desc, num_rows = np.asarray(best[0]), best[1]
    if repair_rows and num_rows > target:
        if not window:
            rows_desc, num_rows = _improve(sizes_desc, rows_desc, num_rows, capacity,
                                           max_segments, bound, target)
        elif _slot_share(sizes_desc, capacity, max_segments) >= WINDOW_SLOTS_BIND:
            rows_desc, num_rows = repair(sizes_desc, rows_desc, num_rows, capacity, max_segments,
                                         target=target)
    rows = np.empty(n, np.int64)
    rows[order] = rows_desc
    return rows, num_rows
