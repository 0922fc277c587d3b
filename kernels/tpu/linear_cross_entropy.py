"""Pallas TPU kernels of the fused loss head: per-token lse and target logit of `hidden @ weight`.

Three kernels, each recomputing `z = softcap(x_blk @ w_blk)` on the MXU (bf16 inputs stay bf16,
`preferred_element_type=f32`) for a `[bl, bv]` tile, so no logits leave VMEM:

    forward  grid (B, L / bl, V / bv)  par, par, arb   online lse (m, s) and target logit in
                                                        [bl, 1] scratch; lse, target out at the
                                                        last vocab tile
    dhidden  grid (B, L / bl, V / bv)  par, par, arb   da = (g_lse p + g_tgt onehot) softcap';
                                                        dx += da @ w_blk^T in an f32 [bl, H] scratch
    dweight  grid (V / bv, B, L / bl)  par, arb, arb   dw += x_blk^T @ da in an f32 [H, bv] scratch

(10NHV FLOPs in all against XLA's 8NHV: the two backward kernels each recompute the logits, so
neither accumulates across a "parallel" axis.) Three arrays are scalar-prefetched: each row's
used length `used[b]` (metadata.row_ends), and per token block `live[b * T + t]` (any counted
token in it) and `src[b * T + t]` (the block itself when live, else the last live block before
it). A step whose token block lies past the row's used length or holds no counted token (prompt
tokens under a loss mask) computes nothing, and its index maps repeat the previous step's
blocks (`src`, the last vocab tile), so it fetches nothing either.

NaN safety: rows of a tile past L or not counted, and columns past V, are removed with `where`
before anything sums over them (x rows before `x^T @ da`, w columns before `da @ w^T`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from seqpack.kernels.common import Interpret, LossHeadTiling, varying_like

VMEM_LIMIT_BYTES = 64 * 1024 * 1024  # x, w tiles double-buffered + an f32 [H, bv] accumulator


@dataclasses.dataclass(frozen=True)
class LinearTiling(LossHeadTiling):
    """Static configuration of the TPU kernels."""

    interpret: Interpret = False

    @property
    def tokens_blocks(self) -> int:
        return pl.cdiv(self.seq_len, self.block_tokens)

    @property
    def vocab_blocks(self) -> int:
        return pl.cdiv(self.vocab, self.block_vocab)

    def skipped(self, b, t, used_ref, live_ref):
        return (t * self.block_tokens >= used_ref[b]) | (live_ref[b * self.tokens_blocks + t] == 0)

    def tokens_index(self, b, t, v, used_ref, live_ref, src_ref):
        """(b, src, 0): a skipped block repeats the last live one's (no DMA)."""
        return b, src_ref[b * self.tokens_blocks + t], 0

    def weight_index(self, b, t, v, used_ref, live_ref, src_ref):
        return 0, jnp.where(self.skipped(b, t, used_ref, live_ref), self.vocab_blocks - 1, v)


def _tile(x_ref, w_ref, targets_ref, mask_ref, t, v, st: LinearTiling):
    """(z f32[bl, bv] with -inf past V, raw softcapped z, onehot, live rows [bl, 1], w tile)."""
    bl, bv = x_ref.shape[0], w_ref.shape[1]
    cols = v * bv + lax.broadcasted_iota(jnp.int32, (1, bv), 1)
    rows = t * bl + lax.broadcasted_iota(jnp.int32, (bl, 1), 0)
    live = (rows < st.seq_len) & (mask_ref[...] > 0)
    col_ok = cols < st.vocab
    w = jnp.where(col_ok, w_ref[...], jnp.zeros((), w_ref.dtype))
    x = jnp.where(live, x_ref[...], jnp.zeros((), x_ref.dtype))
    raw = jnp.dot(x, w, preferred_element_type=jnp.float32)
    if st.softcap is not None:
        raw = st.softcap * jnp.tanh(raw / st.softcap)
    onehot = cols == targets_ref[...]
    return jnp.where(col_ok, raw, -jnp.inf), raw, onehot, live & col_ok, x, w


