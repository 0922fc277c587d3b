"""Repair pass: empties the least-filled rows of a plan into the room the other rows have left.

Greedy plans leave a little room in many rows (at most the smallest piece, for best fit): on a
corpus whose pieces are never short (GSM8K, 55 tokens and up) that adds up to whole rows. This
pass takes the least-filled row (the victim) and places each of its pieces, largest first:

* into the row with the least room that fits it and has a free slot, else
* into a row B with a free slot after making room there: a piece y of B swaps with a smaller
  piece x of a row A that has room for y - x (`_open_room`), else
* in place of a smaller piece `x` of a row with room >= size - x (the row only gets fuller, its
  slot count does not change), and places `x` the same way: an ejection chain; pieces get
  strictly smaller along it, so it ends, and it is cut after `_DEPTH` swaps.

If every piece finds a place the row is gone; otherwise every move of that attempt is undone
and the next victim is tried, up to `_FAILURES` failures in a row. Work is bounded (`_BUDGET`
array elements per piece of the plan), so the pass costs at most a few plain passes.

Where every row must be near full (tokens bind: lognormal lengths of mean 420 at L=2048 / S=15,
3,131 rows of the bound leave 238 tokens of room in all), the plan's room lies in rows too
little for any piece: 422 of 3,135 rows with 1 to 9 tokens free, a row's worth in all, and no
victim's piece fits there. `merge_rooms` gathers it first: a row A with room `r` swaps a piece
`a` for a piece of exactly `a + r` from another row B that has room: A comes out full, B holds
both rooms; rows with the least room go first, into the row with the most room among the
first few candidates. Slot counts do not change. Where few slots bind with long pieces the room
lies in rows full in slots and the free slots in rows full in tokens (lognormal lengths of mean
420 at L=2048 / S=5: 56 rows of five pieces with 351 tokens of room each, 500 rows of one to
four pieces with none), so no piece fits anywhere; `share_slots` swaps a piece `a` of a row
with a free slot for two pieces of such a row summing to at most `a` (and at least `a` less
half that row's room): the row with room gets a free slot beside it. Then the repair runs
again, and all three again while the plan shrinks (`merge_repair`): there +10 rows over the
bound to +5, the target; at S=15, +4 to +3.

Worked example (capacity 10, max_segments 3; the plan has 3 rows, the bound is 2)::

    rows:          A = [6, 3]  (room 1)   B = [5, 4]  (room 1)   C = [2]    victim: C
    piece 2:       no row has room 2; no smaller piece to swap it for
    open room:     A (room 1) needs 1 more: its 6 for B's 5 (B has room 1 for the difference)
    rows:          A = [5, 3, 2]  B = [6, 4]                     C is gone: 2 rows
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

import numpy as np

_DEPTH = 8  # swaps along one ejection chain
_FAILURES = 3  # victims that may fail in a row before the pass stops
_BUDGET = 400  # array elements looked at per piece of the plan, in all
_ROWS, _PIECES = 4, 16  # rows B, and pieces of each, that _open_room tries
# the pairs (i < j) of m pieces for m <= _PIECES, as share_slots asks for them (np.triu_indices
# builds an m x m mask each call: most of share_slots' time per row)
_PAIRS = [np.triu_indices(m, 1) for m in range(_PIECES + 1)]
_MERGE_PASSES = 4  # passes of merge_rooms over the rows with room
_MERGE_CANDIDATES = 8  # rows B (of the first pieces of the size A needs) it picks the roomiest of
_SHARE_CANDIDATES = 32  # pieces share_slots looks at per pair of a row with room
_SHARE_ROWS = 1024  # rows with room (the roomiest) share_slots looks at, at most
_MERGE_ROUNDS = 8  # merges and repairs while the plan shrinks


def _room_count(sizes: np.ndarray, rows: np.ndarray, num_rows: int, capacity: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """(room, pieces) per row of the plan, both i64[num_rows]."""
    room = capacity - np.bincount(rows, weights=sizes, minlength=num_rows).astype(np.int64)
    return room, np.bincount(rows, minlength=num_rows).astype(np.int64)


def _by_row(rows: np.ndarray, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The plan's pieces per row as CSR: row r holds by_row[start[r] : start[r + 1]]."""
    by_row = np.argsort(rows, kind="stable")
    return by_row, np.searchsorted(rows[by_row], np.arange(num_rows + 1))


