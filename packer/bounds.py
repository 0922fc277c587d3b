"""Lower bounds on the number of rows any packing needs (tokens and segment slots both count).

A row holds at most `L = capacity` tokens in at most `S = max_segments` pieces, so no packing of
pieces with sizes `s` needs fewer than

    simple bound   max(ceil(sum(s) / L), ceil(len(s) / S))

rows. It is loose where the sizes interact with the two limits: pieces longer than L/2 never
share a row with each other, and a piece close to L leaves room only for the smallest pieces,
whose slots then go unused. `tight_lower_bound` adds, for every threshold `a <= L/2` (Martello
and Toth's L2 bound, extended with slots):

    J1 = pieces > L - a       each its own row; room left for pieces < a only
    J2 = pieces in (L/2, L-a] each its own row
    J3 = pieces in [a, L/2]   fit only into J2 rows' room or other rows
    tokens: |J1| + |J2| + ceil(max(0, sum(J3) - (|J2| L - sum(J2))) / L)
    slots:  |J1| + max(|J2|, ceil((|J2| + |J3| + max(0, n_small - A)) / S))

where `n_small` counts the pieces < a and `A` bounds how many of them the J1 rows can take: a J1
row with room `c` holds at most `min(S - 1, k(c))` of them, `k(c)` being how many of the smallest
pieces sum to at most `c`.

It is not the optimum's: where few slots meet long pieces it misses that mid-size pieces pair
but do not come in threes (lognormal lengths of mean 935 at L=2048 / S=3: 12,520 rows, where
the configuration LP of `benchmarks/lp_bound.py` proves 12,562; the plan 12,572). That LP is a
benchmark tool (column generation over scipy's HiGHS), too slow for a planner's target.

Worked example (L 10, S 2; sizes 10 10 10 1 1 1 1)::

    simple bound:  max(ceil(34 / 10), ceil(7 / 2)) = 4
    a = 1:         J1 = {10, 10, 10} (no room at all), J3 = {1, 1, 1, 1}: 3 + ceil(4 / 2) = 5
"""

from __future__ import annotations

import numpy as np

from seqpack.packer.inputs import check_count


