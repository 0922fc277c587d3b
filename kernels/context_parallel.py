"""Context parallelism on device: the load-balanced layout (jnp) and the schedule of a ring step.

A row packed with `PackConfig(context_parallel=C)` is split over C ranks in TransformerEngine's
THD layout (`packer.context_parallel_order`, whose docstring has the worked example): rank r
holds chunks r and 2C-1-r of every span (a segment and its padding, then the row's padding
tail), in row order. `rank_positions` is the jnp twin of that order (tested to agree): the row
position of each of rank r's L/C tokens. Positions rise along every rank's tokens, so the keys of
one segment on a rank are one contiguous run of its local indices.

A ring step pairs rank r's queries with rank r''s keys. Query t (row position p, segment
[s, e)) may see the keys of r' whose row position lies in [s, min(p, e - 1)] (causal; else
[s, e)): in r''s local indices an interval [a_t, b_t), found by binary search on r''s rising
positions. Those bounds are what the kernels' masks read (`Schedule.start` / `.end`, causality
folded in, the kernels run non-causal), and `attention_schedule.bounded_schedule` turns them
into the key-block ranges each query block visits. Worked example, L = 16, C = 2, one segment
[0, 12) (chunks of 3: rank 0 holds rows 0-2, 9-11 and of the tail 12, 15; rank 1 rows 3-8 and
13, 14), causal, rank 0's queries against rank 1's keys:

    rank 0's query (row)    0     1     2     9       10      11      12    15
    its keys on rank 1      none  none  none  [0, 6)  [0, 6)  [0, 6)  none  none
    (rows 0-2 precede every key of rank 1; 9-11 see all six of its segment; 12, 15 padding)

A step whose ranges are all empty (every row) issues no kernel at all (ring.py).

`layout="rotated"` (packer.context_parallel's docstring): in span k rank r holds the chunk pair
(r + k) mod C; positions still rise along every rank's tokens, so all of the above holds. Any
layout whose positions rise per rank works the same way given the positions (`rows_at`): the
ring takes them from the caller for `"balanced"`, which has no twin here (a greedy scan).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from seqpack.kernels.attention_schedule import (
    MASK_VALUE,
    NO_SEGMENT,
    AttentionConfig,
    Schedule,
    bounded_schedule,
    token_bounds,
)

LAYOUTS = ("te", "rotated")  # computed here (packer.context_parallel.LAYOUTS but "balanced")


def span_bounds(segment_offsets: jax.Array, segment_lengths: jax.Array, seq_len: int,
                context_parallel: int) -> jax.Array:  # i32[B, S + 3], sorted per row
    """Per row the span boundaries, with repeats: 0, the used segments' offsets, the last
    segment's end rounded up to 2C, and L (packer.context_parallel.span_bounds)."""
    offsets = segment_offsets.astype(jnp.int32)
    lengths = segment_lengths.astype(jnp.int32)
    used = lengths > 0
    two_c = 2 * context_parallel
    end = jnp.max(jnp.where(used, offsets + lengths, 0), axis=1, keepdims=True)
    column = jnp.zeros_like(end)
    bounds = jnp.concatenate([column, jnp.where(used, offsets, seq_len),
                              (end + two_c - 1) // two_c * two_c, column + seq_len], axis=1)
    return jnp.sort(bounds, axis=1)


def rank_positions(
    segment_offsets: jax.Array,  # int[B, S]
    segment_lengths: jax.Array,  # int[B, S]
    rank: jax.Array | int,  # i32[], may be traced (lax.axis_index)
    *,
    seq_len: int,
    context_parallel: int,
    layout: str = "te",
) -> jax.Array:  # i32[B, L / C], rising along each row
    """Row positions of rank `rank`'s tokens in the load-balanced layout ("te" or "rotated")."""
    if layout not in LAYOUTS:
        raise ValueError(f"context_parallel_layout={layout!r} must be one of {LAYOUTS}")
    C = context_parallel
    batch, local = segment_offsets.shape[0], seq_len // C
    bounds = span_bounds(segment_offsets, segment_lengths, seq_len, C) // C  # local units
    shift = (local + 1) * jnp.arange(batch, dtype=jnp.int32)[:, None]
    keys = (bounds + shift).reshape(-1)
    t = jnp.arange(local, dtype=jnp.int32)
    j = jnp.searchsorted(keys, (t[None, :] + shift).reshape(-1), side="right") - 1
    span_start = keys[j].reshape(batch, local) - shift
    chunk = (keys[j + 1].reshape(batch, local) - shift - span_start) // 2
    u = t[None, :] - span_start
    first = u < chunk
    if layout == "rotated":
        rank = (rank + (j % bounds.shape[1]).reshape(batch, local)) % C
    which = jnp.where(first, rank, 2 * C - 1 - rank)
    return (span_start * C + which * chunk + jnp.where(first, u, u - chunk)).astype(jnp.int32)


def context_parallel_order(
    segment_offsets: jax.Array,  # int[B, S]
    segment_lengths: jax.Array,  # int[B, S]
    *,
    seq_len: int,
    context_parallel: int,
    layout: str = "te",
) -> jax.Array:  # i32[B, L]
    """The jnp twin of `packer.context_parallel_order`: x[b, order[b]] is the layout."""
    ranks = [rank_positions(segment_offsets, segment_lengths, r, seq_len=seq_len,
                            context_parallel=context_parallel, layout=layout)
             for r in range(context_parallel)]
    return jnp.concatenate(ranks, axis=1)


class Rows(NamedTuple):
    """One rank's tokens: row positions and their segments' [start, end) (NO_SEGMENT, 0
    outside segments), i32[B, L / C] each."""

    pos: jax.Array
    start: jax.Array
    end: jax.Array

    @property
    def live(self) -> jax.Array:  # bool[B, L / C]
        return self.start <= self.pos


def rows_at(segment_offsets: jax.Array, segment_lengths: jax.Array, pos: jax.Array, *,
            seq_len: int) -> Rows:
    """Rows of tokens at row positions `pos` i32[B, L/C] (rising): their segments' bounds."""
    start, end = token_bounds(segment_offsets, segment_lengths, seq_len, seq_len)
    return Rows(pos, jnp.take_along_axis(start, pos, axis=1),
                jnp.take_along_axis(end, pos, axis=1))


def key_bounds(q: Rows, k_pos: jax.Array, *, causal: bool) -> tuple[jax.Array, jax.Array]:
    """[a, b) per query: the keys (local indices of positions `k_pos`, rising) it may see;
    NO_SEGMENT, 0 where it sees none (module docstring)."""
    last = jnp.minimum(q.pos, q.end - 1) if causal else q.end - 1
    search = jax.vmap(jnp.searchsorted, in_axes=(0, 0, None))
    a = search(k_pos, q.start, "left").astype(jnp.int32)
    b = search(k_pos, last, "right").astype(jnp.int32)
    sees = q.live & (a < b)
    return jnp.where(sees, a, NO_SEGMENT), jnp.where(sees, b, 0)


def _padded(x: jax.Array, length: int, fill: int) -> jax.Array:
    return jnp.pad(x, ((0, 0), (0, length - x.shape[1])), constant_values=fill)


def pair_schedule(q: Rows, k: Rows, cfg: AttentionConfig, *, causal: bool) -> Schedule:
    """The kernels' schedule of rank q's queries against rank k's keys (cfg: the local shapes,
    run non-causal: causality is in the bounds)."""
    a, b = key_bounds(q, k.pos, causal=causal)
    Lp = cfg.padded_len
    live = lambda rows: _padded(jnp.where(rows.live, 0, NO_SEGMENT), Lp, NO_SEGMENT)  # noqa: E731
    return bounded_schedule(_padded(a, Lp, NO_SEGMENT), _padded(b, Lp, 0), live(q), live(k), cfg)


def reference_step(qx: jax.Array, kx: jax.Array, vx: jax.Array, q: Rows, k: Rows, *,
                   causal: bool, scale: float) -> tuple[jax.Array, jax.Array]:
    """Dense attention of rank q's queries over rank k's keys: (o f32[B, L/C, H, D] normalized
    over these keys, lse f32[B, H, L/C]; MASK_VALUE where a query sees none)."""
    batch, local, heads, dim = qx.shape
    kv_heads = kx.shape[2]
    a, b = key_bounds(q, k.pos, causal=causal)
    c = jnp.arange(local, dtype=jnp.int32)[None, None, :]
    mask = (c >= a[:, :, None]) & (c < b[:, :, None])  # [B, Lq, Lk]
    zero = lambda x, live: jnp.where(live[:, :, None, None], x, 0).astype(jnp.float32)  # noqa: E731
    qf = zero(qx, q.live).reshape(batch, local, kv_heads, heads // kv_heads, dim)
    kf, vf = zero(kx, k.live), zero(vx, k.live)
    s = jnp.einsum("bqkgd,bskd->bkgqs", qf, kf) * scale
    s = jnp.where(mask[:, None, None], s, -1e30)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    p = jnp.where(mask[:, None, None], jnp.exp(s - m), 0.0)
    total = p.sum(-1, keepdims=True)
    seen = total > 0
    o = jnp.einsum("bkgqs,bskd->bqkgd", p / jnp.where(seen, total, 1.0), vf)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), MASK_VALUE)[..., 0]
    return o.reshape(batch, local, heads, dim), lse.reshape(batch, heads, local)