class _State:
    """Rows' rooms and counts, each piece's row, and an undo log of moves."""

    def __init__(self, sizes: np.ndarray, rows: np.ndarray, num_rows: int, capacity: int,
                 max_segments: int) -> None:
        self.size = sizes
        self.row = rows.astype(np.int64)
        self.S = max_segments
        self.capacity = capacity
        self.room, self.count = _room_count(sizes, self.row, num_rows, capacity)
        self.alive = np.ones(num_rows, bool)
        self.log: list[tuple[int, int]] = []  # (piece, row it left)
        self.roomy_size = sizes[:0]  # sizes of the pieces the current victim's moves look at
        self.roomy_by_size = sizes[:0]  # positions in roomy_size, sizes ascending (stable)
        self.roomy_sorted = sizes[:0]  # roomy_size[roomy_by_size]
        self.work = 0
        # Pieces per row: the plan's as CSR, and sets for the rows moves have touched since.
        self._by_row, self._row_start = _by_row(self.row, num_rows)
        self._members: dict[int, set[int]] = {}

    def _set(self, r: int) -> set[int]:
        got = self._members.get(r)
        if got is None:
            got = set(self._by_row[self._row_start[r] : self._row_start[r + 1]].tolist())
            self._members[r] = got
        return got

    def pieces_of(self, r: int) -> np.ndarray:
        """The pieces now in row r, i64[k] ascending (as `np.flatnonzero(row == r)`)."""
        got = self._members.get(r)
        if got is None:
            return self._by_row[self._row_start[r] : self._row_start[r + 1]]
        return np.array(sorted(got), np.int64)

    def _shift(self, p: int, frm: int, to: int) -> None:
        s = int(self.size[p])
        self.row[p] = to
        self.room[frm] += s
        self.count[frm] -= 1
        self.room[to] -= s
        self.count[to] += 1
        self._set(frm).discard(p)
        self._set(to).add(p)

    def move(self, p: int, to: int) -> None:
        frm = int(self.row[p])
        self.log.append((p, frm))
        self._shift(p, frm, to)

    def undo(self, mark: int) -> None:
        while len(self.log) > mark:
            p, frm = self.log.pop()
            self._shift(p, int(self.row[p]), frm)


def _place(st: _State, p: int, victim: int, roomy: np.ndarray, depth: int) -> bool:
    """Places piece p (now in the victim row or displaced) outside the victim; see above."""
    s = int(st.size[p])
    rows = st.row[roomy]
    st.work += 3 * roomy.size
    takes = (st.room >= s) & (st.count < st.S)  # per row, looked up per piece
    takes[victim] = False
    fits = rows[takes[rows]]
    if fits.size:
        best = fits[np.lexsort((fits, st.room[fits]))[0]]  # least room, then lowest row
        st.move(p, int(best))
        return True
    room = st.room[rows]
    if _open_room(st, p, victim, roomy, rows, room):
        return True
    if depth >= _DEPTH:
        return False
    sizes = st.roomy_size
    swap = (sizes < s) & (sizes + room >= s) & (rows != victim) & st.alive[rows]
    if not swap.any():
        return False
    k = np.flatnonzero(swap)
    x = int(roomy[k[np.lexsort((roomy[k], sizes[k]))[0]]])  # the smallest piece, then lowest
    mark = len(st.log)
    to = int(st.row[x])
    st.move(x, victim)  # x waits in the victim row (its room is not looked at)
    st.move(p, to)
    if _place(st, x, victim, roomy, depth + 1):
        return True
    st.undo(mark)
    return False


