"""Pallas TPU (Mosaic) forward kernel of segment attention: flash attention over the schedule.

Grid `(B, H, nq, W)`, semantics ("parallel", "parallel", "parallel", "arbitrary"); nq = L / bq
query blocks, and a static key axis of W steps: W = nk = L / bk always fits a range, and when
`narrow_steps` < nk a second grid of W = narrow_steps is compiled too and runs (`lax.cond`)
whenever the batch's longest range fits it, so short segments do not pay for L / bk steps. The
block schedule (attention_schedule.py: key blocks [lo_i, hi_i) of query block i) is
scalar-prefetched into SMEM, so the key/value index maps are data-dependent: step j of query
block i loads key block lo_i + j while j < hi_i - lo_i, and the range's last block again for the
steps past it, so the block index repeats and Pallas issues no copy; `pl.when` skips their
compute. Worked example, one row, L = 16, bq = bk = 4 (the schedule module's), W = nk = 4:

    query block  [lo, hi)   key block at steps j = 0 1 2 3   computed   copies
    0            [0, 1)                         0 0 0 0      j = 0      1
    1            [0, 2)                         0 1 1 1      j = 0, 1   1 (block 1; 0 is current)
    2            [2, 3)                         2 2 2 2      j = 0      1
    3            [2, 4)                         2 3 3 3      j = 0, 1   1 (block 3)

Each computed step is one online-softmax update (running max `m`, sum `l`, f32 accumulator in
VMEM scratch) on `s = q k^T * scale`, masked with `where` (never by multiplying) to the pairs
(r, c) with `start(r) <= c < end(r)` and `c <= r` when causal: the per-token segment bounds are
(bq, 1) / (bk, 1) int32 blocks, compared against iotas of the true positions. Value rows outside
every segment (padding, and the undefined rows past L of a partial block) are zeroed before
`p @ v`, so they never reach a sum. The last step writes `o = acc / l` (0 for tokens outside
every segment) and the f32 logsumexp `m + log l` the backward needs (MASK_VALUE for a row that
saw no key: a ring step of context parallelism merges partial results by it).

Layout: the kernels read q, k, v as [B, H, L, D] blocks (bq, D) of head h. kernels/attention.py
hands them operands so, transposing [B, L, H, D] ones once outside the custom VJP (where XLA can
fuse the transpose into the neighbouring ops); a ring step of context parallelism passes its
[B, L/C, H, D] shards (`cfg.operand == "blhd"`), transposed here. Grouped-query heads: query
head h reads key/value head h // (H / K).
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from seqpack.kernels.attention_schedule import MASK_VALUE, AttentionConfig, Schedule, step_block
from seqpack.kernels.common import LANES, varying_like

NT = (((1,), (1,)), ((), ()))  # a @ b.T
NN = (((1,), (0,)), ((), ()))  # a @ b
VISIT_TILE = (8, 128)  # one (8, 128) i32 tile per counted block (debug output)
Semantics = Literal["parallel", "arbitrary"]


def to_kernel(x: jax.Array, cfg: AttentionConfig) -> jax.Array:
    """Operand -> kernel layout [B, N, L, D]: as is, or transposed from [B, L, N, D]."""
    return x if cfg.operand == "bhld" else x.transpose(0, 2, 1, 3)


def from_kernel(y: jax.Array, cfg: AttentionConfig) -> jax.Array:
    """The inverse of `to_kernel`: back to the operand layout."""
    return y if cfg.operand == "bhld" else y.transpose(0, 2, 1, 3)


def head_spec(cfg: AttentionConfig, rows: int, index) -> pl.BlockSpec:
    """BlockSpec of a (rows, D) block of head n, row block t; index(*grid, *refs) -> (b, n, t)."""
    def head_major_index(*args):
        b, n, t = index(*args)
        return b, n, t, 0

    return pl.BlockSpec((None, None, rows, cfg.head_dim), head_major_index)


def kernel_shape(cfg: AttentionConfig, batch: int, heads: int, dtype) -> jax.ShapeDtypeStruct:
    """The kernel-layout shape [B, heads, L, D] of a [B, L, heads, D] array."""
    return jax.ShapeDtypeStruct((batch, heads, cfg.seq_len, cfg.head_dim), dtype)


def pair_mask(q_base, k_base, q_start, q_end, shape, causal: bool, *, keys_on_rows=False,
              diagonal=True):
    """Allowed (query, key) entries of a block pair from the query tokens' segment bounds.

    shape (bq, bk) with q_start / q_end (bq, 1); keys_on_rows: shape (bk, bq), bounds (1, bq).
    Causal: key c is allowed for query r iff start(r) <= c <= r (c < end(r) follows from r <
    end(r), and a row outside every segment has start past every key); `diagonal=False` says
    every key of the pair precedes every query, so c <= r needs no compare. The positions are
    a row and a column of iotas (relative to k_base) broadcast by the compares: one compare an
    entry off the diagonal.
    """
    k_axis = 0 if keys_on_rows else 1
    k_pos = lax.broadcasted_iota(jnp.int32, (shape[0], 1) if keys_on_rows else (1, shape[1]),
                                 k_axis)
    allowed = k_pos >= q_start - k_base
    if not causal:
        return allowed & (k_pos < q_end - k_base)
    if not diagonal:
        return jnp.broadcast_to(allowed, shape)
    q_shape = (1, shape[1]) if keys_on_rows else (shape[0], 1)
    q_pos = lax.broadcasted_iota(jnp.int32, q_shape, 1 - k_axis) + (q_base - k_base)
    return allowed & (k_pos <= q_pos)


def pair_steps(pair, computed, first_key: jax.Array, first_query: jax.Array, block_kv: int,
               causal: bool) -> None:
    """Runs pair(diagonal) at a computed step: diagonal=False when the key block ends at or
    before the query block's first row (causal: no per-entry causal compare there)."""
    if not causal:
        pl.when(computed)(functools.partial(pair, True))
        return
    below = first_key + block_kv <= first_query + 1
    pl.when(computed & below)(functools.partial(pair, False))
    pl.when(computed & jnp.logical_not(below))(functools.partial(pair, True))