def _forward_kernel(used_ref, live_ref, src_ref, x_ref, w_ref, targets_ref, mask_ref, lse_ref,
                    tgt_ref, m_sc, s_sc, t_sc, *, st: LinearTiling) -> None:
    b, t, v = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    skipped = st.skipped(b, t, used_ref, live_ref)

    @pl.when(v == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        s_sc[...] = jnp.zeros(s_sc.shape, jnp.float32)
        t_sc[...] = jnp.zeros(t_sc.shape, jnp.float32)

    @pl.when(jnp.logical_not(skipped))
    def _online_lse():
        z, raw, onehot, _, _, _ = _tile(x_ref, w_ref, targets_ref, mask_ref, t, v, st)
        m_prev = m_sc[...]
        m_new = jnp.maximum(m_prev, jnp.max(z, axis=1, keepdims=True))
        s_sc[...] = s_sc[...] * jnp.exp(m_prev - m_new) + jnp.sum(jnp.exp(z - m_new), axis=1,
                                                                  keepdims=True)
        t_sc[...] += jnp.sum(jnp.where(onehot, raw, 0.0), axis=1, keepdims=True)
        m_sc[...] = m_new

    @pl.when(v == st.vocab_blocks - 1)
    def _write():
        keep = jnp.logical_not(skipped) & (mask_ref[...] > 0)
        lse_ref[...] = jnp.where(keep, m_sc[...] + jnp.log(s_sc[...]), 0.0)
        tgt_ref[...] = jnp.where(keep, t_sc[...], 0.0)


def _grad_tile(x_ref, w_ref, targets_ref, mask_ref, lse_ref, gl_ref, gt_ref, t, v, st):
    """da f32[bl, bv] (0 off live rows and valid columns), with the zero-masked x and w tiles."""
    z, raw, onehot, ok, x, w = _tile(x_ref, w_ref, targets_ref, mask_ref, t, v, st)
    da = gl_ref[...] * jnp.exp(z - lse_ref[...]) + jnp.where(onehot, gt_ref[...], 0.0)
    if st.softcap is not None:
        da = da * (1.0 - jnp.square(raw / st.softcap))
    return jnp.where(ok, da, 0.0).astype(x.dtype), x, w


def _backward_kernel(used_ref, live_ref, src_ref, x_ref, w_ref, targets_ref, mask_ref, lse_ref,
                     gl_ref, gt_ref, out_ref, acc, *, st: LinearTiling, wrt: str) -> None:
    """dhidden (grid b, t, v: dx += da @ w^T over v) or dweight (grid v, b, t: dw += x^T @ da
    over b, t), summed in the f32 scratch `acc` and written at the last step of the sum."""
    if wrt == "hidden":
        b, t, v = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        first, last = v == 0, v == st.vocab_blocks - 1
    else:
        v, b, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        first = (b == 0) & (t == 0)
        last = (b == pl.num_programs(1) - 1) & (t == st.tokens_blocks - 1)

    @pl.when(first)
    def _init():
        acc[...] = jnp.zeros(acc.shape, jnp.float32)

    @pl.when(jnp.logical_not(st.skipped(b, t, used_ref, live_ref)))
    def _accumulate():
        da, x, w = _grad_tile(x_ref, w_ref, targets_ref, mask_ref, lse_ref, gl_ref, gt_ref, t, v,
                              st)
        lhs, rhs, dims = (da, w, ((1,), (1,))) if wrt == "hidden" else (x, da, ((0,), (0,)))
        acc[...] += lax.dot_general(lhs, rhs, (dims, ((), ())),
                                    preferred_element_type=jnp.float32)

    @pl.when(last)
    def _write():
        out_ref[...] = acc[...].astype(out_ref.dtype)


def _specs(st: LinearTiling, dim: int, n_columns: int, order: str):
    """BlockSpecs of x, w and `n_columns` [B, L, 1] columns on grid (b, t, v) or (v, b, t)."""
    def grid_bt(f):
        if order == "btv":
            return f
        return lambda v, b, t, *refs: f(b, t, v, *refs)

    column = pl.BlockSpec((None, st.block_tokens, 1), grid_bt(st.tokens_index))
    # dweight keeps its vocab tile for all (b, t): a skipped step must not move it either
    weight = grid_bt(st.weight_index) if order == "btv" else lambda v, b, t, *_: (0, v)
    return [pl.BlockSpec((None, st.block_tokens, dim), grid_bt(st.tokens_index)),
            pl.BlockSpec((dim, st.block_vocab), weight)] + [column] * n_columns


def _call(kernel, name, st: LinearTiling, x, w, order, out_spec, out_shape, scratch, flops,
          semantics, meta, columns):
    batch, _, dim = x.shape
    grid = ((batch, st.tokens_blocks, st.vocab_blocks) if order == "btv"
            else (st.vocab_blocks, batch, st.tokens_blocks))
    n = batch * st.seq_len
    shapes = varying_like(list(out_shape) if isinstance(out_shape, tuple) else [out_shape], x, w,
                          *columns)
    out_shape = tuple(shapes) if isinstance(out_shape, tuple) else shapes[0]
    return pl.pallas_call(
        functools.partial(kernel, st=st), out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=grid, in_specs=_specs(st, dim, len(columns), order),
            out_specs=out_spec, scratch_shapes=scratch),
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics,
                                             vmem_limit_bytes=VMEM_LIMIT_BYTES),
        cost_estimate=pl.CostEstimate(
            flops=flops * n * dim * st.vocab, transcendentals=n * st.vocab,
            bytes_accessed=x.nbytes * st.vocab_blocks + w.nbytes * batch * st.tokens_blocks),
        interpret=st.interpret, name=name,
    )(*meta, x, w, *columns)