def _open_room(st: _State, p: int, victim: int, roomy: np.ndarray, rows: np.ndarray,
               room: np.ndarray) -> bool:
    """Makes room for piece p in a row B with a free slot: swaps a piece y of B for a smaller
    piece x of a row A with room >= y - x, so that B gains y - x >= s - room(B); then p goes in.
    Tries the _ROWS roomiest rows B (lowest first on ties), each's _PIECES largest pieces: the
    largest y that can go, for the x that gains least but enough (the first in roomy order)."""
    s = int(st.size[p])
    free = (st.count < st.S) & st.alive & (st.room < s)
    free[victim] = False
    cand = np.flatnonzero(free)
    if not cand.size:
        return False
    n = st.room.size + 1
    key = (st.capacity - st.room[cand]) * n + cand  # most room first, then the lowest row
    if key.size > _ROWS:
        key = np.partition(key, _ROWS - 1)[:_ROWS]
    key.sort()
    sizes = st.roomy_size
    reach = sizes + room  # the largest y that x's row A has room to take for x
    top = int(room.max()) if room.size else 0
    for b in (key % n).tolist():
        need = s - int(st.room[b])
        ys = st.pieces_of(b)
        ys = ys[np.argsort(-st.size[ys], kind="stable")][:_PIECES]
        st.work += st.row.size + ys.size * roomy.size
        if not ys.size:
            continue
        y_sizes = st.size[ys]
        y_min, y_max = int(y_sizes[-1]), int(y_sizes[0])
        # Only x with x <= max(y) - need and x + room(A) >= min(y) can pair with some y: the
        # [y, x] table is built over those, in order of (size, roomy position).
        # (x + room(A) >= min(y) needs x >= min(y) - the most room: a slice of the sizes.)
        lo = int(st.roomy_sorted.searchsorted(y_min - top))
        hi = int(st.roomy_sorted.searchsorted(y_max - need, "right"))
        if lo >= hi:
            continue
        near = st.roomy_by_size[lo:hi]
        a_rows = rows[near]
        near = near[(reach[near] >= y_min) & (a_rows != b) & (a_rows != victim)]
        if not near.size:
            continue
        xs = sizes[near]
        diff = y_sizes[:, None] - xs[None, :]  # [y, x]: what B would gain
        ok = (diff >= need) & (diff <= room[near])
        can = ok.any(axis=1)
        if not can.any():
            continue
        first = int(np.argmax(can))  # the largest y that can go ...
        pos = np.flatnonzero(ok[first])  # ... for the largest x (xs ascending), first of those
        k = int(pos[np.searchsorted(xs[pos], xs[pos[-1]])])
        y, x = int(ys[first]), int(roomy[near[k]])
        a = int(st.row[x])
        st.move(x, b)
        st.move(y, a)
        st.move(p, b)
        return True
    return False


def repair(sizes: np.ndarray, rows: np.ndarray, num_rows: int, capacity: int,
           max_segments: int, *, target: int) -> tuple[np.ndarray, int]:
    """Empties rows of the plan (pieces of `sizes`, i64[P], in rows `rows`, i64[P]) while it has
    more than `target`; returns (row per piece, rows), rows renumbered in their old order."""
    if num_rows <= target or not sizes.size:
        return rows, num_rows
    st = _State(np.asarray(sizes, np.int64), rows, num_rows, capacity, max_segments)
    budget = _BUDGET * int(sizes.size)
    failures = 0
    left = num_rows
    tried = np.zeros(num_rows, bool)
    while left > target and failures < _FAILURES and st.work < budget:
        load = np.where(st.alive & ~tried, capacity - st.room, np.iinfo(np.int64).max)
        victim = int(np.argmin(load))  # the least-filled row, the lowest on ties
        if load[victim] == np.iinfo(np.int64).max:
            break
        tried[victim] = True
        st.work += 2 * num_rows
        roomy = np.flatnonzero(st.room[st.row] > 0)  # pieces whose row has room
        st.roomy_size = st.size[roomy]
        st.roomy_by_size = np.argsort(st.roomy_size, kind="stable")
        st.roomy_sorted = st.roomy_size[st.roomy_by_size]
        mark = len(st.log)
        ok = True
        for p in sorted(st.pieces_of(victim).tolist(), key=lambda q: -st.size[q]):
            if st.row[p] == victim and not _place(st, p, victim, roomy, 0):
                ok = False
                break
        if ok and st.count[victim] == 0:
            st.alive[victim] = False
            left -= 1
            failures = 0
            st.log.clear()
        else:
            st.undo(mark)
            failures += 1
    if left == num_rows:
        return rows, num_rows
    renumber = np.cumsum(st.alive) - 1
    return renumber[st.row], left