def rows_in_segments(start: jax.Array, base: jax.Array) -> jax.Array:  # bool like start
    """Rows of a block that lie in a segment (start <= position): padding and rows past L not.
    start: the rows' segment starts, i32[rows, w] (a column, or a lane tile widened to w)."""
    return start <= base + lax.broadcasted_iota(jnp.int32, start.shape, 0)


def lane_tile(x: jax.Array, width: int) -> jax.Array:
    """A (rows, 128) lane-replicated tile as (rows, width) (splash attention's broadcast)."""
    return x if width == LANES else jnp.tile(x, (1, -(-width // LANES)))[:, :width]


def range_step(lo_ref, hi_ref, num_q_blocks: int):
    """(query block i, step j, the range's first key block lo, whether step j computes) of a
    (B, H, nq, W) grid step over the scalar-prefetched ranges."""
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    idx = b * num_q_blocks + i
    lo = lo_ref[idx]
    return i, j, lo, j < hi_ref[idx] - lo


def schedule_call(kernel, cfg: AttentionConfig, steps: int, grid: tuple[int, ...], *,
                  num_scalar_prefetch: int, in_specs, out_shapes, out_specs, scratch_shapes,
                  name: str, cost_estimate: pl.CostEstimate | None = None,
                  parallel_axes: int = 3, vmem_limit_bytes: int | None = None, **options):
    """pallas_call of one of the attention kernels: grid (B, heads, blocks, *steps), the first
    `parallel_axes` axes "parallel", the others "arbitrary", the schedule's first
    `num_scalar_prefetch` operands in SMEM; `options` go to the kernel. When counting, a last
    output: the debug counter, one (8, 128) i32 tile per (row, head, block), read back as
    `out[:, :, ::8, 0]`."""
    out_shapes, out_specs = list(out_shapes), list(out_specs)
    if cfg.count_visits:
        batch, heads, blocks = grid[:3]
        out_shapes.append(jax.ShapeDtypeStruct((batch, heads, blocks * VISIT_TILE[0],
                                                VISIT_TILE[1]), jnp.int32))
        out_specs.append(pl.BlockSpec((None, None, *VISIT_TILE), lambda *g: (*g[:3], 0)))
    parallel: Semantics = "parallel"
    arbitrary: Semantics = "arbitrary"
    semantics = (parallel,) * parallel_axes + (arbitrary,) * (len(grid) - parallel_axes)

    def call(*args):
        return pl.pallas_call(
            functools.partial(kernel, cfg=cfg, steps=steps, **options),
            out_shape=varying_like(out_shapes, *args),  # inside shard_map (context parallelism)
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=num_scalar_prefetch, grid=grid, in_specs=in_specs,
                out_specs=out_specs, scratch_shapes=scratch_shapes),
            compiler_params=pltpu.CompilerParams(dimension_semantics=semantics,
                                                 vmem_limit_bytes=vmem_limit_bytes),
            cost_estimate=cost_estimate,
            interpret=cfg.interpret,
            name=name,
        )(*args)

    return call


def count_visit(visits_ref, first: jax.Array, computed: jax.Array) -> None:
    """Debug counter: zeroed at `first`, +1 on every computed step."""
    if visits_ref is None:
        return

    @pl.when(first)
    def _zero():
        visits_ref[...] = jnp.zeros(visits_ref.shape, jnp.int32)

    @pl.when(computed)
    def _add():
        visits_ref[...] += 1


def _forward_kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, qs_ref, qe_ref, ks_ref, o_ref, lse_ref,
                    *rest, cfg: AttentionConfig, steps: int) -> None:
    # lo, hi SMEM i32[B * nq]; q [bq, D]; k, v [bk, D]; qs, qe i32[bq, w]; ks i32[bk, w];
    # o [bq, D]; lse f32[bq, 1]; rest: (visits i32[8, 128]), m, l f32[bq, 128], acc f32[bq, D]
    visits_ref, (m_ref, l_ref, acc_ref) = (rest[0] if cfg.count_visits else None), rest[-3:]
    bq, bk = cfg.block_q, cfg.block_kv
    i, j, lo, computed = range_step(lo_ref, hi_ref, cfg.blocks(bq))
    count_visit(visits_ref, j == 0, computed)

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    # m, l and the bounds are (rows, 128) lane tiles (lane-replicated), widened by lane_tile
    wide = lane_tile
    dim = acc_ref.shape[1]

    def pair(diagonal: bool):
        k_base = (lo + j) * bk
        s = lax.dot_general(q_ref[...], k_ref[...], NT, preferred_element_type=jnp.float32)
        allowed = pair_mask(i * bq, k_base, wide(qs_ref[...], bk), wide(qe_ref[...], bk),
                            (bq, bk), cfg.causal, diagonal=diagonal)
        s = jnp.where(allowed, s * cfg.scale, MASK_VALUE)
        m_prev = m_ref[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        # masked entries give exp(MASK_VALUE - m_new) = 0 once the row has seen a key; before
        # that (m_new = MASK_VALUE) they add 1s that the first real key's alpha = 0 wipes
        p = jnp.exp(s - wide(m_new, bk))
        alpha = jnp.exp(m_prev - m_new)
        l_ref[...] = alpha * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        v = jnp.where(rows_in_segments(wide(ks_ref[...], dim), k_base), v_ref[...], 0)
        pv = lax.dot_general(p.astype(v.dtype), v, NN, preferred_element_type=jnp.float32)
        acc_ref[...] = wide(alpha, dim) * acc_ref[...] + pv
        m_ref[...] = m_new

    pair_steps(pair, computed, (lo + j) * bk, i * bq, bk, cfg.causal)

    @pl.when(j == steps - 1)
    def _finish():
        seen = m_ref[...] > 0.5 * MASK_VALUE  # the row saw a key (its max is a real score)
        total = jnp.where(seen, l_ref[...], 1.0)
        lse = jnp.where(seen, m_ref[...] + jnp.log(total), MASK_VALUE)
        o_ref[...] = (acc_ref[...] * wide(jnp.where(seen, 1.0 / total, 0.0), dim)
                      ).astype(o_ref.dtype)
        lse_ref[...] = lse[:, :1]


def narrow_or_full(call, counts: jax.Array, full: int, cfg: AttentionConfig):
    """call(steps) with the full step axis, or (cfg.narrow_steps < full) a `lax.cond` between a
    grid of narrow_steps steps, taken when every range (`counts`) fits, and the full one."""
    narrow = cfg.narrow_steps
    if narrow is None or narrow >= full:
        return call(full)
    return lax.cond(jnp.max(counts) <= narrow, lambda: call(narrow), lambda: call(full))


def forward(q, k, v, sched: Schedule, cfg: AttentionConfig):
    """-> o like q, lse f32[B, H, L, 1] (and visits i32[B, H, nq] when counting)."""
    call = functools.partial(_forward_call, q, k, v, sched, cfg)
    return narrow_or_full(call, sched.hi - sched.lo, cfg.blocks(cfg.block_kv), cfg)


def _forward_call(q, k, v, sched: Schedule, cfg: AttentionConfig, steps: int):
    batch = q.shape[0]
    bq, bk = cfg.block_q, cfg.block_kv
    nq, nk, groups = cfg.blocks(bq), cfg.blocks(bk), cfg.groups

    def kv_index(b, h, i, j, lo_ref, hi_ref):
        idx = b * nq + i
        return b, lax.div(h, groups), step_block(lo_ref[idx], hi_ref[idx], j, nk)

    def kv_bounds_index(b, h, i, j, lo_ref, hi_ref):
        return b, kv_index(b, h, i, j, lo_ref, hi_ref)[2], 0

    q_spec = head_spec(cfg, bq, lambda b, h, i, j, *_: (b, h, i))
    width = LANES  # per-row values: lane tiles
    column = lambda rows, index: pl.BlockSpec((None, rows, width), index)  # noqa: E731
    q_bounds = column(bq, lambda b, h, i, j, *_: (b, i, 0))
    out_shapes = [kernel_shape(cfg, batch, cfg.heads, q.dtype),
                  jax.ShapeDtypeStruct((batch, cfg.heads, cfg.seq_len, 1), jnp.float32)]
    out_specs = [q_spec, pl.BlockSpec((None, None, bq, 1), lambda b, h, i, j, *_: (b, h, i, 0))]
    start, end, k_live = (jnp.broadcast_to(x[:, :, None], (*x.shape, width))
                          for x in (sched.start, sched.end, sched.k_live))
    useful = 4 * batch * cfg.heads * cfg.seq_len**2 * cfg.head_dim // (2 if cfg.causal else 1)
    outs = schedule_call(
        _forward_kernel, cfg, steps, (batch, cfg.heads, nq, steps), num_scalar_prefetch=2,
        in_specs=[q_spec, head_spec(cfg, bk, kv_index), head_spec(cfg, bk, kv_index), q_bounds,
                  q_bounds, column(bk, kv_bounds_index)],
        out_shapes=out_shapes, out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((bq, width), jnp.float32),
                        pltpu.VMEM((bq, width), jnp.float32),
                        pltpu.VMEM((bq, cfg.head_dim), jnp.float32)],
        cost_estimate=pl.CostEstimate(flops=useful, transcendentals=useful // (4 * cfg.head_dim),
                                      bytes_accessed=4 * q.size * q.dtype.itemsize),
        name="segment_attention_fwd",
    )(sched.lo.reshape(-1), sched.hi.reshape(-1), to_kernel(q, cfg), to_kernel(k, cfg),
      to_kernel(v, cfg), start, end, k_live)
    o, lse = from_kernel(outs[0], cfg), outs[1]
    if cfg.count_visits:
        return o, lse, outs[2][:, :, ::8, 0]
    return o, lse
