"""Best fit decreasing in two dimensions (tokens and slots): the slot-aware pass.

A row has two limits, `capacity` tokens and `max_segments` slots. Plain best fit decreasing
packs the big pieces tightly and leaves the shortest ones for last, when the rows have room but
no slots. Here every row is judged against `a`, the mean size of the pieces still to come:

* slot-short: room > free slots * a (the pieces to come would leave it under-filled), and
* token-short: the rest.

Pieces come largest first; each goes by best fit into a slot-short row if one fits it (big
pieces go where slots are scarce), else by best fit into any row, else into a new row. The rows
the tight lower bound says are needed are open from the start, empty: while empty rows count as
slot-short (L > S * a) they take pieces before token-short rows do, which deals the short tail
out over every row instead of piling it into the last ones. (Online, where `a` also counts
pieces of windows to come, a piece below `a` prefers token-short rows instead.)

Pieces of equal size come in runs, placed without a search per piece: short runs row by row
over sorted lists (the pools, `sorted_keys`, and a heap of the mean `room / free` at which a
token-short row turns slot-short as `a` falls), long runs through numpy over one sorted array of
the open rows (`_ArrayRows`). Both place exactly the same rows.

Worked example (capacity 10, max_segments 4; bound 3 rows, open from the start)::

    sizes (input order):    3    7    5    5    2    8
    sorted (largest first): 8    7    5    5    3    2
    a (mean after the run): 4.4  3.75 2.5  2.5  2    2
    rows:                   0    1    2    2    1    0
    row 0 = [8, 2], row 1 = [7, 3], row 2 = [5, 5]; no row is ever slot-short (room 2 with 3
    free slots, room 3 with 3: never more than free * a)
"""

from __future__ import annotations

import math
from heapq import heapify, heappop, heappush

import numpy as np

from seqpack.packer.strategies.bfd.sorted_keys import BlockKeys, FlatKeys, Keys, keys_for

_SHIFT = 40  # keys `room << _SHIFT | row` (rooms below 2**23, rows below 2**40)
_MASK = (1 << _SHIFT) - 1
# A run of at least _LONG_RUN pieces, with at least one per _SPREAD open rows, goes to numpy;
# back to lists below _SHORT_RUN pieces or one per 4 * _SPREAD open rows.
_LONG_RUN, _SHORT_RUN, _SPREAD = 64, 16, 8


def _limit(room: int, free: int, s: int, a: float) -> int:
    """How many pieces of size s a row of its preferred pool takes before it leaves it: a
    slot-short row (room > free * a) for s > a, a token-short one for s < a."""
    if s == a:
        return free
    if s > a:
        return max(1, math.ceil((room - free * a) / (s - a)))
    return max(1, math.floor((free * a - room) / (a - s)) + 1)