def merge_rooms(sizes: np.ndarray, rows: np.ndarray, num_rows: int, capacity: int
                ) -> tuple[np.ndarray, int]:
    """Gathers the room of rows into fewer rows by swaps of one piece for one (module
    docstring); returns (row per piece, swaps made). Same rows, same slot counts per row; every
    swap leaves one row exactly full and no row over capacity.

    Worked example (capacity 10)::

        rows:  A = [5, 4] (room 1)   B = [6, 2] (room 2)
        A needs a piece 1 larger than one of its own: B's 6 for A's 5
        rows:  A = [6, 4] (full)     B = [5, 2] (room 3)
    """
    sizes = np.asarray(sizes, np.int64)
    rows = np.asarray(rows, np.int64).copy()
    room_, _ = _room_count(sizes, rows, num_rows, capacity)
    roomy = np.flatnonzero(room_[rows] > 0)
    roomy_sizes = sizes[roomy]
    hit = np.isin(roomy_sizes + room_[rows[roomy]], roomy_sizes)
    if not hit.any():
        return rows, 0  # no row has a piece whose size plus its room another row holds
    # The pieces of rows with room, by (size, row, piece): a size's candidates in row order, as
    # an ordered dict made on the first look at that size (most sizes are never asked for). A
    # piece is in the index while its row has room (a full row's pieces leave it; rooms only
    # grow, but for the row a swap fills): the dicts drop the others as a look meets them.
    index = roomy[np.lexsort((roomy, rows[roomy], roomy_sizes))]
    index_sizes = sizes[index].tolist()
    index_piece = index.tolist()
    present = set(index_sizes)
    by_size: dict[int, dict[int, None]] = {}
    by_row = roomy[np.argsort(rows[roomy], kind="stable")]  # ... and by (row, piece)
    starts = np.flatnonzero(np.diff(rows[by_row], prepend=-1)).tolist()
    ends = [*starts[1:], by_row.size]
    by_row_list = by_row.tolist()
    live_rows = rows[by_row[starts]].tolist()
    members = {r: by_row_list[i:j] for r, i, j in zip(live_rows, starts, ends)}
    # A row fails while no piece of its size plus its room is left in another row: the
    # candidates only leave, and a row's own only change with its room. Rows without a hit at
    # the start, and rows that failed, are skipped until their room changes.
    skip = set(live_rows) - set(rows[roomy[hit]].tolist())
    row_of = rows.tolist()
    size_of = sizes.tolist()
    room = room_.tolist()
    swaps = 0
    for _ in range(_MERGE_PASSES):
        before = swaps
        # least room first, then the lowest row (members' keys are in row order: a stable sort)
        for A in sorted(members, key=room.__getitem__):
            if A in skip or A not in members:
                continue
            r = room[A]
            for a in members[A]:
                want = size_of[a] + r
                if want not in present:
                    continue
                cand = by_size.get(want)
                if cand is None:
                    k = bisect_left(index_sizes, want)
                    m = bisect_right(index_sizes, want, k)
                    cand = by_size[want] = {q: None for q in index_piece[k:m]
                                            if room[row_of[q]]}
                best, b, seen, full = -1, -1, 0, []
                for q in cand:
                    rq = row_of[q]
                    rm = room[rq]
                    if not rm:
                        full.append(q)  # out of the index
                    elif rq != A:
                        if rm > best:
                            best, b = rm, q
                        seen += 1
                        if seen == _MERGE_CANDIDATES:
                            break
                for q in full:
                    del cand[q]
                if b < 0:
                    continue
                B = row_of[b]
                row_of[a], row_of[b] = B, A
                room[A] = 0
                room[B] += r
                skip.discard(B)
                mine = members[B]
                mine[mine.index(b)] = a
                del members[A]  # A is full: its pieces leave the index
                swaps += 1
                break
            else:
                skip.add(A)
        if swaps == before:
            break
    return np.array(row_of, np.int64), swaps


