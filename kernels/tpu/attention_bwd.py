"""Pallas TPU (Mosaic) backward kernels of segment attention: dq by query block, dk/dv by key block.

Both recompute `p = exp(s - lse)` from the forward's logsumexp and use `di = rowsum(do * o)`
(jnp, f32); `ds = p * (do v^T - di)`. They visit exactly the forward's pairs of blocks (with the
backward block sizes), skipping the others the same way: data-dependent index maps over a static
step axis of W steps (L / b, or the narrow grid when the ranges fit: tpu/attention.py) that
repeat the range's last block (no copy), and `pl.when` around the compute.

    dq   grid (B, H, nq, W), ("parallel",) * 3 + ("arbitrary",): step j of query block i
         visits key block lo_i + j (tpu/attention.py's schedule); dq += ds k * scale, in f32
         VMEM scratch, written at the last step.
    dkv  grid (B, K, nk, G, W), ("parallel",) * 3 + ("arbitrary",) * 2: key block k of key head
         kh is resident over the G query heads of its group and step j visits query block
         qlo_k + j of `transpose_ranges` (computed only if lo_i <= k < hi_i, so an empty query
         block inside the range costs no compute either). It works transposed, keys on rows
         (s^T = k q^T, (bk, bq)), as splash attention does: dv += p^T do and dk += ds^T q * scale
         are plain (bk, bq) @ (bq, D) products, with lse / di as (1, bq) rows.

Fused (AttentionBlockSizes.fused_bwd, the default where it fits): the dkv kernel also forms
dq += ds k at each pair, so the dq kernel does not run (5 block matmuls a pair instead of 7, one
exp pass instead of two). dq of the group's G heads stays resident in VMEM over the whole row,
an f32 scratch (G, nq * bq, D) zeroed at the row's first step and written, scaled, to an output
block of the whole row at its last; the key-block axis becomes "arbitrary" (a megacore chip
splits rows and key heads alone). Where that scratch and block pass FUSED_VMEM_SHARE of the
core's VMEM, or when counting visits, the two kernels run.

Worked example, the schedule module's row (bq = bk = 4, ranges [0,1) [0,2) [2,3) [2,4)): the dkv
kernel gets query ranges [0, 2) for key block 0, [1, 2) for 1, [2, 4) for 2 and [3, 4) for 3:
the same six pairs, grouped by key block.

Rows outside every segment (padding, rows past L of a partial block) are zeroed where they enter
a product: k in dq (ds k, in either kernel), q and do in dkv (ds^T q, p^T do); every other use
is masked by `where`.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from seqpack.kernels.attention_schedule import AttentionConfig, Schedule, step_block
from seqpack.kernels.tpu.attention import (
    NN,
    NT,
    count_visit,
    from_kernel,
    head_spec,
    kernel_shape,
    narrow_or_full,
    pair_mask,
    pair_steps,
    range_step,
    rows_in_segments,
    schedule_call,
    to_kernel,
)

# The fused backward runs where its resident dq (`fused_vmem_bytes`) takes at most
# FUSED_VMEM_SHARE of the core's VMEM, leaving the rest to the pipelined blocks, and asks for
# VMEM_LIMIT_SHARE of it as its scoped limit; DEFAULT_VMEM_BYTES stands for the capacity where
# no TPU is attached (interpret mode). The fused backward's measurements: benchmarks/README.md
# ("On the chip", fourth session).
FUSED_VMEM_SHARE = 3 / 8
VMEM_LIMIT_SHARE = 3 / 4
DEFAULT_VMEM_BYTES = 128 << 20


def _dq_kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, qs_ref, qe_ref,
               ks_ref, dq_ref, *rest, cfg: AttentionConfig, steps: int) -> None:
    # q, do, dq [bq, D]; k, v [bk, D]; lse, di f32[bq, 1]; qs, qe i32[bq, 1]; ks i32[bk, 1]
    visits_ref, acc_ref = (rest[0] if cfg.count_visits else None), rest[-1]
    bq, bk = cfg.block_q_bwd, cfg.block_kv_bwd
    i, j, lo, computed = range_step(lo_ref, hi_ref, cfg.blocks(bq))
    count_visit(visits_ref, j == 0, computed)

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def pair(diagonal: bool):
        k_base = (lo + j) * bk
        k = jnp.where(rows_in_segments(ks_ref[...], k_base), k_ref[...], 0)
        s = lax.dot_general(q_ref[...], k, NT, preferred_element_type=jnp.float32) * cfg.scale
        allowed = pair_mask(i * bq, k_base, qs_ref[...], qe_ref[...], (bq, bk), cfg.causal,
                            diagonal=diagonal)
        p = jnp.where(allowed, jnp.exp(s - lse_ref[...]), 0.0)
        dp = lax.dot_general(do_ref[...], v_ref[...], NT, preferred_element_type=jnp.float32)
        ds = jnp.where(allowed, p * (dp - di_ref[...]), 0.0)
        acc_ref[...] += lax.dot_general(ds.astype(k.dtype), k, NN,
                                        preferred_element_type=jnp.float32)

    pair_steps(pair, computed, (lo + j) * bk, i * bq, bk, cfg.causal)

    @pl.when(j == steps - 1)
    def _finish():
        dq_ref[...] = (acc_ref[...] * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(qlo_ref, qhi_ref, lo_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref,
                qs_row_ref, qe_row_ref, qs_ref, *rest, cfg: AttentionConfig, steps: int,
                fused: bool = False) -> None:
    # q, do [bq, D]; k, v, dk, dv [bk, D]; lse, di f32[1, bq]; qs_row, qe_row i32[1, bq];
    # qs i32[bq, 1]; rest: (fused: ks i32[bk, 1]), dk, dv, (fused: dq, the group's G heads over
    # the whole row), (visits), dk_acc, dv_acc f32[bk, D], (fused: dq_acc f32[G, nq * bq, D])
    if fused:
        ks_ref, dk_ref, dv_ref, dq_ref, *rest = rest
        dq_acc, rest = rest[-1], rest[:-1]
    else:
        ks_ref, dq_ref, dq_acc = None, None, None
        dk_ref, dv_ref, *rest = rest
    visits_ref, (dk_acc, dv_acc) = (rest[0] if cfg.count_visits else None), rest[-2:]
    b, kb, g, j = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    bq, bk = cfg.block_q_bwd, cfg.block_kv_bwd
    nq, nk = cfg.blocks(bq), cfg.blocks(bk)
    kidx = b * nk + kb
    qlo = qlo_ref[kidx]
    qb = qlo + j
    qidx = b * nq + jnp.minimum(qb, nq - 1)
    computed = (j < qhi_ref[kidx] - qlo) & (lo_ref[qidx] <= kb) & (kb < hi_ref[qidx])
    first = (g == 0) & (j == 0)
    count_visit(visits_ref, first, computed)

    @pl.when(first)
    def _init():
        dk_acc[...] = jnp.zeros(dk_acc.shape, jnp.float32)
        dv_acc[...] = jnp.zeros(dv_acc.shape, jnp.float32)

    if fused:  # dq of the group's heads accumulates over every key block of the row
        @pl.when((kb == 0) & first)
        def _init_dq():
            dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)

    def pair(diagonal: bool):
        q_base, k_base = qb * bq, kb * bk
        live = rows_in_segments(qs_ref[...], q_base)
        q = jnp.where(live, q_ref[...], 0)
        do = jnp.where(live, do_ref[...], 0)
        st = lax.dot_general(k_ref[...], q, NT, preferred_element_type=jnp.float32) * cfg.scale
        allowed = pair_mask(q_base, k_base, qs_row_ref[...], qe_row_ref[...], (bk, bq),
                            cfg.causal, keys_on_rows=True, diagonal=diagonal)
        pt = jnp.where(allowed, jnp.exp(st - lse_ref[...]), 0.0)
        dv_acc[...] += lax.dot_general(pt.astype(do.dtype), do, NN,
                                       preferred_element_type=jnp.float32)
        dpt = lax.dot_general(v_ref[...], do, NT, preferred_element_type=jnp.float32)
        dst = jnp.where(allowed, pt * (dpt - di_ref[...]), 0.0)
        dk_acc[...] += lax.dot_general(dst.astype(q.dtype), q, NN,
                                       preferred_element_type=jnp.float32)
        if fused:  # dq += ds k = (ds^T)^T k, key rows outside every segment zeroed; the
            # transpose in f32 before the cast, as splash attention's fused backward does
            k = jnp.where(rows_in_segments(ks_ref[...], k_base), k_ref[...], 0)
            rows = pl.ds(pl.multiple_of(q_base, bq), bq)
            dq_acc[g, rows, :] += lax.dot_general(dst.T.astype(k.dtype), k, NN,
                                                  preferred_element_type=jnp.float32)

    pair_steps(pair, computed, kb * bk, qb * bq, bk, cfg.causal)

    @pl.when((g == cfg.groups - 1) & (j == steps - 1))
    def _finish():
        dk_ref[...] = (dk_acc[...] * cfg.scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)

    if fused:
        @pl.when((kb == nk - 1) & (g == cfg.groups - 1) & (j == steps - 1))
        def _finish_dq():
            for h in range(cfg.groups):  # the block: the group's (G, L, D)
                dq_ref[h] = (dq_acc[h, :cfg.seq_len, :] * cfg.scale).astype(dq_ref.dtype)


def _dq(q, k, v, do, lse, di, sched: Schedule, cfg: AttentionConfig, steps: int):
    batch = q.shape[0]
    bq, bk = cfg.block_q_bwd, cfg.block_kv_bwd
    nq, nk, groups = cfg.blocks(bq), cfg.blocks(bk), cfg.groups

    def kv_block(b, i, j, lo_ref, hi_ref):
        return step_block(lo_ref[b * nq + i], hi_ref[b * nq + i], j, nk)

    q_spec = head_spec(cfg, bq, lambda b, h, i, j, *_: (b, h, i))
    kv_spec = head_spec(cfg, bk, lambda b, h, i, j, *refs: (b, lax.div(h, groups),
                                                             kv_block(b, i, j, *refs)))
    column = pl.BlockSpec((None, None, bq, 1), lambda b, h, i, j, *_: (b, h, i, 0))
    q_bounds = pl.BlockSpec((None, bq, 1), lambda b, h, i, j, *_: (b, i, 0))
    k_bounds = pl.BlockSpec((None, bk, 1), lambda b, h, i, j, *refs: (b, kv_block(b, i, j, *refs),
                                                                      0))
    start, end, k_live = (x[:, :, None] for x in (sched.start, sched.end, sched.k_live))
    outs = schedule_call(
        _dq_kernel, cfg, steps, (batch, cfg.heads, nq, steps), num_scalar_prefetch=2,
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, column, column, q_bounds, q_bounds, k_bounds],
        out_shapes=[kernel_shape(cfg, batch, cfg.heads, q.dtype)], out_specs=[q_spec],
        scratch_shapes=[pltpu.VMEM((bq, cfg.head_dim), jnp.float32)],
        name="segment_attention_dq",
    )(sched.lo_bwd.reshape(-1), sched.hi_bwd.reshape(-1), q, k, v, do, lse, di, start, end,
      k_live)
    return outs if cfg.count_visits else (outs[0],)


def _dkv(q, k, v, do, lse_row, di_row, sched: Schedule, cfg: AttentionConfig, steps: int,
         fused: bool = False):
    batch = q.shape[0]
    bq, bk = cfg.block_q_bwd, cfg.block_kv_bwd
    nq, nk, groups = cfg.blocks(bq), cfg.blocks(bk), cfg.groups

    def q_block(b, kb, j, qlo_ref, qhi_ref, *_):
        return step_block(qlo_ref[b * nk + kb], qhi_ref[b * nk + kb], j, nq)

    def q_index(b, kh, kb, g, j, *refs):
        return b, kh * groups + g, q_block(b, kb, j, *refs)

    q_spec = head_spec(cfg, bq, q_index)
    kv_spec = head_spec(cfg, bk, lambda b, kh, kb, g, j, *_: (b, kh, kb))
    row = pl.BlockSpec((None, None, 1, bq), lambda b, kh, kb, g, j, *refs: (
        b, kh * groups + g, 0, q_block(b, kb, j, *refs)))
    q_bounds_row = pl.BlockSpec((None, 1, bq), lambda b, kh, kb, g, j, *refs: (
        b, 0, q_block(b, kb, j, *refs)))
    q_bounds = pl.BlockSpec((None, bq, 1), lambda b, kh, kb, g, j, *refs: (
        b, q_block(b, kb, j, *refs), 0))
    kv_shape = kernel_shape(cfg, batch, cfg.kv_heads, k.dtype)
    start, end = sched.start[:, None, :], sched.end[:, None, :]
    in_specs = [q_spec, kv_spec, kv_spec, q_spec, row, row, q_bounds_row, q_bounds_row, q_bounds]
    out_shapes, out_specs = [kv_shape, kv_shape], [kv_spec, kv_spec]
    scratch = [pltpu.VMEM((bk, cfg.head_dim), jnp.float32)] * 2
    extra, options = [], {}
    if fused:  # + the keys' liveness; dq: the group's heads over the whole row, resident
        in_specs.append(pl.BlockSpec((None, bk, 1), lambda b, kh, kb, g, j, *_: (b, kb, 0)))
        extra.append(sched.k_live[:, :, None])
        out_shapes.append(kernel_shape(cfg, batch, cfg.heads, q.dtype))
        out_specs.append(pl.BlockSpec((None, groups, cfg.seq_len, cfg.head_dim),
                                      lambda b, kh, *_: (b, kh, 0, 0)))
        scratch = [*scratch, pltpu.VMEM((groups, nq * bq, cfg.head_dim), jnp.float32)]
        options = {"parallel_axes": 2, "fused": True,
                   "vmem_limit_bytes": int(VMEM_LIMIT_SHARE * vmem_capacity())}
    return schedule_call(
        _dkv_kernel, cfg, steps, (batch, cfg.kv_heads, nk, groups, steps), num_scalar_prefetch=4,
        in_specs=in_specs, out_shapes=out_shapes, out_specs=out_specs, scratch_shapes=scratch,
        name="segment_attention_dkv_dq" if fused else "segment_attention_dkv", **options,
    )(sched.qlo_bwd.reshape(-1), sched.qhi_bwd.reshape(-1), sched.lo_bwd.reshape(-1),
      sched.hi_bwd.reshape(-1), q, k, v, do, lse_row, di_row, start, end,
      sched.q_live[:, :, None], *extra)


def fused_vmem_bytes(cfg: AttentionConfig, dtype) -> int:
    """VMEM the fused backward's resident dq takes: the f32 accumulator of the group's heads
    over the row and the two buffers of its output block."""
    rows = cfg.blocks(cfg.block_q_bwd) * cfg.block_q_bwd
    return cfg.groups * cfg.head_dim * (4 * rows + 2 * jnp.dtype(dtype).itemsize * cfg.seq_len)


def vmem_capacity() -> int:
    """VMEM bytes of the attached TPU core (DEFAULT_VMEM_BYTES when none is attached)."""
    try:
        return int(pltpu.get_tpu_info().vmem_capacity_bytes)
    except Exception:  # noqa: BLE001 (no TPU: CPU interpret mode, or an unknown device kind)
        return DEFAULT_VMEM_BYTES


def fuses(cfg: AttentionConfig, dtype, capacity: int | None = None) -> bool:
    """Whether the backward forms dq in the dk/dv kernel: asked for, its resident dq within
    FUSED_VMEM_SHARE of the VMEM, and no visit counting (the counter reports the two kernels')."""
    capacity = vmem_capacity() if capacity is None else capacity
    return (cfg.fused_bwd and not cfg.count_visits
            and fused_vmem_bytes(cfg, dtype) <= FUSED_VMEM_SHARE * capacity)


def backward(q, k, v, o, lse, do, sched: Schedule, cfg: AttentionConfig):
    """-> dq, dk, dv like q, k, v (and visits of the dq, dkv kernels when counting).

    lse: f32[B, H, L, 1] from tpu/attention.py's forward.
    """
    batch = q.shape[0]
    di = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)  # [B, L, H]
    di = (di if cfg.operand == "bhld" else di.transpose(0, 2, 1))[..., None]  # [B, H, L, 1]
    qk, kk, vk, dok = (to_kernel(x, cfg) for x in (q, k, v, do))
    row = lambda x: x.reshape(batch, cfg.heads, 1, cfg.seq_len)  # noqa: E731
    fused = fuses(cfg, q.dtype)
    dkv_out = narrow_or_full(
        functools.partial(_dkv, qk, kk, vk, dok, row(lse), row(di), sched, cfg, fused=fused),
        sched.qhi_bwd - sched.qlo_bwd, cfg.blocks(cfg.block_q_bwd), cfg)
    if fused:
        return tuple(from_kernel(x, cfg) for x in (dkv_out[2], dkv_out[0], dkv_out[1]))
    dq_out = narrow_or_full(functools.partial(_dq, qk, kk, vk, dok, lse, di, sched, cfg),
                            sched.hi_bwd - sched.lo_bwd, cfg.blocks(cfg.block_kv_bwd), cfg)
    grads = (from_kernel(dq_out[0], cfg), from_kernel(dkv_out[0], cfg),
             from_kernel(dkv_out[1], cfg))
    if cfg.count_visits:
        return grads, dq_out[1][:, :, ::8, 0], dkv_out[2][:, :, ::8, 0]
    return grads
