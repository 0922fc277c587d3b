"""Pallas GPU (Triton) kernels of segment attention, forward and backward, over the block schedule.

GPU Pallas has no scalar prefetch, so the schedule (attention_schedule.py) travels as ordinary
i32 inputs and becomes loop bounds: each program reads its range and runs `lax.fori_loop` from
`lo` to `hi` (dynamic bounds), so key blocks outside the range are neither loaded nor computed.
Every ref is the whole array; tiles are loaded with masked loads at computed positions (rows of
no segment are masked off: never read, loaded as 0), and D is padded to a power of two by the
load mask.

    forward  grid (B, H, nq)   one query block: keys [lo_i, hi_i) with an online softmax (running
                               max and sum, f32 accumulator in registers); writes o and the f32
                               logsumexp per token
    dq       grid (B, H, nq')  one query block, keys [lo_i, hi_i) of the backward block sizes
    dkv      grid (B, K, nk')  one key block of one key head: for each of the G query heads of its
                               group, query blocks [qlo_k, qhi_k) (`transpose_ranges`), all of
                               them computed (a block whose range lacks k: masked out whole)

Worked example, the schedule module's row (L = 16, bq = bk = 4, ranges [0,1) [0,2) [2,3) [2,4)):
forward program i = 1 loops over key blocks 0 and 1 and program 2 over block 2 only, the causal
triangle's pairs (1, 2), (2, 0), (2, 1), ... are never touched. The masks are those of the TPU
kernels: keys with `start(r) <= c < end(r)` (and `c <= r` when causal), applied with `where`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from seqpack.kernels.attention_schedule import MASK_VALUE, AttentionConfig, Schedule
from seqpack.kernels.common import next_power_of_two, triton_call, varying_like


def _dims(cfg: AttentionConfig):
    """Padded head dim (a power of two >= 16, Triton's dot) and its lane mask."""
    dp = max(16, next_power_of_two(cfg.head_dim))
    return dp, jnp.arange(dp) < cfg.head_dim


# Rows of the per-token schedule array i32[B, 4, Lp] (`_tokens`): the queries' key bounds,
# then the query and key rows' liveness (a row is in a segment iff its entry <= its index).
START, END, Q_LIVE, K_LIVE = range(4)


def _tokens(sched: Schedule) -> jax.Array:  # i32[B, 4, Lp]
    return jnp.stack([sched.start, sched.end, sched.q_live, sched.k_live], axis=1)


def _rows(tok_ref, which: int, b, base, n: int):
    """Positions and in-segment flags of n query (Q_LIVE) or key (K_LIVE) rows from `base`."""
    pos = base + jnp.arange(n)
    return pos, tok_ref[b, which, pl.ds(base, n)] <= pos


def _tile(ref, b, head, base, n, ok, d_ok, dp):
    """A (n, dp) tile of head `head` from row `base`, rows where `ok` (else 0)."""
    return plgpu.load(ref.at[b, pl.ds(base, n), head, pl.ds(0, dp)],
                      mask=ok[:, None] & d_ok[None, :], other=0.0)


def _query_block(tok_ref, q_ref, b, h, i, bq: int, cfg: AttentionConfig):
    """Positions, key bounds, in-segment flags and the q tile of query block i of head h."""
    dp, d_ok = _dims(cfg)
    q_pos, q_ok = _rows(tok_ref, Q_LIVE, b, i * bq, bq)
    q_start = tok_ref[b, START, pl.ds(i * bq, bq)]
    q_end = tok_ref[b, END, pl.ds(i * bq, bq)]
    return q_pos, q_start, q_end, q_ok, _tile(q_ref, b, h, i * bq, bq, q_ok, d_ok, dp)


def _allowed(q_pos, q_start, q_end, k_pos, causal: bool):
    allowed = (k_pos[None, :] >= q_start[:, None]) & (k_pos[None, :] < q_end[:, None])
    return allowed & (k_pos[None, :] <= q_pos[:, None]) if causal else allowed


def _forward_kernel(lo_ref, hi_ref, tok_ref, q_ref, k_ref, v_ref, o_ref, lse_ref,
                    *visits, cfg: AttentionConfig) -> None:
    # lo, hi i32[B, nq]; tok i32[B, 4, Lp]; q, o [B, L, H, D]; k, v [B, L, K, D];
    # lse f32[B, H, L]; visits i32[B, H, nq]
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bq, bk = cfg.block_q, cfg.block_kv
    dp, d_ok = _dims(cfg)
    kh = lax.div(h, cfg.groups)
    q_pos, q_start, q_end, _, q = _query_block(tok_ref, q_ref, b, h, i, bq, cfg)

    def body(kb, carry):
        acc, m, total, n = carry
        k_pos, k_ok = _rows(tok_ref, K_LIVE, b, kb * bk, bk)
        k = _tile(k_ref, b, kh, kb * bk, bk, k_ok, d_ok, dp)
        v = _tile(v_ref, b, kh, kb * bk, bk, k_ok, d_ok, dp)
        allowed = _allowed(q_pos, q_start, q_end, k_pos, cfg.causal)
        s = jnp.where(allowed, plgpu.dot(q, k, trans_b=True) * cfg.scale, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(allowed, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
        return acc, m_new, alpha * total + jnp.sum(p, axis=1), n + 1

    init = (jnp.zeros((bq, dp), jnp.float32), jnp.full((bq,), MASK_VALUE, jnp.float32),
            jnp.zeros((bq,), jnp.float32), jnp.int32(0))
    acc, m, total, n = lax.fori_loop(lo_ref[b, i], hi_ref[b, i], body, init)
    seen = total > 0.0
    safe = jnp.where(seen, total, 1.0)
    row_ok = q_pos < cfg.seq_len
    plgpu.store(o_ref.at[b, pl.ds(i * bq, bq), h, pl.ds(0, dp)],
                (acc / safe[:, None]).astype(o_ref.dtype), mask=row_ok[:, None] & d_ok[None, :])
    plgpu.store(lse_ref.at[b, h, pl.ds(i * bq, bq)],
                jnp.where(seen, m + jnp.log(safe), MASK_VALUE), mask=row_ok)
    if visits:
        visits[0][b, h, i] = n


def _dq_kernel(lo_ref, hi_ref, tok_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref,
               dq_ref, *visits, cfg: AttentionConfig) -> None:
    # q, do, dq [B, L, H, D]; k, v [B, L, K, D]; lse, di f32[B, H, L]; visits i32[B, H, nq']
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bq, bk = cfg.block_q_bwd, cfg.block_kv_bwd
    dp, d_ok = _dims(cfg)
    kh = lax.div(h, cfg.groups)
    q_pos, q_start, q_end, q_ok, q = _query_block(tok_ref, q_ref, b, h, i, bq, cfg)
    do = _tile(do_ref, b, h, i * bq, bq, q_ok, d_ok, dp)
    lse = plgpu.load(lse_ref.at[b, h, pl.ds(i * bq, bq)], mask=q_ok, other=0.0)
    di = plgpu.load(di_ref.at[b, h, pl.ds(i * bq, bq)], mask=q_ok, other=0.0)

    def body(kb, carry):
        dq, n = carry
        k_pos, k_ok = _rows(tok_ref, K_LIVE, b, kb * bk, bk)
        k = _tile(k_ref, b, kh, kb * bk, bk, k_ok, d_ok, dp)
        v = _tile(v_ref, b, kh, kb * bk, bk, k_ok, d_ok, dp)
        allowed = _allowed(q_pos, q_start, q_end, k_pos, cfg.causal)
        s = plgpu.dot(q, k, trans_b=True) * cfg.scale
        p = jnp.where(allowed, jnp.exp(s - lse[:, None]), 0.0)
        ds = jnp.where(allowed, p * (plgpu.dot(do, v, trans_b=True) - di[:, None]), 0.0)
        return dq + plgpu.dot(ds.astype(k.dtype), k), n + 1

    init = (jnp.zeros((bq, dp), jnp.float32), jnp.int32(0))
    dq, n = lax.fori_loop(lo_ref[b, i], hi_ref[b, i], body, init)
    plgpu.store(dq_ref.at[b, pl.ds(i * bq, bq), h, pl.ds(0, dp)],
                (dq * cfg.scale).astype(dq_ref.dtype),
                mask=(q_pos < cfg.seq_len)[:, None] & d_ok[None, :])
    if visits:
        visits[0][b, h, i] = n


def _dkv_kernel(qlo_ref, qhi_ref, tok_ref, q_ref, k_ref, v_ref,
                do_ref, lse_ref, di_ref, dk_ref, dv_ref, *visits, cfg: AttentionConfig) -> None:
    # dk, dv [B, L, K, D]; visits i32[B, K, nk'] (pairs summed over the group's query heads)
    b, kh, kb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bq, bk = cfg.block_q_bwd, cfg.block_kv_bwd
    dp, d_ok = _dims(cfg)
    k_pos, k_ok = _rows(tok_ref, K_LIVE, b, kb * bk, bk)
    k = _tile(k_ref, b, kh, kb * bk, bk, k_ok, d_ok, dp)
    v = _tile(v_ref, b, kh, kb * bk, bk, k_ok, d_ok, dp)

    def head(g, carry):
        h = kh * cfg.groups + g

        def step(i, carry):
            # Every query block of [qlo, qhi) is computed, with no `lax.cond` on whether its
            # range holds kb: inside an scf.if Triton's pipeliner prefetches nothing. One whose
            # range lacks kb is masked out whole (`allowed`); in make_schedule's ranges (they
            # grow with i) only a block of no live rows can lie between two that hold kb, and
            # its masked loads read nothing.
            dk, dv, n = carry
            q_pos, q_start, q_end, q_ok, q = _query_block(tok_ref, q_ref, b, h, i, bq, cfg)
            do = _tile(do_ref, b, h, i * bq, bq, q_ok, d_ok, dp)
            lse = plgpu.load(lse_ref.at[b, h, pl.ds(i * bq, bq)], mask=q_ok, other=0.0)
            di = plgpu.load(di_ref.at[b, h, pl.ds(i * bq, bq)], mask=q_ok, other=0.0)
            allowed = _allowed(q_pos, q_start, q_end, k_pos, cfg.causal)  # [bq, bk]
            s = plgpu.dot(q, k, trans_b=True) * cfg.scale
            p = jnp.where(allowed, jnp.exp(s - lse[:, None]), 0.0)
            ds = jnp.where(allowed, p * (plgpu.dot(do, v, trans_b=True) - di[:, None]), 0.0)
            dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True)
            dk = dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True)
            return dk, dv, n + 1

        return lax.fori_loop(qlo_ref[b, kb], qhi_ref[b, kb], step, carry)

    init = (jnp.zeros((bk, dp), jnp.float32), jnp.zeros((bk, dp), jnp.float32), jnp.int32(0))
    dk, dv, n = lax.fori_loop(0, cfg.groups, head, init)
    out_mask = (k_pos < cfg.seq_len)[:, None] & d_ok[None, :]
    plgpu.store(dk_ref.at[b, pl.ds(kb * bk, bk), kh, pl.ds(0, dp)],
                (dk * cfg.scale).astype(dk_ref.dtype), mask=out_mask)
    plgpu.store(dv_ref.at[b, pl.ds(kb * bk, bk), kh, pl.ds(0, dp)], dv.astype(dv_ref.dtype),
                mask=out_mask)
    if visits:
        visits[0][b, kh, kb] = n


def _call(kernel, grid, out_shapes, cfg: AttentionConfig, name: str, *args):
    """pallas_call over whole-array refs (no BlockSpecs); a visits output when counting."""
    batch, heads, blocks = grid
    if cfg.count_visits:
        out_shapes = [*out_shapes, jax.ShapeDtypeStruct((batch, heads, blocks), jnp.int32)]
    num_warps, num_stages = cfg.triton or (4, 2)
    out_shapes = varying_like(out_shapes, *args)  # inside shard_map (context parallelism)
    return triton_call(functools.partial(kernel, cfg=cfg), out_shape=out_shapes, grid=grid,
                       num_warps=num_warps, num_stages=num_stages, interpret=cfg.interpret,
                       name=name)(*args)


def forward(q, k, v, sched: Schedule, cfg: AttentionConfig):
    """-> o [B, L, H, D], lse f32[B, H, L] (and visits i32[B, H, nq] when counting)."""
    batch = q.shape[0]
    shapes = [jax.ShapeDtypeStruct(q.shape, q.dtype),
              jax.ShapeDtypeStruct((batch, cfg.heads, cfg.seq_len), jnp.float32)]
    return tuple(_call(_forward_kernel, (batch, cfg.heads, cfg.blocks(cfg.block_q)), shapes, cfg,
                       "segment_attention_fwd_gpu", sched.lo, sched.hi, _tokens(sched), q, k, v))


def backward(q, k, v, o, lse, do, sched: Schedule, cfg: AttentionConfig):
    """-> dq, dk, dv like q, k, v (and visits of the dq, dkv kernels when counting)."""
    batch = q.shape[0]
    di = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1).transpose(0, 2, 1)
    dq_out = _call(_dq_kernel, (batch, cfg.heads, cfg.blocks(cfg.block_q_bwd)),
                   [jax.ShapeDtypeStruct(q.shape, q.dtype)], cfg, "segment_attention_dq_gpu",
                   sched.lo_bwd, sched.hi_bwd, _tokens(sched), q, k, v, do, lse, di)
    kv = jax.ShapeDtypeStruct(k.shape, k.dtype)
    dkv_out = _call(_dkv_kernel, (batch, cfg.kv_heads, cfg.blocks(cfg.block_kv_bwd)), [kv, kv],
                    cfg, "segment_attention_dkv_gpu", sched.qlo_bwd, sched.qhi_bwd,
                    _tokens(sched), q, k, v, do, lse, di)
    grads = (dq_out[0], dkv_out[0], dkv_out[1])
    if cfg.count_visits:
        return grads, dq_out[1], dkv_out[2]
    return grads