def share_slots(sizes: np.ndarray, rows: np.ndarray, num_rows: int, capacity: int,
                max_segments: int) -> tuple[np.ndarray, int]:
    """Brings free slots to rows full in slots with room by swaps of one piece for two (module
    docstring); returns (row per piece, swaps made). Same rows; no row over either limit; a
    piece moves at most once. Rows with room are taken roomiest first (`_SHARE_ROWS` of them at
    most); of each, the pairs among its `_PIECES` smallest pieces, each against the
    `_SHARE_CANDIDATES` smallest pieces at least its sum that the room admits (those in a row
    with a free slot, not moved yet); the closest fit wins."""
    sizes = np.asarray(sizes, np.int64)
    rows = np.asarray(rows, np.int64).copy()
    S = max_segments
    room, count = _room_count(sizes, rows, num_rows, capacity)
    full = np.flatnonzero((count == S) & (room > 0))
    if S < 2 or not full.size:
        return rows, 0
    full = full[np.argsort(-room[full], kind="stable")][:_SHARE_ROWS]
    free = np.flatnonzero(count[rows] < S)  # pieces of rows with a free slot, by size
    if not free.size:
        return rows, 0
    free = free[np.argsort(sizes[free], kind="stable")]
    free_sizes = sizes[free]
    by_row, start = _by_row(rows, num_rows)
    moved = np.zeros(sizes.size, bool)
    swaps = 0
    for B in full.tolist():
        mine = by_row[start[B] : start[B + 1]]
        mine = mine[~moved[mine]]
        mine = mine[np.argsort(sizes[mine], kind="stable")][:_PIECES]
        i, j = _PAIRS[mine.size]
        pair = sizes[mine[i]] + sizes[mine[j]]
        half = int(room[B]) // 2
        lo = np.searchsorted(free_sizes, pair)
        hi = np.searchsorted(free_sizes, pair + half, side="right")
        if not (hi > lo).any():
            continue
        # per pair, its first _SHARE_CANDIDATES pieces by size from the smallest at least its sum
        at = lo[:, None] + np.arange(_SHARE_CANDIDATES)
        ok = at < hi[:, None]
        at = np.minimum(at, free.size - 1)
        a_of = free[at]
        ok &= ~moved[a_of] & (count[rows[a_of]] < S)
        if not ok.any():
            continue
        gaps = np.where(ok, free_sizes[at] - pair[:, None], np.iinfo(np.int64).max)
        q, k = np.unravel_index(int(np.argmin(gaps)), gaps.shape)  # the closest fit
        gap, a, b1, b2 = int(gaps[q, k]), int(a_of[q, k]), int(mine[i[q]]), int(mine[j[q]])
        A = int(rows[a])
        rows[a], rows[b1], rows[b2] = B, A, A
        room[A] += gap
        room[B] -= gap
        count[A] += 1
        count[B] -= 1
        moved[[a, b1, b2]] = True
        swaps += 1
    return rows, swaps


def merge_repair(sizes: np.ndarray, rows: np.ndarray, num_rows: int, capacity: int,
                 max_segments: int, *, target: int) -> tuple[np.ndarray, int]:
    """`merge_rooms` and `share_slots`, then `repair`, while the plan is above `target` and
    shrinks (at most `_MERGE_ROUNDS` rounds); returns (row per piece, rows)."""
    for _ in range(_MERGE_ROUNDS):
        if num_rows <= target:
            break
        merged, swaps = merge_rooms(sizes, rows, num_rows, capacity)
        merged, shared = share_slots(sizes, merged, num_rows, capacity, max_segments)
        if not swaps + shared:
            break
        got, n = repair(sizes, merged, num_rows, capacity, max_segments, target=target)
        if n >= num_rows:
            break
        rows, num_rows = got, n
    return rows, num_rows
