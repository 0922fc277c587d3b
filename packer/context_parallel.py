"""Context parallelism: TransformerEngine's load-balanced THD layout of packed rows, and its work.

A row of L tokens packed with `PackConfig(context_parallel=C)` is cut into spans: each segment's
span runs from its offset to the next segment's (the last one's to its end rounded up to 2C),
then the padding tail to L; every span is a multiple of 2C. Each span is cut into 2C equal
chunks, and rank r holds chunks r and 2C-1-r of every span, span by span: a causal segment's
early (cheap) and late (dear) queries land on the same rank, so the ranks' attention work is
near equal (`rank_work`). Worked example, L = 16, C = 2, segments [0, 5) and [8, 11): spans
[0, 8), [8, 12) and the tail [12, 16), chunks of 2, 1 and 1 tokens:

    span        [0, 8)              [8, 12)        [12, 16)
    chunks      01 | 23 | 45 | 67   8 | 9 | 10 | 11   12 | 13 | 14 | 15
    rank 0      0 1           6 7   8          11     12           15
    rank 1           2 3 4 5           9 10              13 14
    order     = [0 1 6 7 8 11 12 15 | 2 3 4 5 9 10 13 14]

`x[b, order[b]]` puts rank r's tokens at [r L/C, (r + 1) L/C); positions and segment ids
permute alike, the [S] metadata stays global. TransformerEngine computes the same index per
rank from `cu_seqlens_padded` (`thd_partition_indices_kernel`, transformer_engine/common/
fused_attn/context_parallel.cu at commit 045b84834454): the token at offset u of a span that
starts at s with chunks of c = span / 2C tokens is s + u + c r in its first chunk, else
s + u + c (2C - 2 - r); pass it the span boundaries (ending at L) as cu_seqlens and the rows
serve TE users as they are. `kernels` holds a jnp twin of this order, tested to agree.

`layout="rotated"` turns the pairs round span by span: in span k (counted over the row's
boundaries) rank r holds chunks (r + k) mod C and its mirror. TE's layout gives every span's
last chunk to rank 0, so on rows of many short segments, whose last chunks are mostly padding,
the low ranks lose work; rotating spreads that loss over the ranks. `layout="balanced"` deals
each span's pairs, dearest first, to the ranks with the least work so far (`balanced_pairs`):
every row near even. Only seqpack's kernels read these two (TransformerEngine expects `"te"`);
"balanced" has no twin on device, so the kernels take its order as positions.
"""

from __future__ import annotations

import numpy as np

from seqpack.packer.plan import aligned

__all__ = ["LAYOUTS", "context_parallel_order", "rank_work"]

LAYOUTS = ("te", "rotated", "balanced")


def check_layout(layout: object, name: str = "layout") -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"{name}={layout!r} must be one of {LAYOUTS} ('te': TransformerEngine's "
                         "load-balanced layout; 'rotated': its chunk pairs turned span by span; "
                         "'balanced': each span's pairs dealt to the least loaded ranks)")
    return str(layout)


def _check(offsets: object, lengths: object, seq_len: int, context_parallel: int):
    if isinstance(context_parallel, bool) or not isinstance(context_parallel, int | np.integer) \
            or context_parallel < 1:
        raise ValueError(f"context_parallel={context_parallel!r} must be an int >= 1")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int | np.integer) or seq_len < 1 \
            or seq_len % (2 * context_parallel):
        raise ValueError(f"seq_len={seq_len!r} must be a positive multiple of 2 x "
                         f"context_parallel={context_parallel}")
    off, ln = np.asarray(offsets), np.asarray(lengths)
    if off.shape != ln.shape or off.ndim not in (1, 2) or not np.issubdtype(off.dtype, np.integer) \
            or not np.issubdtype(ln.dtype, np.integer):
        raise ValueError(f"segment_offsets.shape={off.shape} and segment_lengths.shape="
                         f"{ln.shape} must both be integer [B, S] (or [S] for one row)")
    off2, ln2 = np.atleast_2d(off).astype(np.int64), np.atleast_2d(ln).astype(np.int64)
    used = ln2 > 0
    bad = used & ((off2 % (2 * context_parallel) != 0) | (off2 < 0) | (off2 + ln2 > seq_len))
    if bad.any():
        r, j = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"segment_offsets[{r}, {j}]={int(off2[r, j])} (length {int(ln2[r, j])}) must be a "
            f"multiple of 2 x context_parallel={context_parallel} inside seq_len={seq_len}; "
            f"pack the rows with PackConfig(context_parallel={context_parallel})")
    return off2, ln2, used, off.ndim == 1


