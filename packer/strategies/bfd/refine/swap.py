"""Swap search: empties a row of a small plan by swaps between its pieces and the other rows.

The last step where everything before it left a small plan above the target: a few thousand
pieces, about three a row, whose bound leaves a few tokens of room a row. There no greedy
placement gets the last rows: every row must come out within a few tokens of full, and the room
left is spread over hundreds of rows.

A victim row (the least filled) is emptied into a set U of loose pieces, and the search moves
pieces until U is empty, one move an iteration:

* **into a row:** up to two pieces of U for up to two of a row's (none, one or two), where
  they fit (room and slots), taking the most tokens out of U (ties: the row comes out exactly
  full, then a seeded draw). A piece that leaves a row for U may not go back into that row for
  `_TABU` iterations (else the search swaps the same pieces back and forth);
* **between rows,** where no piece of U can go in: a piece of one row for a larger one of
  another that has the room for the difference, the swap that most increases the sum of the
  squared rooms: the room gathers where U's pieces will fit.

Swaps of two rows' rooms (gain 0) are taken too, at random among the best, so the search walks
along a plateau instead of stopping at the first local optimum. It stops at the target, or when
a victim is not emptied within `_ITERS` iterations (its moves are undone). It runs only on plans
of at most `_MAX_ROWS` rows and `_PER_ROW` pieces a row where the slots bind little
(`_SLOT_SHARE`: where rows are full in slots a swap must bring as many pieces as it takes), and
stops after `_BUDGET` candidate moves per piece.

Worked example (capacity 10, max_segments 8; the victim V = [2])::

    rows:      A = [5, 4] (room 1)   B = [6, 3] (room 1)   U = [2]: fits no row
    between:   B's 6 for A's 5 (A has room for the 1 more): A = [6, 4], B = [5, 3] (room 2)
    into:      U's 2 into B: B = [5, 3, 2]; U is empty, 2 rows
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from seqpack.packer.bounds import slot_share
from seqpack.packer.strategies.bfd.regime import room_count

_ITERS = 400  # iterations a victim may take
_BUDGET = 12_000  # candidate moves looked at per piece of the plan, in all
_TABU = 10  # iterations a piece may not go back into the row it left
_MAX_ROWS = 1024  # plans of at most this many rows ...
_PER_ROW = 6  # ... and at most this many pieces a row on average ...
_SLOT_SHARE = 0.75  # ... whose slot bound is under this share of the token bound


def _subsets(items: list[int]) -> list[tuple[int, ...]]:
    """The subsets of `items` with at most two members (the empty one first)."""
    out: list[tuple[int, ...]] = [()]
    for a in range(len(items)):
        out.append((items[a],))
        out.extend((items[a], items[b]) for b in range(a + 1, len(items)))
    return out


class _Outs(NamedTuple):
    sets: list[tuple[int, ...]]
    sums: np.ndarray
    left: np.ndarray


class _Search:
    def __init__(self, sizes: np.ndarray, rows: np.ndarray, num_rows: int, capacity: int,
                 max_segments: int, seed: int) -> None:
        self.size = sizes
        self.sz = sizes.tolist()
        self.L, self.S = capacity, max_segments
        self.owner = rows.astype(np.int64).copy()  # row per piece, -1 for U
        self.members: list[list[int]] = [[] for _ in range(num_rows)]
        for p, r in enumerate(self.owner.tolist()):
            self.members[r].append(p)
        self.room = room_count(sizes, self.owner, num_rows, capacity)[0]
        self.alive = np.ones(num_rows, bool)
        self.by_size = np.argsort(self.size, kind="stable")  # pieces, smallest first
        self.rng = np.random.default_rng(seed)
        self.work = 0  # candidate moves looked at
        self.outs: dict[int, _Outs] = {}  # each row's subsets, kept until its pieces change

    def _outs(self, r: int) -> _Outs:
        """Row r's subsets of at most two pieces (`_subsets` of its members, in their order),
        their tokens and the pieces each leaves in the row."""
        got = self.outs.get(r)
        if got is None:
            m, sz = self.members[r], self.sz
            subs = _subsets(m)
            got = _Outs(subs, np.array([sum(sz[p] for p in sub) for sub in subs], np.int64),
                        np.array([len(m) - len(sub) for sub in subs], np.int64))
            self.outs[r] = got
        return got

    def _into_row(self, loose: list[int], tabu: dict[tuple[int, int], int], it: int) -> bool:
        """The best move of up to two pieces of U into a row (module docstring)."""
        sz, S = self.sz, self.S
        alive = np.flatnonzero(self.alive)
        outs = [self._outs(r) for r in alive.tolist()]
        counts = np.array([len(o.sets) for o in outs], np.int64)
        ins = _subsets(loose)[1:]
        in_sum = np.array([sum(sz[p] for p in sub) for sub in ins], np.int64)
        in_len = np.array([len(sub) for sub in ins], np.int64)
        rs_a = np.repeat(alive, counts)
        self.work += rs_a.size * len(ins)
        gain = in_sum[None, :] - np.concatenate([o.sums for o in outs])[:, None]
        room = self.room[rs_a][:, None]
        left = np.concatenate([o.left for o in outs])
        ok = (gain > 0) & (gain <= room) & (left[:, None] + in_len[None, :] <= S)
        for key in [key for key, until in tabu.items() if until <= it]:
            del tabu[key]
        for k, sub in enumerate(ins):  # a piece may not go back into a row it just left
            bad = [r for (p, r) in tabu if p in sub]
            if bad:
                ok[np.isin(rs_a, bad), k] = False
        if not ok.any():
            return False
        score = np.where(ok, gain * 4.0 + 2.0 * (gain == room) + self.rng.random(gain.shape),
                         -np.inf)
        a, k = divmod(int(np.argmax(score)), len(ins))
        r = int(rs_a[a])
        at = int(np.searchsorted(alive, r))
        for p in outs[at].sets[a - int(counts[:at].sum())]:
            self._move(p, -1)
            loose.append(p)
            tabu[(p, r)] = it + _TABU
        for p in ins[k]:
            loose.remove(p)
            self._move(p, r)
        return True

    def _between_rows(self) -> bool:
        """The swap between two rows that most gathers room (module docstring): a piece b of
        row B for a larger piece a of row A, where B has room for the difference d; A's room
        grows by d and B's shrinks by d, which adds 2 d (room A - room B + d) to the sum of
        the squared rooms. Pieces a are looked up by size, in the window (b, b + room B]."""
        owner = self.owner
        order = self.by_size[owner[self.by_size] >= 0]  # the placed pieces, smallest first
        by_size = self.size[order]
        row = owner[order]
        room = self.room[row]
        lo = np.searchsorted(by_size, by_size, side="right")
        hi = np.searchsorted(by_size, by_size + room, side="right")
        count = hi - lo
        total = int(count.sum())
        self.work += order.size + total
        if not total:
            return False
        a_pos = np.arange(total) + np.repeat(lo - (np.cumsum(count) - count), count)
        A = row[a_pos]
        B = np.repeat(row, count)
        d = by_size[a_pos] - np.repeat(by_size, count)
        gain = np.where(A != B, 2 * d * (room[a_pos] - np.repeat(room, count) + d), -1)
        gain = gain + self.rng.random(gain.size)  # ties, and swaps of two rows' rooms (gain 0)
        q = int(np.argmax(gain))
        if not gain[q] >= 0:
            return False
        b_at = int(np.searchsorted(np.cumsum(count), q, side="right"))
        pa, pb, ra, rb_ = int(order[a_pos[q]]), int(order[b_at]), int(A[q]), int(B[q])
        self._move(pa, rb_)
        self._move(pb, ra)
        return True

    def _move(self, p: int, to: int) -> None:
        frm = int(self.owner[p])
        s = int(self.size[p])
        self.outs.pop(frm, None)
        self.outs.pop(to, None)
        if frm >= 0:
            self.members[frm].remove(p)
            self.room[frm] += s
        if to >= 0:
            self.members[to].append(p)
            self.room[to] -= s
        self.owner[p] = to

    def empty_one(self, budget: int) -> bool:
        """Empties the least-filled row; undoes everything if it cannot within `_ITERS`
        iterations or before `work` reaches `budget`."""
        live = np.flatnonzero(self.alive)
        victim = int(live[np.argmin(self.L - self.room[live])])  # the lowest row on ties
        saved = (self.owner.copy(), [list(m) for m in self.members], self.room.copy())
        loose = list(self.members[victim])
        for p in loose:
            self._move(p, -1)
        self.alive[victim] = False
        tabu: dict[tuple[int, int], int] = {}
        for it in range(_ITERS):
            if not loose:
                return True
            if self.work >= budget:
                break
            if not self._into_row(loose, tabu, it) and not self._between_rows():
                break
        if not loose:
            return True
        self.owner, self.members, self.room = saved
        self.outs.clear()
        self.alive[victim] = True
        return False


def swap_search(sizes: np.ndarray, rows: np.ndarray, num_rows: int, capacity: int,
                max_segments: int, *, target: int, seed: int = 0) -> tuple[np.ndarray, int]:
    """Empties rows of the plan (pieces `sizes`, i64[P], in rows `rows`) by swaps (module
    docstring) while it has more than `target` and is small enough; returns (row per piece,
    rows), rows renumbered in their old order."""
    if num_rows <= target or num_rows > _MAX_ROWS or sizes.size > _PER_ROW * num_rows or \
            slot_share(int(sizes.size), int(np.sum(sizes)), capacity, max_segments) >= _SLOT_SHARE:
        return rows, num_rows
    st = _Search(np.asarray(sizes, np.int64), np.asarray(rows), num_rows, capacity,
                 max_segments, seed)
    left = num_rows
    budget = _BUDGET * int(sizes.size)
    while left > target and st.empty_one(budget):
        left -= 1
    if left == num_rows:
        return rows, num_rows
    renumber = np.cumsum(st.alive) - 1
    return renumber[st.owner], left
