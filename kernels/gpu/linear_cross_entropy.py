"""Pallas GPU (Triton) kernels of the fused loss head: per-token lse and target logit of
`hidden @ weight`, and their backward, with the logits recomputed tile by tile.

A logits tile `z [bl, bv]` is `sum_k x[:, k-chunk] @ w[k-chunk, :]` over `bh`-wide chunks of H
(`plgpu.dot`: bf16 inputs, f32 accumulation), loaded with masks, so rows past L or not counted,
chunks past H and columns past V read as 0 (NaN there reaches nothing). The backward has a chunk
width of its own (`block_hidden_bwd`): its `x^T da` has the chunk as its rows, and on Hopper a
dot becomes a wgmma only with 64 rows a warpgroup.

    forward   grid (B, L / bl)          online lse (m, s) and target logit over the V / bv tiles
    backward  grid (B, L / bl, V / bv)  da = (g_lse p + g_tgt onehot) softcap' for the tile, then
                                        for every chunk k of H:
                                          dx[rows, k] += da @ w[k, cols]^T      (atomic, f32)
                                          dw[k, cols] += x[rows, k]^T @ da      (atomic, f32)

8NHV FLOPs in all, as Apple's Cut Cross-Entropy: the tile's da is computed once and both
gradients are added into f32 sums with `atomic_add` (the order of the adds, hence the last bits of
dx and dw, varies between runs on a GPU). A token block with no counted token (padding, prompt)
loads nothing and skips its vocabulary loop (forward) or its whole tile (backward). The sums are
padded to whole tiles, so every add is in bounds (Pallas' interpreter has no masked atomics); the
padding receives zeros and is sliced off.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from seqpack.kernels.common import LossHeadTiling, varying_like


@dataclasses.dataclass(frozen=True)
class LinearTiling(LossHeadTiling):
    """Static configuration of the Triton kernels; tile edges are powers of two."""

    block_hidden: int = 64
    block_hidden_bwd: int = 64
    num_warps: int = 4
    interpret: bool = False


def _rows(mask_ref, b, t, st: LinearTiling):
    """Positions, in-row flags and counted flags [bl] of token block t."""
    bl = st.block_tokens
    rows = t * bl + jnp.arange(bl)
    row_ok = rows < st.seq_len
    counted = plgpu.load(mask_ref.at[b, pl.ds(t * bl, bl)], mask=row_ok, other=0.0) > 0.0
    return row_ok, counted


def _logits(x_ref, w_ref, b, t, v, counted, live, bh: int, st: LinearTiling):
    """(z f32[bl, bv] with -inf past V, raw softcapped z, column ids, column flags), H summed in
    chunks of bh; the H loop runs only when `live` (else z is 0)."""
    bl, bv = st.block_tokens, st.block_vocab
    dim = x_ref.shape[2]
    cols = v * bv + jnp.arange(bv)
    col_ok = cols < st.vocab

    def chunk(k, z):
        x, w = _chunks(x_ref, w_ref, b, t, v, k, counted, col_ok, bh, st)
        return z + plgpu.dot(x, w)

    chunks = pl.cdiv(dim, bh) * jnp.asarray(live, jnp.int32)  # i32: see cross_entropy.py
    raw = lax.fori_loop(0, chunks, chunk, jnp.zeros((bl, bv), jnp.float32))
    if st.softcap is not None:
        raw = st.softcap * jnp.tanh(raw / st.softcap)
    return jnp.where(col_ok[None, :], raw, -jnp.inf), raw, cols, col_ok


def _chunks(x_ref, w_ref, b, t, v, k, counted, col_ok, bh: int, st: LinearTiling):
    """x[rows of block t, chunk k] (0 off counted rows) and w[chunk k, columns of tile v]."""
    bl, bv = st.block_tokens, st.block_vocab
    h_ok = k * bh + jnp.arange(bh) < x_ref.shape[2]
    x = plgpu.load(x_ref.at[b, pl.ds(t * bl, bl), pl.ds(k * bh, bh)],
                   mask=counted[:, None] & h_ok[None, :], other=0.0)
    w = plgpu.load(w_ref.at[pl.ds(k * bh, bh), pl.ds(v * bv, bv)],
                   mask=h_ok[:, None] & col_ok[None, :], other=0.0)
    return x, w


def _forward_kernel(x_ref, w_ref, targets_ref, mask_ref, lse_ref, tgt_ref, *,
                    st: LinearTiling) -> None:
    b, t = pl.program_id(0), pl.program_id(1)
    bl = st.block_tokens
    row_ok, counted = _rows(mask_ref, b, t, st)
    targets = plgpu.load(targets_ref.at[b, pl.ds(t * bl, bl)], mask=row_ok, other=-1)

    def step(v, carry):
        m, s, tgt = carry
        z, raw, cols, _ = _logits(x_ref, w_ref, b, t, v, counted, True, st.block_hidden, st)
        m_new = jnp.maximum(m, jnp.max(z, axis=1))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - m_new[:, None]), axis=1)
        tgt = tgt + jnp.sum(jnp.where(cols[None, :] == targets[:, None], raw, 0.0), axis=1)
        return m_new, s, tgt

    tiles = pl.cdiv(st.vocab, st.block_vocab) * jnp.max(counted.astype(jnp.int32))
    init = (jnp.full((bl,), -jnp.inf, jnp.float32), jnp.zeros((bl,), jnp.float32),
            jnp.zeros((bl,), jnp.float32))
    m, s, tgt = lax.fori_loop(0, tiles, step, init)
    plgpu.store(lse_ref.at[b, pl.ds(t * bl, bl)], jnp.where(counted, m + jnp.log(s), 0.0),
                mask=row_ok)
    plgpu.store(tgt_ref.at[b, pl.ds(t * bl, bl)], jnp.where(counted, tgt, 0.0), mask=row_ok)


def _backward_kernel(x_ref, w_ref, targets_ref, mask_ref, lse_ref, gl_ref, gt_ref, _dx, _dw,
                     dx_ref, dw_ref, *, st: LinearTiling) -> None:
    b, t, v = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bl, bv, bh = st.block_tokens, st.block_vocab, st.block_hidden_bwd
    row_ok, counted = _rows(mask_ref, b, t, st)
    live = jnp.max(counted.astype(jnp.int32)) > 0
    column = lambda ref, other: plgpu.load(ref.at[b, pl.ds(t * bl, bl)], mask=row_ok,  # noqa
                                           other=other)
    z, raw, cols, col_ok = _logits(x_ref, w_ref, b, t, v, counted, live, bh, st)
    onehot = cols[None, :] == column(targets_ref, -1)[:, None]
    p = jnp.exp(z - column(lse_ref, 0.0)[:, None])
    da = column(gl_ref, 0.0)[:, None] * p + jnp.where(onehot, column(gt_ref, 0.0)[:, None], 0.0)
    if st.softcap is not None:
        da = da * (1.0 - jnp.square(raw / st.softcap))
    da = jnp.where(counted[:, None] & col_ok[None, :], da, 0.0).astype(x_ref.dtype)

    def chunk(k, carry):
        x, w = _chunks(x_ref, w_ref, b, t, v, k, counted, col_ok, bh, st)
        plgpu.atomic_add(dx_ref, (b, pl.ds(t * bl, bl), pl.ds(k * bh, bh)),
                         plgpu.dot(da, w, trans_b=True))
        plgpu.atomic_add(dw_ref, (pl.ds(k * bh, bh), pl.ds(v * bv, bv)),
                         plgpu.dot(x, da, trans_a=True))
        return carry

    lax.fori_loop(0, pl.cdiv(x_ref.shape[2], bh) * jnp.asarray(live, jnp.int32), chunk, 0)


def linear_forward(x, w, targets, mask, *, st: LinearTiling):
    """x f[B, L, H], w f[H, V], targets i32[B, L], mask f32[B, L] -> lse, target logit f32[B, L]
    (0 on uncounted tokens)."""
    batch = x.shape[0]
    col = jax.ShapeDtypeStruct((batch, st.seq_len), jnp.float32)
    return pl.pallas_call(
        functools.partial(_forward_kernel, st=st),
        out_shape=tuple(varying_like([col, col], x, w, targets)),
        grid=(batch, pl.cdiv(st.seq_len, st.block_tokens)),
        compiler_params=plgpu.CompilerParams(num_warps=st.num_warps, num_stages=2),
        interpret=st.interpret, name="segment_linear_cross_entropy_fwd_gpu",
    )(x, w, targets, mask)


def linear_backward(x, w, targets, mask, lse, g_lse, g_tgt, *, st: LinearTiling):
    """-> dx x.dtype[B, L, H], dw w.dtype[H, V], summed in f32 (tile-padded, then sliced)."""
    (batch, seq_len, dim), vocab = x.shape, w.shape[1]
    up = lambda n, b: pl.cdiv(n, b) * b  # noqa: E731
    bh = st.block_hidden_bwd
    shapes = ((batch, up(seq_len, st.block_tokens), up(dim, bh)),
              (up(dim, bh), up(vocab, st.block_vocab)))
    args = (x, w, targets, mask, lse, g_lse, g_tgt)
    zeros = [jnp.zeros(shape, jnp.float32) for shape in shapes]
    dx, dw = pl.pallas_call(
        functools.partial(_backward_kernel, st=st),
        out_shape=tuple(varying_like([jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes],
                                     *args)),
        grid=(batch, pl.cdiv(seq_len, st.block_tokens), pl.cdiv(vocab, st.block_vocab)),
        input_output_aliases={len(args): 0, len(args) + 1: 1},
        compiler_params=plgpu.CompilerParams(num_warps=st.num_warps, num_stages=2),
        interpret=st.interpret, name="segment_linear_cross_entropy_bwd_gpu",
    )(*args, *zeros)
    return dx[:, :seq_len, :dim].astype(x.dtype), dw[:dim, :vocab].astype(w.dtype)