def lower_bound(total_tokens: int, num_segments: int, seq_len: int, max_segments: int) -> int:
    """No packing needs fewer rows: max(ceil(tokens / L), ceil(segments / S))."""
    seq_len = check_count("seq_len", seq_len, 1)
    max_segments = check_count("max_segments", max_segments, 1)
    return max(-(-total_tokens // seq_len), -(-num_segments // max_segments))


SLOTS_BIND_ALL = 0.9  # from this slot share on the slots bind for the whole corpus
SLOTS_BIND_HALF = 0.5  # from this one on a stream's window is repaired (`sizes_slot_share`)


def slot_share(num_pieces: int, tokens: int, capacity: int, max_segments: int) -> float:
    """The slot bound `ceil(n / S)` over the token bound `ceil(T / L)`: how much the segment
    cap binds (the strategies' thresholds: `sizes_slot_share`)."""
    return -(-num_pieces // max_segments) / max(1, -(-tokens // capacity))


def sizes_slot_share(sizes: np.ndarray, capacity: int, max_segments: int) -> float:
    """`slot_share` of pieces of these sizes. From `SLOTS_BIND_ALL` on the slots bind for the
    whole corpus (the offline default's worst fit runs, and the repair alone improves its plan);
    from `SLOTS_BIND_HALF` on a stream's window is repaired (its rows come out short in one
    limit or the other, and the repair gathers them) and keeps its rows short in slots open
    (`online.stream`)."""
    return slot_share(int(sizes.size), int(sizes.sum()), capacity, max_segments)


def slots_can_bind(sizes_asc: np.ndarray, capacity: int, max_segments: int) -> bool:
    """Whether a row can run out of slots before tokens: its `max_segments` + 1 smallest
    pieces (`sizes_asc`, i64[n] ascending) fit in `capacity`. If not, the plan is a
    one-dimensional one (the offline default runs plain BFD, the exact fill and the repair)."""
    k = max_segments + 1
    return sizes_asc.size >= k and int(sizes_asc[:k].sum()) <= capacity


def tight_lower_bound(sizes: object, capacity: int, max_segments: int) -> int:
    """The bound of the module docstring for pieces of these sizes (each in [1, capacity]).

    Vectorised over the thresholds: O(n log n) for n pieces, a few arrays of n.
    """
    capacity = check_count("capacity", capacity, 1)
    max_segments = check_count("max_segments", max_segments, 1)
    s = np.sort(np.asarray(sizes, np.int64))  # ascending
    if s.size and (s[0] < 1 or s[-1] > capacity):
        raise ValueError(f"sizes must lie in [1, {capacity}], got [{int(s[0])}, {int(s[-1])}]")
    return sorted_lower_bound(s, capacity, max_segments)


def sorted_lower_bound(s: np.ndarray, capacity: int, max_segments: int) -> int:
    """`tight_lower_bound` of sizes already sorted ascending (i64[n], each in [1, capacity]);
    O(n): the strategies sort once and pass a view."""
    n = int(s.size)
    if n == 0:
        return 0
    L, S = int(capacity), int(max_segments)
    cs = np.zeros(n + 1, np.int64)
    np.cumsum(s, out=cs[1:])
    best = lower_bound(int(cs[-1]), n, L, S)
    half = s[: int(np.searchsorted(s, L // 2, side="right"))]
    distinct = half[np.concatenate([[True], half[1:] != half[:-1]])] if half.size else half
    alphas = np.concatenate([[0], distinct])  # 0 and every size <= L/2, ascending, distinct
    n_small = np.searchsorted(s, alphas, side="left")  # pieces < a
    i_half = int(np.searchsorted(s, L // 2, side="right"))  # pieces <= L/2
    i_j2 = np.searchsorted(s, L - alphas, side="right")  # pieces <= L - a
    n_j1 = n - i_j2
    n_j2 = i_j2 - i_half
    n_j3 = i_half - n_small
    t_j3 = cs[i_half] - cs[n_small]
    t_j2 = cs[i_j2] - cs[i_half]
    tokens = n_j1 + n_j2 + np.maximum(0, -(-(t_j3 - (n_j2 * L - t_j2)) // L))
    # A J1 row (pieces in descending order: a prefix) takes at most min(S - 1, k(room)) of the
    # smallest pieces; summed over the prefix and capped by how many small pieces there are.
    # Only the prefix that is J1 for some a is looked at (pieces > L - max a).
    desc = s[::-1][: int(n_j1.max())]
    k = np.searchsorted(cs, L - desc, side="right") - 1
    g = np.zeros(desc.size + 1, np.int64)
    np.cumsum(np.minimum(S - 1, k), out=g[1:])
    absorbed = np.minimum(n_small, g[n_j1])
    slots = n_j1 + np.maximum(n_j2, -(-(n_j2 + n_j3 + np.maximum(0, n_small - absorbed)) // S))
    return max(best, int(tokens.max()), int(slots.max()))


DFF_KS = 32  # the dual feasible functions u_k of `dff_lower_bound`: k = 1 .. this


def dff_lower_bound(sizes_asc: np.ndarray, capacity: int, ks: int = DFF_KS) -> int:
    """Rows no packing of pieces of these sizes (i64[n] ascending, each in [1, capacity])
    goes below, by Fekete and Schepers' dual feasible functions (tokens alone; the slots only
    add rows): for every k >= 1 a row's pieces sum to at most 1 under

        u_k(x) = x                      where (k + 1) x is whole (x = size / L)
                 floor((k + 1) x) / k   otherwise

    so ceil(sum u_k(x)) rows are needed; the best over k = 1 .. `ks`. It sees what the tight
    bound's token count misses where pieces do not combine: pieces just over L / (k + 1) fill a
    row k at a time with room no other such piece uses (lengths 683..699 at L=2048: two a row,
    no three; the tight bound 2/3 of the rows, this bound all of them). O(n + ks * distinct).

    Worked example (L 11; eight pieces of 4): 32 tokens, so 3 rows by tokens (the tight bound
    too); k = 2: 3 * 4 / 11 floors to 1, so each piece counts 1/2: 4 rows, the optimum (two
    4s a row: three are 12 > 11).
    """
    n = int(sizes_asc.size)
    if n == 0:
        return 0
    L = int(capacity)
    edge = np.flatnonzero(sizes_asc[1:] != sizes_asc[:-1]) + 1
    vals = sizes_asc[np.concatenate([[0], edge])]
    count = np.diff(np.concatenate([[0], edge, [n]]))
    best = 0
    for k in range(1, ks + 1):
        q, r = np.divmod((k + 1) * vals, L)
        whole = r == 0
        exact = int(np.dot(count[whole], vals[whole]))  # tokens at u_k(x) = x
        floors = int(np.dot(count[~whole], q[~whole]))  # in units of 1 / k
        best = max(best, -(-(exact * k + floors * L) // (k * L)))
    return best
