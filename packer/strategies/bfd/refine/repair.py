"""Repair: empties the least-filled rows of a plan into the room the other rows have left.

Greedy plans leave a little room in many rows; on a corpus whose pieces are never short that
adds up to whole rows. The repair takes the least-filled row (the victim) and places each of its
pieces, largest first:

* into the row with the least room that fits it and has a free slot, else
* into a row B with a free slot after making room there: a piece y of B swaps with a smaller
  piece x of a row A that has room for y - x (`_open_room`), else
* in place of a smaller piece `x` of a row with room >= size - x (the row only gets fuller, its
  slot count does not change), and places `x` the same way: an ejection chain; pieces get
  strictly smaller along it, so it ends, and it is cut after `_DEPTH` swaps.

If every piece finds a place the row is gone; otherwise every move of that attempt is undone
and the next victim is tried, up to `_FAILURES` failures in a row. Work is bounded (`_BUDGET`
array elements per piece of the plan). Where the room lies in rows too little for any piece, or
in rows full in slots, `merge` gathers it first. `in_groups` runs a step on strided groups of
rows of a large plan.

Worked example (capacity 10, max_segments 3; the plan has 3 rows, the bound is 2)::

    rows:          A = [6, 3]  (room 1)   B = [5, 4]  (room 1)   C = [2]    victim: C
    piece 2:       no row has room 2; no smaller piece to swap it for
    open room:     A (room 1) needs 1 more: its 6 for B's 5 (B has room 1 for the difference)
    rows:          A = [5, 3, 2]  B = [6, 4]                     C is gone: 2 rows
"""

from __future__ import annotations

import numpy as np

from seqpack.packer.strategies.bfd.regime import by_row, room_count

_DEPTH = 8  # swaps along one ejection chain
_FAILURES = 3  # victims that may fail in a row before the pass stops
_BUDGET = 400  # array elements looked at per piece of the plan, in all
_GROUP_ROWS = 8192  # plans of more rows are repaired in strided groups of at most this many
_ROWS, _PIECES = 4, 16  # rows B, and pieces of each, that _open_room tries


class _State:
    """Rows' rooms and counts, each piece's row, and an undo log of moves."""

    def __init__(self, sizes: np.ndarray, rows: np.ndarray, num_rows: int, capacity: int,
                 max_segments: int) -> None:
        self.size = sizes
        self.row = rows.astype(np.int64)
        self.S = max_segments
        self.capacity = capacity
        self.room, self.count = room_count(sizes, self.row, num_rows, capacity)
        self.alive = np.ones(num_rows, bool)
        self.log: list[tuple[int, int]] = []  # (piece, row it left)
        self.roomy_size = sizes[:0]  # sizes of the pieces the current victim's moves look at
        self.roomy_by_size = sizes[:0]  # positions in roomy_size, sizes ascending (stable)
        self.roomy_sorted = sizes[:0]  # roomy_size[roomy_by_size]
        self.work = 0
        # Pieces per row: the plan's as CSR, and sets for the rows moves have touched since.
        self._by_row, self._row_start = by_row(self.row, num_rows)
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
        # least room, then lowest row (one key: a sort of them cost a tenth of the repair)
        best = fits[np.argmin(st.room[fits] * st.room.size + fits)]
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


def in_groups(step, sizes: np.ndarray, rows: np.ndarray, num_rows: int, capacity: int,
              max_segments: int, *, target: int, group_rows: int | None = None
              ) -> tuple[np.ndarray, int]:
    """`step` (`repair` or `merge.merge_repair`) on a plan of more than `group_rows` rows
    (`_GROUP_ROWS`) one group of rows at a time: rows r with r % k == g for k groups of at most
    that many, each group a cross-section of the plan (rows are numbered as the passes opened
    them, big pieces first). Each group is asked for its share of the rows still to go (the
    plan's rows over `target`, less what the groups before removed); the rows come out group
    by group. Smaller plans go to `step` whole.

    A victim costs work in proportion to the plan (it looks at every piece in a row with
    room), so on a whole plan the steps' time grows with the square of its rows; a group costs
    what a plan of its size does."""
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