def _bounds(offsets: np.ndarray, lengths: np.ndarray, seq_len: int, context_parallel: int
            ) -> tuple[np.ndarray, np.ndarray]:  # i64[B, S + 3] twice, unsorted
    """Per row the span boundaries (0, each used segment's offset, the last segment's end
    rounded up to 2C, L; unused slots at L) and the real tokens of the span each one starts."""
    used = lengths > 0
    end = np.where(used, offsets + lengths, 0).max(axis=1, initial=0)
    zero = np.zeros((offsets.shape[0], 1), np.int64)
    bounds = np.concatenate([zero, np.where(used, offsets, seq_len),
                             aligned(end, 2 * context_parallel)[:, None], zero + seq_len], axis=1)
    return bounds, np.concatenate([zero, np.where(used, lengths, 0), zero, zero], axis=1)


def span_bounds(offsets: np.ndarray, lengths: np.ndarray, seq_len: int, context_parallel: int
                ) -> np.ndarray:  # i64[B, S + 3], sorted per row
    """Per row the span boundaries (with repeats), sorted."""
    return np.sort(_bounds(offsets, lengths, seq_len, context_parallel)[0], axis=1)


def balanced_pairs(offsets: np.ndarray, lengths: np.ndarray, seq_len: int, context_parallel: int
                   ) -> np.ndarray:  # i64[B, S + 3, C]
    """Per row, boundary (span_bounds' index) and rank: the chunk pair the rank holds in the
    span starting there. Spans in row order, each one's pairs dearest first to the ranks with
    the least causal work so far (ties: the lower rank, the lower pair)."""
    B, C = offsets.shape[0], context_parallel
    bounds, n = _bounds(offsets, lengths, seq_len, C)
    sort = np.argsort(bounds, axis=1, kind="stable")  # a segment's offset after an equal 0
    bounds, n = np.take_along_axis(bounds, sort, axis=1), np.take_along_axis(n, sort, axis=1)
    rows, i = np.arange(B)[:, None], np.arange(2 * C, dtype=np.int64)[None, :]
    pairs = np.broadcast_to(np.arange(C), (B, bounds.shape[1], C)).copy()
    load = np.zeros((B, C), np.int64)
    for j in range(min(bounds.shape[1] - 1, int((lengths > 0).sum(axis=1).max(initial=0)) + 2)):
        # (past the used segments, their last span and the tail: unused slots, empty spans)
        chunk = (bounds[:, j + 1:j + 2] - bounds[:, j:j + 1]) // (2 * C)
        a = i * chunk
        e = np.minimum(n[:, j:j + 1], a + chunk)
        work = np.where(e > a, (e - a) * (a + e + 1) // 2, 0)  # keys at or before, per chunk
        pair_work = work[:, :C] + work[:, ::-1][:, :C]
        ranks = np.argsort(load, axis=1, kind="stable")
        pairs[rows, j, ranks] = np.argsort(-pair_work, axis=1, kind="stable")
        load += np.take_along_axis(pair_work, pairs[:, j], axis=1)
    return pairs


def context_parallel_order(
    segment_offsets: object,  # int[B, S] (or [S])
    segment_lengths: object,  # int[B, S] (or [S])
    *,
    seq_len: int,
    context_parallel: int,
    layout: str = "te",
) -> np.ndarray:  # i32[B, L] (or [L])
    """The load-balanced layout's permutation (module docstring): `x[b, order[b]]` places rank
    r's tokens at `[r L/C, (r + 1) L/C)`; ValueError when an offset is not a multiple of 2C.
    `layout`: "te" (TransformerEngine's), "rotated" (the pairs turned span by span) or
    "balanced" (`balanced_pairs`)."""
    check_layout(layout)
    off, ln, _, one = _check(segment_offsets, segment_lengths, seq_len, context_parallel)
    C, B = int(context_parallel), off.shape[0]
    local = seq_len // C
    bounds = span_bounds(off, ln, seq_len, C) // C  # in local tokens: spans are multiples of 2C
    # One searchsorted over all rows: row b's boundaries are shifted by b (L/C + 1), so a
    # token's span is the last boundary of its own row at or before it.
    shift = (local + 1) * np.arange(B, dtype=np.int64)[:, None]
    keys = (bounds + shift).reshape(-1)
    t = np.arange(local, dtype=np.int64)
    j = np.searchsorted(keys, (t[None, :] + shift).reshape(-1), side="right") - 1
    span_start = keys[j].reshape(B, local) - shift
    chunk = (keys[j + 1].reshape(B, local) - shift - span_start) // 2
    u = t[None, :] - span_start  # local offset inside the span
    rank = np.arange(C, dtype=np.int64)[None, :, None]
    span = (j % bounds.shape[1]).reshape(B, 1, local)  # counted over the row's boundaries
    if layout == "rotated":  # span k's pair of rank r: (r + k) mod C
        rank = (rank + span) % C
    elif layout == "balanced":
        pairs = balanced_pairs(off, ln, seq_len, C)  # [B, K, C]
        rank = np.take_along_axis(pairs, span.reshape(B, local, 1), axis=1).transpose(0, 2, 1)
    first = u[:, None, :] < chunk[:, None, :]
    which = np.where(first, rank, 2 * C - 1 - rank)
    within = np.where(first, u[:, None, :], u[:, None, :] - chunk[:, None, :])
    order = span_start[:, None, :] * C + which * chunk[:, None, :] + within
    order = order.reshape(B, seq_len).astype(np.int32)
    return order[0] if one else order


def rank_work(
    segment_offsets: object,  # int[B, S]
    segment_lengths: object,  # int[B, S]
    *,
    seq_len: int,
    context_parallel: int,
    balanced: bool = True,
    layout: str = "te",
) -> np.ndarray:  # i64[B, C]
    """Each rank's causal attention work per row: over its query tokens, the keys of the
    token's own segment at or before it (position + 1; 0 on padding). `balanced`: the
    load-balanced `layout`; False: a contiguous split (rank r holds [r L/C, (r + 1) L/C))."""
    check_layout(layout)
    off, ln, used, _ = _check(segment_offsets, segment_lengths, seq_len, context_parallel)
    B, C = off.shape[0], int(context_parallel)
    work = np.zeros((B, seq_len + 2), np.int64)
    rows = np.broadcast_to(np.arange(B)[:, None], off.shape)[used]
    starts, ends = off[used], (off + ln)[used]
    # position + 1 on [start, end) as second differences: +1 at the start, -(n + 1) at the
    # end, +n after it (n = the length), summed twice along the row
    np.add.at(work, (rows, starts), 1)
    np.add.at(work, (rows, ends), -(ends - starts) - 1)
    np.add.at(work, (rows, ends + 1), ends - starts)
    work = np.cumsum(np.cumsum(work, axis=1), axis=1)[:, :seq_len]
    if balanced:
        order = context_parallel_order(off, ln, seq_len=seq_len, context_parallel=C,
                                       layout=layout)
        work = np.take_along_axis(work, order.astype(np.int64), axis=1)
    return work.reshape(B, C, seq_len // C).sum(axis=2)