def linear_forward(x, w, targets, mask, meta, *, st: LinearTiling):
    """x f[B, L, H], w f[H, V], targets i32[B, L, 1], mask f32[B, L, 1], meta (used, live, src)
    -> lse, target logit f32[B, L, 1] (0 on uncounted tokens)."""
    batch, bl = x.shape[0], st.block_tokens
    col = jax.ShapeDtypeStruct((batch, st.seq_len, 1), jnp.float32)
    out = pl.BlockSpec((None, bl, 1), lambda b, t, v, *_: (b, t, 0))
    return _call(_forward_kernel, "segment_linear_cross_entropy_fwd", st, x, w, "btv",
                 [out, out], (col, col), [pltpu.VMEM((bl, 1), jnp.float32)] * 3, 2,
                 ("parallel", "parallel", "arbitrary"), meta, (targets, mask))


def linear_backward(x, w, targets, mask, lse, g_lse, g_tgt, meta, *, st: LinearTiling):
    """-> dx x.dtype[B, L, H], dw w.dtype[H, V]; accumulated in f32 scratch."""
    batch, _, dim = x.shape
    bl, bv = st.block_tokens, st.block_vocab
    columns = (targets, mask, lse, g_lse, g_tgt)
    dx = _call(functools.partial(_backward_kernel, wrt="hidden"),
               "segment_linear_cross_entropy_dhidden", st, x, w, "btv",
               pl.BlockSpec((None, bl, dim), lambda b, t, v, *_: (b, t, 0)),
               jax.ShapeDtypeStruct(x.shape, x.dtype), [pltpu.VMEM((bl, dim), jnp.float32)], 4,
               ("parallel", "parallel", "arbitrary"), meta, columns)
    dw = _call(functools.partial(_backward_kernel, wrt="weight"),
               "segment_linear_cross_entropy_dweight", st, x, w, "vbt",
               pl.BlockSpec((dim, bv), lambda v, b, t, *_: (0, v)),
               jax.ShapeDtypeStruct(w.shape, w.dtype), [pltpu.VMEM((dim, bv), jnp.float32)], 4,
               ("parallel", "arbitrary", "arbitrary"), meta, columns)
    return dx, dw
