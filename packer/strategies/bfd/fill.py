"""Row-by-row exact fills: rows planned one at a time, each ended with exactly its room.

Best fit decreasing leaves each row with the room its last piece could not use; on corpora of
many short pieces that adds up to whole rows. Two fills plan rows one at a time instead:

* `fill_sorted`, the one-dimensional pass: the largest piece left opens a row, then while it
  has room `r`, a piece of exactly `r` ends it, else two pieces that sum to exactly `r` (the
  largest such pair), else the largest piece that fits goes in and the search goes on with the
  room it leaves, until no piece fits or the row holds `max_segments` pieces. With many pieces
  of each size an exact ending is almost always there. Where the slots can bind it is no good
  (every row takes the largest pieces first and the short tail ends up in rows of its own), so
  the schedule runs it as a pass only where the plan is one-dimensional, and as a probe,
  repaired, where the slots bind little.
* `sample_fill_sorted`, its two-dimensional form, where every row is a sample of the pieces
  left (for plans still above the target where slots and tokens bind alike).

Both plan on the count of pieces per size, a few Python steps a piece.

Worked example of `fill_sorted` (capacity 10)::

    sizes (largest first):  8  6  5  4  3  2  2
    row 0: 8, room 2 -> a 2 ends it              [8, 2]
    row 1: 6, room 4 -> a 4 ends it              [6, 4]
    row 2: 5, room 5 -> no 5, pair 3 + 2 ends it [5, 3, 2]
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort

import numpy as np

_PAIR_TRIES = 32  # sizes the pair search tries one by one before it looks at all of them
_NUMPY_RANKS = 32  # a sample of more ranks than this works them out in numpy


def _pair(avail: list[int], cnt: list[int], has: np.ndarray, room: int) -> int:
    """The largest size a <= room / 2 left with room - a left too (two of it where a = room - a),
    or 0. `avail`: the sizes left, ascending; `cnt`: pieces left per size; `has`: cnt > 0."""
    top = bisect_right(avail, room // 2) - 1
    low = max(-1, top - _PAIR_TRIES)
    for i in range(top, low, -1):  # most often one of the first few
        a = avail[i]
        if cnt[room - a] and (a != room - a or cnt[a] >= 2):
            return a
    if low < 0:
        return 0  # every size tried
    a = avail[low + 1] - 1  # the rest at once: every a left below the ones tried
    pairs = np.flatnonzero(has[: a + 1] & has[room - a : room + 1][::-1])
    return int(pairs[-1]) if pairs.size else 0  # (each under half: room - a differs from a)


def fill_sorted(sizes_desc: np.ndarray, capacity: int, max_segments: int
                ) -> tuple[np.ndarray, int]:
    """Rows for sizes sorted largest first (each in [1, capacity]) by the fill of the module
    docstring; returns (row per piece, rows)."""
    n = int(sizes_desc.size)
    out = np.empty(n, np.int64)
    if n == 0:
        return out, 0
    # Per size up to the largest room a lookup asks about (a row's room once its largest
    # piece no longer fits twice: at most twice the largest size), not up to the row length
    # (at long rows a table of L + 1 sizes was most of the fill's time). Sizes past the
    # largest count 0.
    count = np.bincount(sizes_desc, minlength=min(capacity, 2 * int(sizes_desc[0])) + 1)
    has = count > 0
    # pieces of size s are sizes_desc[nxt[s] : nxt[s] + count[s]] (after the larger ones)
    nxt = (n - np.cumsum(count)).tolist()
    cnt = count.tolist()
    avail = np.flatnonzero(has).tolist()  # sizes left, ascending
    S = max_segments
    num_rows = 0

    def take(s: int, row: int) -> None:
        out[nxt[s]] = row
        nxt[s] += 1
        cnt[s] -= 1
        if not cnt[s]:
            has[s] = False
            del avail[bisect_right(avail, s) - 1]

    while avail:
        top = avail[-1]
        take(top, num_rows)
        room, k = capacity - top, 1
        while avail and k < S and room > 2 * avail[-1]:
            # the largest piece left fits twice over: no exact ending yet, it goes in, as many
            # of its size at once as keep that so (the loop below, a piece at a time, the same)
            top = avail[-1]
            j = min(cnt[top], S - k, -(-(room - 2 * top) // top))
            out[nxt[top] : nxt[top] + j] = num_rows
            nxt[top] += j
            cnt[top] -= j
            if not cnt[top]:
                has[top] = False
                avail.pop()
            room -= j * top
            k += j
        while room and avail and k < S:
            if cnt[room]:
                take(room, num_rows)
                break
            if k + 2 <= S and room <= 2 * avail[-1]:
                a = _pair(avail, cnt, has, room)
                if a:
                    take(a, num_rows)
                    take(room - a, num_rows)
                    break
            i = bisect_right(avail, room) - 1
            if i < 0:
                break
            s = avail[i]
            take(s, num_rows)
            room -= s
            k += 1
        num_rows += 1
    return out, num_rows


def sample_fill_sorted(sizes_desc: np.ndarray, capacity: int, max_segments: int, rows: int, *,
                       mode: str = "random", seed: int = 0, limit: int | None = None
                       ) -> tuple[np.ndarray, int]:
    """Rows as samples of the pieces left, each ended exactly: the two-dimensional fill.

    Where slots and tokens both bind, a plan at the bound needs every row near-full in both, so
    every row must hold pieces of about the mean size: the pieces a row takes change what the
    rows after it can do, and the largest-first passes leave the last rows the short tail. Here
    rows (`rows` of them, the tight bound, are aimed at) are planned one at a time, each as a
    sample of the pieces left (sizes sorted largest first, each in [1, capacity]):

    * the largest piece left opens the row if it is over half a row (no two such share one);
      the rest of the row is the sample, over the pieces that fit the room left;
    * `k` pieces at ranks spread over those pieces in order of size: in each of k equal strata
      its middle (`mode` "middle"), a random rank ("random", by `seed`), or evenly from the
      smallest to the largest ("span"). `k` is the count at which the room fills at the mean
      piece (the integer below or above, whichever sample sums closer to the room), at least
      what keeps ceil(pieces left / rows left) a row, at most the free slots;
    * then nudged: where the sample is over the room, or under it while tokens bind (`k` came
      from tokens), its pieces, largest first, are swapped for the piece left nearest to
      closing the gap (between the two sizes) until the row is exactly full; still over, its
      largest pieces go back; still under with a slot free, a piece of exactly the room left
      ends it.

    The pieces left stay a sample of the corpus, so the last rows are no worse than the first.
    Which ranks do best depends on the spread of sizes, so the schedule tries them in turn.
    Returns (row per piece, rows); with `limit`, it stops as soon as the rows planned plus the
    simple bound of the pieces left exceed it, and returns that count with an unfinished plan.

    Worked example (capacity 10, max_segments 4, rows 3, the bound; mode "middle")::

        sizes (ascending):  1 1 2 2 3 3 3 4 5 6       (30 tokens, 10 pieces)
        row 0: the 6 opens it (room 4, 3 slots); k = 3 (ceil(10 / 3) pieces a row); strata
               middles of 1 1 2 2 3 3 3 4: 1 3 3 = 7, over by 3: a 3 becomes a 1, then a
               3 a 2                                                   [6, 2, 1, 1]
        row 1: left 2 3 3 3 4 5; k = 3 (10 / mean 3.33): 3 3 5 = 11: the 5 becomes the 4
                                                                       [4, 3, 3]
        row 2: left 2 3 5: all of them                                 [5, 3, 2]

    Plain BFD makes 4 rows of the same pieces: [6, 4] [5, 3, 2] [3, 3, 2, 1] [1].
    """
    n = int(sizes_desc.size)
    out = np.full(n, -1, np.int64)
    if n == 0:
        return out, 0
    asc = sizes_desc[::-1]
    vals, cnt = np.unique(asc, return_counts=True)  # distinct sizes ascending, counts
    first = n - np.cumsum(cnt)  # pieces of vals[j] are sizes_desc[first[j] : first[j] + cnt[j]]
    nxt = first.tolist()
    left = _Left(vals, cnt)
    vals_list = left.vals_list
    L, S = int(capacity), int(max_segments)
    rng = np.random.default_rng(seed)
    n_left, t_left = n, int(asc.sum())
    num_rows = 0
    while n_left:
        if limit is not None:
            need = num_rows + max(-(-t_left // L), -(-n_left // S))
            if need > limit:
                return out, need
        top = left.live[-1]  # the largest size left
        rows_left = max(1, rows - num_rows)
        k_min = -(-n_left // rows_left)  # pieces a row takes so the rest fit the rows left
        opener: list[int] = []
        room, slots = L, S
        if 2 * vals_list[top] > L:  # over half a row: it opens the row, the sample fills it
            opener = [top]
            left.take(top)
            room, slots, k_min = L - vals_list[top], S - 1, k_min - 1
        picks = _sample(left, room, slots, k_min, mode, rng)
        for j in opener + picks:
            out[nxt[j]] = num_rows
            nxt[j] += 1
            t_left -= vals_list[j]
        n_left -= len(opener) + len(picks)
        num_rows += 1
    return out, num_rows


class _Left:
    """The pieces left per size for the sample fill: `vals` (distinct sizes ascending, also as
    `vals_list`), `cnt` (pieces left per size, i64, for the sums over a prefix of sizes),
    `counts` (the same as a list, for one size at a time) and `live` (the indices of the sizes
    left, ascending), kept in step by `take` and `give`."""

    def __init__(self, vals: np.ndarray, cnt: np.ndarray) -> None:
        self.vals, self.vals_list = vals, vals.tolist()
        self.cnt = cnt.astype(np.int64)
        self.counts: list[int] = self.cnt.tolist()
        self.live = [j for j, c in enumerate(self.counts) if c]

    def take(self, j: int) -> None:
        """One piece of size index `j` off."""
        c = self.counts[j] - 1
        self.counts[j] = c
        self.cnt[j] = c
        if not c:
            del self.live[bisect_left(self.live, j)]

    def give(self, j: int) -> None:
        """One piece of size index `j` back."""
        c = self.counts[j] + 1
        self.counts[j] = c
        self.cnt[j] = c
        if c == 1:
            insort(self.live, j)


def _ranks(k: int, pool: int, mode: str, rng: np.random.Generator) -> list[int]:
    """k ranks among `pool` pieces in order of size (all of them if k >= pool): each of k equal
    strata's middle ("middle"), a random rank in each ("random"), or evenly from the smallest
    to the largest ("span"). Few ranks are worked out in Python, many in numpy: the same
    float64 steps, the same ranks."""
    if k >= pool:
        return list(range(pool))
    if k > _NUMPY_RANKS:
        return _ranks_array(k, pool, mode, rng).tolist()
    if mode == "span":
        step = max(1, k - 1)
        return [round(i * (pool - 1) / step) for i in range(k)]
    if mode == "middle":
        return [int((i + 0.5) * pool / k) for i in range(k)]
    edge = [i * pool // k for i in range(k + 1)]  # at random within each stratum (distinct)
    u = rng.random(k).tolist()
    return [edge[i] + int(u[i] * (edge[i + 1] - edge[i])) for i in range(k)]


def _ranks_array(k: int, pool: int, mode: str, rng: np.random.Generator) -> np.ndarray:
    """`_ranks` for k < pool in numpy."""
    if mode == "span":
        return np.rint(np.arange(k) * (pool - 1) / max(1, k - 1)).astype(np.int64)
    if mode == "middle":
        return ((np.arange(k) + 0.5) * pool / k).astype(np.int64)
    edge = np.arange(k + 1) * pool // k
    return edge[:-1] + (rng.random(k) * np.diff(edge)).astype(np.int64)


def _sample(left: _Left, room: int, slots: int, k_min: int, mode: str,
            rng: np.random.Generator) -> list[int]:
    """The sample that fills one row's `room` in at most `slots` pieces (indices into
    `left.vals`, ascending sizes; their pieces taken off `left`): the ranks of `_ranks` at the
    count that fills the room at the mean piece (the one below or above, whichever sums
    closer), nudged to end the row exactly (see `sample_fill_sorted`)."""
    vals_list = left.vals_list
    m = bisect_right(vals_list, room)  # sizes that fit the room
    if not (m and slots):
        return []
    cnt = left.cnt[:m]
    cum = cnt.cumsum()
    pool = int(cum[-1])
    if not pool:
        return []
    k_tok = room * pool / int(cnt.dot(left.vals[:m]))
    k_lo = min(slots, pool, max(k_min, 1))
    ks = [max(k_lo, min(slots, pool, int(k_tok) + e)) for e in (0, 1)]
    if ks[0] == ks[1]:
        del ks[1]
    ranks = _ranks(ks[0], pool, mode, rng)
    if len(ks) > 1:
        ranks += _ranks(ks[1], pool, mode, rng)
    got = cum.searchsorted(ranks, side="right").tolist()  # into vals, every k at once
    d = 0  # the sample nearest the room is over (> 0) or under (< 0) a full row by d
    picks: list[int] = []
    for k in ks:
        here, got = got[:k], got[k:]
        gap = sum([vals_list[j] for j in here]) - room
        if not picks or abs(gap) < abs(d):
            d, picks = gap, here
    tokens_bind = k_tok >= k_lo
    for j in picks:
        left.take(j)
    if d > 0 or (d < 0 and tokens_bind):
        d = _nudge(picks, d, left)
    while d > 0:  # still over: the largest pieces go back
        j = picks.pop()
        left.give(j)
        d -= vals_list[j]
    if d < 0 and len(picks) < slots:  # under: a piece of exactly the room left
        j = bisect_left(vals_list, -d)
        if j < len(vals_list) and vals_list[j] == -d and left.counts[j] > 0:
            left.take(j)
            picks.append(j)
    return picks


def _nudge(picks: list[int], d: int, left: _Left) -> int:
    """Swaps picks (indices into `left.vals_list`, ascending sizes), largest first, for the size
    left nearest to closing the gap `d` (the sum over the room: > 0 over, < 0 under), between
    the two sizes; the pieces are moved in `left`, and `picks` sorted ascending in place.
    Returns the gap left."""
    vals_list = left.vals_list
    for q in range(len(picks) - 1, -1, -1):
        if d == 0:
            break
        j = picks[q]
        x = vals_list[j]
        y = _nearest(j, x - d, vals_list, left.live)
        if y < 0:
            continue
        left.take(y)
        left.give(j)
        picks[q] = y
        d -= x - vals_list[y]
    picks.sort()
    return d


def _nearest(j: int, want: int, vals_list: list[int], live: list[int]) -> int:
    """The size left (its index) to swap size `j` for: the smallest in [want, vals[j]) where
    `want` is below it, else the largest in (vals[j], want]; -1 where none is left (sizes
    `vals_list` ascending; `live`: the indices of the sizes left, ascending)."""
    if want < vals_list[j]:
        i = bisect_left(live, bisect_left(vals_list, want))
        return live[i] if i < len(live) and live[i] < j else -1
    i = bisect_left(live, bisect_right(vals_list, want)) - 1
    return live[i] if i >= 0 and live[i] > j else -1