class _Rows:
    """Rows as lists: rooms, counts, the two pools (sorted keys) and the pool-change heap."""

    def __init__(self, capacity: int, max_segments: int, min_size: int, empty: int,
                 pool: type[FlatKeys] | type[BlockKeys] | None = None) -> None:
        self.L, self.S, self.min_size = capacity, max_segments, min_size
        self.room: list[int] = []
        self.count: list[int] = []
        self.version: list[int] = []
        self.pool = keys_for(empty) if pool is None else pool  # flat, or in blocks
        self.slot: Keys = self.pool()  # keys of slot-short rows
        self.token: Keys = self.pool()  # keys of token-short rows
        self.heap: list[tuple[float, int, int]] = []  # (-room / free, version, row)
        self.empty = empty  # rows open from the start and still empty

    @property
    def num_rows(self) -> int:
        return len(self.room)

    def refile(self, rows: list[int] | tuple[int, ...], a: float) -> None:
        """Puts each of `rows` (in no pool) into the pool its room and free slots give at mean
        a (`_fill` does the same for the rows it fills)."""
        room_, count, version, S, min_size = self.room, self.count, self.version, self.S, \
            self.min_size
        heap = self.heap
        to_slot, to_token = [], []
        for r in rows:
            room, free = room_[r], S - count[r]
            v = version[r] + 1  # every earlier heap entry of the row is stale from here on
            version[r] = v
            if room < min_size or free == 0:
                continue  # closed
            if room > free * a:
                to_slot.append((room << _SHIFT) | r)
            else:
                to_token.append((room << _SHIFT) | r)
                if room > free * min_size:  # else no mean to come turns it slot-short
                    heappush(heap, (-room / free, v, r))
        self.slot.add_many(to_slot)
        self.token.add_many(to_token)

    def file_block(self, first: int, num: int, a: float) -> None:
        """`refile` for rows first .. first + num - 1, new rows all in the same state."""
        room, free = self.room[first], self.S - self.count[first]
        if room < self.min_size or free == 0:
            return  # closed
        keys = [(room << _SHIFT) | r for r in range(first, first + num)]
        slot = room > free * a
        target = self.slot if slot else self.token
        target.add_run(keys)  # the highest row numbers: one block of equal rooms
        if not slot and room > free * self.min_size:
            heap, version, q = self.heap, self.version, -room / free
            for r in range(first, first + num):
                version[r] += 1
                heappush(heap, (q, version[r], r))

    def migrate(self, a: float) -> None:
        """Moves the token-short rows that a (falling) mean has made slot-short (callers check
        the heap's top first: `-heap[0][0] > a`)."""
        heap, version, room, count, S = self.heap, self.version, self.room, self.count, self.S
        moved = []
        while heap and -heap[0][0] > a:
            _, v, r = heap[0]
            if version[r] != v:
                heappop(heap)  # stale: the row took pieces (or changed pool) since
                continue
            rm = room[r]
            if not rm > (S - count[r]) * a:
                break  # the quotient rounded up: the exact test decides (as in _ArrayRows)
            heappop(heap)
            moved.append((rm << _SHIFT) | r)
            version[r] = v + 1
        self.token.remove_many(moved)
        self.slot.add_many(moved)

    def _fill(self, keys: Keys, out: np.ndarray, s: int, i: int, j: int, a: float,
              keep_pool: bool) -> int:
        """Best fit of out[i:j] (size s) into the rows of `keys` in order of room, each taking
        what fits (and, with `keep_pool`, what keeps it in its pool at mean a), then filed
        again at mean a (`refile`, in the same loop); returns the next i."""
        at = keys.find(s << _SHIFT)
        if i >= j or at is None:
            return i
        S, count, room, version, min_size = self.S, self.count, self.room, self.version, \
            self.min_size
        heap = self.heap
        touched: list[int] = []
        takes: list[int] = []  # out[] is written once at the end (a slice per piece costs)
        to_slot: list[int] = []
        to_token: list[int] = []
        i0 = i
        big, small = keep_pool and s > a, keep_pool and s < a
        for key in keys.iter_from(at):
            r = key & _MASK
            rm = key >> _SHIFT  # a pooled row's key holds its room
            free = S - count[r]
            take = rm // s  # min(rm // s, free, j - i, the pool's limit (at least 1))
            if take > free:
                take = free
            if take > j - i:
                take = j - i
            if big:
                lim = math.ceil((rm - free * a) / (s - a))
                if lim < take:
                    take = lim if lim > 1 else 1
            elif small:
                lim = math.floor((free * a - rm) / (a - s)) + 1
                if lim < take:
                    take = lim if lim > 1 else 1
            i += take
            count[r] += take
            rm -= take * s
            room[r] = rm
            free -= take
            touched.append(r)
            takes.append(take)
            v = version[r] + 1  # as in `refile`
            version[r] = v
            if rm >= min_size and free:
                if rm > free * a:
                    to_slot.append((rm << _SHIFT) | r)
                else:
                    to_token.append((rm << _SHIFT) | r)
                    if rm > free * min_size:
                        heappush(heap, (-rm / free, v, r))
            if i >= j:
                break
        out[i0:i] = touched if i - i0 == len(touched) else np.repeat(touched, takes)
        keys.delete_from(at, len(touched))
        self.slot.add_many(to_slot)
        self.token.add_many(to_token)
        return i

    def place(self, out: np.ndarray, s: int, i: int, j: int, a: float) -> None:
        """Places the run out[i:j] of pieces of size s (see the module docstring): pieces of at
        least the mean prefer slot-short rows, smaller ones token-short rows."""
        if j - i == 1:
            self.place_one(out, s, i, a)
            return
        heap = self.heap
        if heap and -heap[0][0] > a:
            self.migrate(a)
        big = s >= a
        first, second = (self.slot, self.token) if big else (self.token, self.slot)
        i = self._fill(first, out, s, i, j, a, True)
        if i < j and self.empty and (self.L > self.S * a) == big:  # empty rows preferred
            per_row = min(self.L // s, self.S, _limit(self.L, self.S, s, a))
            i = self.open_rows(out, s, i, j, a, per_row, cap=self.empty)
        if i < j:
            i = self._fill(second, out, s, i, j, a, False)
        if i < j:
            self.open_rows(out, s, i, j, a, min(self.L // s, self.S), cap=None)

    def place_one(self, out: np.ndarray, s: int, i: int, a: float) -> None:
        """`place` for a run of one piece (most runs where sizes hardly repeat): the first row
        of the preferred pool that fits, else an empty row if those come first, else the other
        pool, else a new row; the same rows `place` gives, without its per-run lists (the row
        filed inline, as `refile` or, for a new row, `open_rows` would)."""
        heap = self.heap
        if heap and -heap[0][0] > a:
            self.migrate(a)
        big = s >= a
        first, second = (self.slot, self.token) if big else (self.token, self.slot)
        key = first.pop_ge(s << _SHIFT)
        if key is None and not (self.empty and (self.L > self.S * a) == big):
            key = second.pop_ge(s << _SHIFT)
        if key is None:  # a new row (an empty one open from the start, or one more)
            r = len(self.room)
            out[i] = r
            room, free = self.L - s, self.S - 1
            self.room.append(room)
            self.count.append(1)
            self.version.append(1)  # (`open_rows` and `file_block`, for one row)
            if self.empty:
                self.empty -= 1
            v = 1
        else:
            r = key & _MASK
            out[i] = r
            count = self.count
            free = self.S - count[r] - 1
            count[r] += 1
            room = (key >> _SHIFT) - s  # a pooled row's key holds its room
            self.room[r] = room
            version = self.version
            v = version[r] + 1  # as in `refile`
            version[r] = v
        if room < self.min_size or free == 0:
            return  # closed
        if room > free * a:
            self.slot.add((room << _SHIFT) | r)
        else:
            self.token.add((room << _SHIFT) | r)
            if room > free * self.min_size:
                heappush(heap, (-room / free, v, r))

    def open_rows(self, out: np.ndarray, s: int, i: int, j: int, a: float, per_row: int, *,
                  cap: int | None) -> int:
        """Opens rows for out[i:j], `per_row` pieces each (the last takes the rest), at most
        `cap` rows (None: as many as needed); returns the next i."""
        full, rest = divmod(j - i, per_row)
        if cap is not None and full >= cap:
            full, rest = cap, 0
        first = len(self.room)
        if full:
            out[i : i + full * per_row] = first + np.arange(full * per_row) // per_row
            i += full * per_row
            self.room.extend([self.L - per_row * s] * full)
            self.count.extend([per_row] * full)
            self.version.extend([0] * full)
        if rest:
            out[i : i + rest] = first + full
            i += rest
            self.room.append(self.L - rest * s)
            self.count.append(rest)
            self.version.append(0)
        self.empty = max(0, self.empty - full - (1 if rest else 0))
        if full:
            self.file_block(first, full, a)
        if rest:
            self.refile((first + full,), a)
        return i


class _ArrayRows:
    """Rows as numpy arrays, every open row in one array of sorted keys (pools by test)."""

    def __init__(self, lists: _Rows) -> None:
        self.L, self.S, self.min_size, self.empty = lists.L, lists.S, lists.min_size, lists.empty
        self.num_rows = lists.num_rows
        size = max(16, 2 * self.num_rows)
        self.room = np.zeros(size, np.int64)
        self.count = np.zeros(size, np.int64)
        self.room[: self.num_rows] = lists.room
        self.count[: self.num_rows] = lists.count
        self.keys = np.sort(np.array(lists.slot.tolist() + lists.token.tolist(), np.int64))
        self.pool = lists.pool  # the pools' class when the rows go back to lists

    def lists(self, a: float) -> _Rows:
        """The same rows as `_Rows`, pools filed at mean a."""
        rows = _Rows(self.L, self.S, self.min_size, self.empty, self.pool)
        R = self.num_rows
        rows.room, rows.count = self.room[:R].tolist(), self.count[:R].tolist()
        r = self.keys & _MASK
        room, free = self.room[r], self.S - self.count[r]
        slot = room > free * a
        rows.slot = self.pool(self.keys[slot].tolist())
        rows.token = self.pool(self.keys[~slot].tolist())
        rows.version = [0] * R
        live = ~slot & (room > free * self.min_size)
        rows.heap = list(zip((-(room[live] / free[live])).tolist(), [0] * int(live.sum()),
                             r[live].tolist()))
        heapify(rows.heap)
        return rows

    def _grow(self, need: int) -> None:
        if need > self.room.size:
            size = max(need, 2 * self.room.size)
            self.room = np.concatenate([self.room, np.zeros(size - self.room.size, np.int64)])
            self.count = np.concatenate([self.count, np.zeros(size - self.count.size, np.int64)])

    def place(self, out: np.ndarray, s: int, i: int, j: int, a: float) -> None:
        """`_Rows.place`, with numpy."""
        keys, room, count, S = self.keys, self.room, self.count, self.S
        p = int(np.searchsorted(keys, s << _SHIFT))
        cand = keys[p:]
        r = cand & _MASK
        rm, free = room[r], S - count[r]
        slot = rm > free * a
        take = np.minimum(rm // s, free)
        big = s >= a
        if s > a:
            lim = np.maximum(1, np.ceil((rm - free * a) / (s - a))).astype(np.int64)
            take1 = np.where(slot, np.minimum(take, lim), 0)
        elif s < a:
            lim = np.maximum(1, np.floor((free * a - rm) / (a - s)) + 1).astype(np.int64)
            take1 = np.where(slot, 0, np.minimum(take, lim))
        else:
            take1 = np.where(slot, take, 0)
        i, used1 = _deal(out, r, take1, i, j)
        room[r] -= used1 * s
        count[r] += used1
        gone = used1 > 0
        touched = r[gone]
        first = self.num_rows
        if i < j and self.empty and (self.L > S * a) == big:
            per_row = min(self.L // s, S, _limit(self.L, S, s, a))
            i = self._open(out, s, i, j, per_row, cap=self.empty)
            room, count = self.room, self.count
            touched = np.concatenate([touched, np.arange(first, self.num_rows)])
        if i < j:  # best fit over every row that fits: untouched ones and the touched ones
            fit = touched[(room[touched] >= s) & (count[touched] < S)]
            order2 = np.sort(np.concatenate([cand[~gone], (room[fit] << _SHIFT) | fit]))
            r2 = order2 & _MASK
            take2 = np.minimum(room[r2] // s, S - count[r2])
            i, used2 = _deal(out, r2, take2, i, j)
            room[r2] -= used2 * s
            count[r2] += used2
            mark = np.zeros(self.num_rows, bool)  # (np.isin and np.union1d cost far more)
            mark[r2[used2 > 0]] = True
            gone |= mark[r]
            mark[touched] = True
            touched = np.flatnonzero(mark)
        if i < j:
            start = self.num_rows
            i = self._open(out, s, i, j, min(self.L // s, S), cap=None)
            room, count = self.room, self.count
            touched = np.concatenate([touched, np.arange(start, self.num_rows)])
        keep = touched[(room[touched] >= self.min_size) & (count[touched] < S)]
        self.keys = np.sort(np.concatenate([keys[:p], cand[~gone],
                                            (room[keep] << _SHIFT) | keep]), kind="stable")

    def _open(self, out: np.ndarray, s: int, i: int, j: int, per_row: int, *,
              cap: int | None) -> int:
        full, rest = divmod(j - i, per_row)
        if cap is not None and full >= cap:
            full, rest = cap, 0
        first = self.num_rows
        num = full + (1 if rest else 0)
        self._grow(first + num)
        out[i : i + full * per_row] = first + np.arange(full * per_row) // per_row
        self.room[first : first + full] = self.L - per_row * s
        self.count[first : first + full] = per_row
        if rest:
            out[i + full * per_row : j] = first + full
            self.room[first + full] = self.L - rest * s
            self.count[first + full] = rest
        self.num_rows += num
        self.empty = max(0, self.empty - num)
        return i + full * per_row + rest


def _deal(out: np.ndarray, rows: np.ndarray, take: np.ndarray, i: int, j: int
          ) -> tuple[int, np.ndarray]:
    """Gives rows[0], rows[1], ... up to take[k] of the pieces out[i:j] each, in order; returns
    (next i, pieces each row got)."""
    cs = np.cumsum(take)
    want = j - i
    got = int(cs[-1]) if cs.size else 0
    if got <= want:
        used = take
    else:
        m = int(np.searchsorted(cs, want))  # row m gets the last pieces
        used = take.copy()
        used[m] = want - (int(cs[m - 1]) if m else 0)
        used[m + 1 :] = 0
        got = want
    out[i : i + got] = np.repeat(rows, used)
    return i + got, used


def two_pool_sorted(sizes_desc: np.ndarray, capacity: int, max_segments: int, num_rows: int
                     ) -> tuple[np.ndarray, int]:
    """Places sizes sorted largest first (see the module docstring) with `num_rows` rows open
    from the start; returns (row per piece, rows used). Rows are numbered as they first fill."""
    n = int(sizes_desc.size)
    out = np.empty(n, np.int32 if n < 2**31 else np.int64)  # rows <= pieces
    if n == 0:
        return out, 0
    cut = np.flatnonzero(sizes_desc[1:] != sizes_desc[:-1]) + 1
    starts, ends = [0, *cut.tolist()], [*cut.tolist(), n]
    tail = np.cumsum(sizes_desc[::-1])[::-1]  # tail[i] = sum of sizes_desc[i:]
    sizes = sizes_desc[starts]
    after = np.array(ends[:-1], np.int64)
    # a: the mean of the pieces after each run (after the last: its size)
    means = [*(tail[after] / (n - after)).tolist(), float(sizes[-1])]
    rows: _Rows | _ArrayRows = _Rows(capacity, max_segments, int(sizes_desc[-1]), num_rows)
    for s, i, j, a in zip(sizes.tolist(), starts, ends, means):
        k = j - i
        if isinstance(rows, _Rows):
            if k == 1:
                rows.place_one(out, s, i, a)
                continue
            if k >= _LONG_RUN and _SPREAD * k >= len(rows.slot) + len(rows.token):
                rows = _ArrayRows(rows)
        elif k < _SHORT_RUN or 4 * _SPREAD * k < rows.keys.size:
            rows = rows.lists(a)
        rows.place(out, s, i, j, a)
    return out, rows.num_rows


