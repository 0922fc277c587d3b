"""The room merge: swaps between rows that gather a plan's room where the repair can use it.

The repair empties a victim row into the room the others have left; it fails where that room
lies where no piece of a victim fits. Two cases, and a step for each:

* the room lies in rows with too little of it for any piece (tokens bind): `merge_rooms` swaps
  a piece `a` of a row A with room `r` for a piece of exactly `a + r` from another row B that
  has room: A comes out full, B holds both rooms (rows with the least room go first, into the
  roomiest of the first few candidates). Slot counts do not change.
* the room lies in rows full in slots, the free slots in rows full in tokens: `share_slots`
  swaps a piece `a` of a row with a free slot for two pieces of such a row summing to at most
  `a` (and at least `a` less half that row's room): the row with room gets a free slot.

Then the repair runs again, and all three again while the plan shrinks (`merge_repair`).

Worked example (capacity 10, max_segments 3)::

    merge_rooms:  A = [5, 4] (room 1)   B = [6, 2] (room 2)
                  A needs a piece 1 larger than one of its own: B's 6 for A's 5
                  A = [6, 4] (full)     B = [5, 2] (room 3)
    share_slots:  A = [6, 4] (a free slot, no room)   B = [3, 2, 2] (full in slots, room 3)
                  A's 4 for B's 2 + 2
                  A = [6, 2, 2]         B = [4, 3] (room 3 and a free slot)
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

import numpy as np

from seqpack.packer.strategies.bfd.refine.repair import repair
from seqpack.packer.strategies.bfd.regime import by_row, room_count

_SHARE_PIECES = 16  # the smallest pieces of a row full in slots whose pairs share_slots tries
# the pairs (i < j) of m pieces for m <= _SHARE_PIECES, as share_slots asks for them
# (np.triu_indices builds an m x m mask each call: a quarter of share_slots' time per row)
_PAIRS = [np.triu_indices(m, 1) for m in range(_SHARE_PIECES + 1)]
_MERGE_PASSES = 4  # passes of merge_rooms over the rows with room
_MERGE_CANDIDATES = 8  # rows B (of the first pieces of the size A needs) it picks the roomiest of
_SHARE_CANDIDATES = 32  # pieces share_slots looks at per pair of a row with room
_SHARE_ROWS = 1024  # rows with room (the roomiest) share_slots looks at, at most
_MERGE_ROUNDS = 8  # merges and repairs while the plan shrinks


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
    room_, _ = room_count(sizes, rows, num_rows, capacity)
    roomy = np.flatnonzero(room_[rows] > 0)
    roomy_sizes = sizes[roomy]
    hit = np.isin(roomy_sizes + room_[rows[roomy]], roomy_sizes)
    if not hit.any():
        return rows, 0  # no row has a piece whose size plus its room another row holds
    index = _SizeIndex(sizes, rows, roomy)
    by_row = roomy[np.argsort(rows[roomy], kind="stable")]  # pieces of rows with room by row
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
                b = index.roomiest(size_of[a] + r, A, row_of, room)
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


class _SizeIndex:
    """The pieces of rows with room, by (size, row, piece): a size's candidates in row order, as
    an ordered dict made on the first look at that size (most sizes are never asked for). A
    piece is in the index while its row has room (a full row's pieces leave it; rooms only
    grow, but for the row a swap fills): the dicts drop the others as a look meets them."""

    def __init__(self, sizes: np.ndarray, rows: np.ndarray, roomy: np.ndarray) -> None:
        index = roomy[np.lexsort((roomy, rows[roomy], sizes[roomy]))]
        self.sizes = sizes[index].tolist()
        self.pieces = index.tolist()
        self.present = set(self.sizes)
        self.by_size: dict[int, dict[int, None]] = {}

    def roomiest(self, want: int, A: int, row_of: list[int], room: list[int]) -> int:
        """A piece of size `want` in another row than A that has room: of the first
        `_MERGE_CANDIDATES` such (in row order), the one whose row has the most; or -1."""
        if want not in self.present:
            return -1
        cand = self.by_size.get(want)
        if cand is None:
            k = bisect_left(self.sizes, want)
            m = bisect_right(self.sizes, want, k)
            cand = self.by_size[want] = {q: None for q in self.pieces[k:m] if room[row_of[q]]}
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
        return b


def share_slots(sizes: np.ndarray, rows: np.ndarray, num_rows: int, capacity: int,
                max_segments: int) -> tuple[np.ndarray, int]:
    """Brings free slots to rows full in slots with room by swaps of one piece for two (module
    docstring); returns (row per piece, swaps made). Same rows; no row over either limit; a
    piece moves at most once. Rows with room are taken roomiest first (`_SHARE_ROWS` of them at
    most); of each, the pairs among its `_SHARE_PIECES` smallest pieces, each against the
    `_SHARE_CANDIDATES` smallest pieces at least its sum that the room admits (those in a row
    with a free slot, not moved yet); the closest fit wins."""
    sizes = np.asarray(sizes, np.int64)
    rows = np.asarray(rows, np.int64).copy()
    S = max_segments
    room, count = room_count(sizes, rows, num_rows, capacity)
    full = np.flatnonzero((count == S) & (room > 0))
    if S < 2 or not full.size:
        return rows, 0
    full = full[np.argsort(-room[full], kind="stable")][:_SHARE_ROWS]
    free = np.flatnonzero(count[rows] < S)  # pieces of rows with a free slot, by size
    if not free.size:
        return rows, 0
    free = free[np.argsort(sizes[free], kind="stable")]
    free_sizes = sizes[free]
    of_row, start = by_row(rows, num_rows)
    moved = np.zeros(sizes.size, bool)
    swaps = 0
    for B in full.tolist():
        mine = of_row[start[B] : start[B + 1]]
        mine = mine[~moved[mine]]
        mine = mine[np.argsort(sizes[mine], kind="stable")][:_SHARE_PIECES]
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
