"""Best fit decreasing: the offline, near-optimal strategy (tokens and segment slots).

A row holds `capacity` tokens in at most `max_segments` slots; the plan is measured against the
tight lower bound of `packer.bounds`. For a whole plan (offline, and a stream's last window),
where a row can run out of slots, the pieces are first dealt into the bound's rows
(`strategies.deal`, a few numpy passes over the pieces); where every row fits, that plan has the
bound's rows and no pass runs. gsm8k_train at L=32768 / S=256 and 8192 / 64 reach the bound so
in 0.05 and 0.4 ms, where the two-pool pass took 4.4 and 6.2 ms. On the grid of
`benchmarks/packer_bench.py` it fits 41 of the 77 cells where slots can bind, 6 of which the
passes had left a row or more over the bound (chat_turns 8192 / 8: +8); where it misses it cost
19 ms over the other 36 (mostly chat_turns' 277k pieces, 2 ms a cell). Otherwise up to four
passes, each run only if the ones before it are further from the bound than `gate` (0.05%, at
least one row), the best plan winning:

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
4619 instead of +28, and +20 after the repair and the sieve). Where the pieces of each size are
few (at most `_FILL_FIRST`, 32, a distinct size on average) the fill runs first and plain BFD
only if it misses: the fill costs a few Python steps a piece, plain BFD a few a run of equal
sizes and a row it touches, so with few pieces a size the fill costs about as much or less
(0.5-1.1x on the sample corpora and lognormal ones at L=2048 and 8192; 1.4x on stdlib_source
at 131072, whose longest file makes its table L long, 3.4 against 2.4 ms), and it reached the
bound on every one-dimensional cell measured at that scale (2026-12-03), where plain BFD
misses gsm8k at L=2048 by 3 rows and both ran.

Then, while the plan is above `repair_target` (0.1%, at least one row), `strategies.refine.improve`
works on it: the probes (the repair, the merge, the exact fill), the sieve, the repair with the
merge, the sample fills, the whole sieve and, on small plans, the swap search, each while the
plan is still above the target. The sieve's windows are planned by every pass above (no repair,
no sieve: `_sieve_planners`).

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

from seqpack.packer.bounds import (
    SLOTS_BIND_ALL,
    SLOTS_BIND_HALF,
    sizes_slot_share,
    slots_can_bind,
    sorted_lower_bound,
)
from seqpack.packer.strategies.best_fit import _MASK, _SHIFT
from seqpack.packer.strategies.deal import deal_sorted
from seqpack.packer.strategies.fill import fill_sorted
from seqpack.packer.strategies.refine.improve import improve
from seqpack.packer.strategies.refine.repair import repair
from seqpack.packer.strategies.two_pool import two_pool_sorted

_TWO_POOL_FIRST = 0.15  # ... and the two-pool pass first from this share on
_FALLBACK = 100  # plain BFD after the two-pool pass only above the bound + 1/100
_BIG_ROWS = 0.25  # worst fit into the bound's rows where pieces over L/2 are in this share
_FILL_FIRST = 32  # one-dimensional: the exact fill before plain BFD up to these pieces a size


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
    share = sizes_slot_share(sizes_desc, capacity, max_segments)
    two_pool = lambda: two_pool_sorted(sizes_desc, capacity, max_segments, bound)  # noqa: E731
    plain = lambda: _bfd_sorted(sizes_desc, capacity, max_segments)  # noqa: E731
    always = lambda rows: True  # noqa: E731
    gross = lambda rows: rows > bound + bound // _FALLBACK  # noqa: E731
    if not slots_can_bind(sizes_desc[::-1], capacity, max_segments):
        if window:
            return [(plain, always)]
        # offline: the row-by-row exact fill where plain BFD leaves its rows' last tokens;
        # first where it costs less than plain BFD (few pieces a size, `_FILL_FIRST`)
        fill = lambda: fill_sorted(sizes_desc, capacity, max_segments)  # noqa: E731
        if n <= _FILL_FIRST * (1 + int(np.count_nonzero(sizes_desc[1:] != sizes_desc[:-1]))):
            return [(fill, always), (plain, always)]
        return [(plain, always), (fill, always)]
    big = share >= SLOTS_BIND_HALF and big_pieces(sizes_desc, capacity) >= _BIG_ROWS * bound
    # where pieces over L/2 are in a quarter of the bound's rows: worst fit into the bound's
    # rows, last (pass 4 of the module docstring)
    extra = [(lambda: _worst_fit_sorted(sizes_desc.tolist(), capacity, max_segments,  # noqa: E731
                                        bound), always)] if big else []
    if share >= SLOTS_BIND_ALL:
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
    From a slot share of 0.5 (`bounds.sizes_slot_share`) the repair runs on the window's plan
    (without the sieve): chat_turns shuffled at 2048 / 48 +21 instead of +56, chat_dev at
    2048 / 6 +6 instead of +12."""
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
    whole = repair_rows and not window  # a whole plan: offline, or a stream's last window
    best: tuple[object, int] | None = None
    if whole and slots_can_bind(sizes_desc[::-1], capacity, max_segments):
        best = deal_sorted(sizes_desc, capacity, max_segments, bound)  # the bound's rows, or None
    for run, worth in _passes(sizes_desc, capacity, max_segments, bound, window=window,
                              deal_bound=whole):
        if best is not None and (best[1] <= enough or not worth(best[1])):
            break
        got, num = run()
        if best is None or num < best[1]:
            best = (got, num)
    assert best is not None
    rows_desc, num_rows = np.asarray(best[0]), best[1]
    if repair_rows and num_rows > target:
        if not window:
            plan, last = _sieve_planners(capacity, max_segments)
            rows_desc, num_rows = improve(sizes_desc, rows_desc, num_rows, capacity,
                                          max_segments, bound, target, plan=plan, last=last)
        elif sizes_slot_share(sizes_desc, capacity, max_segments) >= SLOTS_BIND_HALF:
            rows_desc, num_rows = repair(sizes_desc, rows_desc, num_rows, capacity, max_segments,
                                         target=target)
    rows = np.empty(n, np.int64)
    rows[order] = rows_desc
    return rows, num_rows
