"""Pallas GPU (Triton) kernels of the fused loss head: per-token lse and target logit of
`hidden @ weight`, and their backward, with the logits recomputed tile by tile.

A logits tile `z [bl, bv]` is `sum_k x[:, k-chunk] @ w[k-chunk, :]` over `bh`-wide chunks of H
(`plgpu.dot`: bf16 inputs, f32 accumulation), loaded with masks, so rows past L or not counted,
chunks past H and columns past V read as 0 (NaN there reaches nothing).

    forward  grid (B, L / bl)   online lse (m, s) and target logit over the V / bv tiles; a block
                                with no counted token (padding, prompt) skips the vocabulary loop
    dhidden  grid (B, L / bl)   per tile da = (g_lse p + g_tgt onehot) softcap', then
                                dx[rows, k-chunk] += da @ w[k-chunk, :]^T for every chunk
    dweight  grid (V / bv,)     over every token block with a counted token:
                                dw[k-chunk, cols] += x[:, k-chunk]^T @ da

Each program owns the rows (dhidden) or columns (dweight) it adds into, and adds in program
order, so the f32 sums are deterministic; the adds are `atomic_add` only so that the
read-modify-write of one program is coherent across its threads. The sums are padded to whole
tiles and sliced after. 10NHV FLOPs in all (the
backward kernels each recompute the logits), as on TPU.
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
    num_warps: int = 4
    interpret: bool = False


def _rows(mask_ref, b, t, st: LinearTiling):
    """Positions, in-row flags and counted flags [bl] of token block t."""
    bl = st.block_tokens
    rows = t * bl + jnp.arange(bl)
    row_ok = rows < st.seq_len
    counted = plgpu.load(mask_ref.at[b, pl.ds(t * bl, bl)], mask=row_ok, other=0.0) > 0.0
    return row_ok, counted


def _logits(x_ref, w_ref, b, t, v, counted, st: LinearTiling):
    """(z f32[bl, bv] with -inf past V, raw softcapped z, column ids, column flags)."""
    bl, bv, bh = st.block_tokens, st.block_vocab, st.block_hidden
    dim = x_ref.shape[2]
    cols = v * bv + jnp.arange(bv)
    col_ok = cols < st.vocab

    def chunk(k, z):
        hs = k * bh + jnp.arange(bh)
        h_ok = hs < dim
        x = plgpu.load(x_ref.at[b, pl.ds(t * bl, bl), pl.ds(k * bh, bh)],
                       mask=counted[:, None] & h_ok[None, :], other=0.0)
        w = plgpu.load(w_ref.at[pl.ds(k * bh, bh), pl.ds(v * bv, bv)],
                       mask=h_ok[:, None] & col_ok[None, :], other=0.0)
        return z + plgpu.dot(x, w)

    raw = lax.fori_loop(0, pl.cdiv(dim, bh), chunk, jnp.zeros((bl, bv), jnp.float32))
    if st.softcap is not None:
        raw = st.softcap * jnp.tanh(raw / st.softcap)
    return jnp.where(col_ok[None, :], raw, -jnp.inf), raw, cols, col_ok


def _forward_kernel(x_ref, w_ref, targets_ref, mask_ref, lse_ref, tgt_ref, *,
                    st: LinearTiling) -> None:
    b, t = pl.program_id(0), pl.program_id(1)
    bl = st.block_tokens
    row_ok, counted = _rows(mask_ref, b, t, st)
    targets = plgpu.load(targets_ref.at[b, pl.ds(t * bl, bl)], mask=row_ok, other=-1)

    def step(v, carry):
        m, s, tgt = carry
        z, raw, cols, _ = _logits(x_ref, w_ref, b, t, v, counted, st)
        m_new = jnp.maximum(m, jnp.max(z, axis=1))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - m_new[:, None]), axis=1)
        tgt = tgt + jnp.sum(jnp.where(cols[None, :] == targets[:, None], raw, 0.0), axis=1)
        return m_new, s, tgt

    tiles = jnp.where(jnp.max(counted.astype(jnp.int32)) > 0, pl.cdiv(st.vocab, st.block_vocab),
                      0)
    init = (jnp.full((bl,), -jnp.inf, jnp.float32), jnp.zeros((bl,), jnp.float32),
            jnp.zeros((bl,), jnp.float32))
    m, s, tgt = lax.fori_loop(0, tiles, step, init)
    plgpu.store(lse_ref.at[b, pl.ds(t * bl, bl)], jnp.where(counted, m + jnp.log(s), 0.0),
                mask=row_ok)
    plgpu.store(tgt_ref.at[b, pl.ds(t * bl, bl)], jnp.where(counted, tgt, 0.0), mask=row_ok)


def _da(x_ref, w_ref, targets_ref, mask_ref, lse_ref, gl_ref, gt_ref, b, t, v, st):
    """da [bl, bv] in x's dtype (0 off counted rows and valid columns) and the counted rows."""
    bl = st.block_tokens
    row_ok, counted = _rows(mask_ref, b, t, st)
    column = lambda ref, other: plgpu.load(ref.at[b, pl.ds(t * bl, bl)], mask=row_ok,  # noqa
                                           other=other)
    z, raw, cols, col_ok = _logits(x_ref, w_ref, b, t, v, counted, st)
    onehot = cols[None, :] == column(targets_ref, -1)[:, None]
    p = jnp.exp(z - column(lse_ref, 0.0)[:, None])
    da = column(gl_ref, 0.0)[:, None] * p + jnp.where(onehot, column(gt_ref, 0.0)[:, None], 0.0)
    if st.softcap is not None:
        da = da * (1.0 - jnp.square(raw / st.softcap))
    ok = counted[:, None] & col_ok[None, :]
    return jnp.where(ok, da, 0.0).astype(x_ref.dtype), row_ok, counted, col_ok


def _dhidden_kernel(x_ref, w_ref, targets_ref, mask_ref, lse_ref, gl_ref, gt_ref, _, dx_ref, *,
                    st: LinearTiling) -> None:
    b, t = pl.program_id(0), pl.program_id(1)
    bl, bv, bh = st.block_tokens, st.block_vocab, st.block_hidden
    dim = x_ref.shape[2]
    _, counted = _rows(mask_ref, b, t, st)

    def vocab_tile(v, carry):
        da, _, _, col_ok = _da(x_ref, w_ref, targets_ref, mask_ref, lse_ref, gl_ref, gt_ref,
                                    b, t, v, st)

        def chunk(k, c):
            h_ok = k * bh + jnp.arange(bh) < dim
            w = plgpu.load(w_ref.at[pl.ds(k * bh, bh), pl.ds(v * bv, bv)],
                           mask=h_ok[:, None] & col_ok[None, :], other=0.0)
            plgpu.atomic_add(dx_ref, (b, pl.ds(t * bl, bl), pl.ds(k * bh, bh)),
                             plgpu.dot(da, w, trans_b=True))
            return c

        return lax.fori_loop(0, pl.cdiv(dim, bh), chunk, carry)

    tiles = jnp.where(jnp.max(counted.astype(jnp.int32)) > 0, pl.cdiv(st.vocab, bv), 0)
    lax.fori_loop(0, tiles, vocab_tile, 0)


def _dweight_kernel(x_ref, w_ref, targets_ref, mask_ref, lse_ref, gl_ref, gt_ref, _, dw_ref, *,
                    st: LinearTiling) -> None:
    v = pl.program_id(0)
    bl, bv, bh = st.block_tokens, st.block_vocab, st.block_hidden
    batch, _, dim = x_ref.shape
    blocks = pl.cdiv(st.seq_len, bl)

    def token_block(i, carry):
        b, t = lax.div(i, blocks), lax.rem(i, blocks)
        da, _, counted, _ = _da(x_ref, w_ref, targets_ref, mask_ref, lse_ref, gl_ref, gt_ref,
                                     b, t, v, st)

        def chunk(k, c):
            h_ok = k * bh + jnp.arange(bh) < dim
            x = plgpu.load(x_ref.at[b, pl.ds(t * bl, bl), pl.ds(k * bh, bh)],
                           mask=counted[:, None] & h_ok[None, :], other=0.0)
            plgpu.atomic_add(dw_ref, (pl.ds(k * bh, bh), pl.ds(v * bv, bv)),
                             plgpu.dot(x, da, trans_a=True))
            return c

        live = jnp.max(counted.astype(jnp.int32)) > 0
        return lax.fori_loop(0, jnp.where(live, pl.cdiv(dim, bh), 0), chunk, carry)

    lax.fori_loop(0, batch * blocks, token_block, 0)


def _launch(kernel, name, grid, shape, st: LinearTiling, *args):
    """A kernel adding into f32 zeros of `shape` (aliased as the last input)."""
    out = jnp.zeros(shape, jnp.float32)
    shape = varying_like([jax.ShapeDtypeStruct(shape, jnp.float32)], *args)[0]
    return pl.pallas_call(
        functools.partial(kernel, st=st), out_shape=shape, grid=grid,
        input_output_aliases={len(args): 0},
        compiler_params=plgpu.CompilerParams(num_warps=st.num_warps, num_stages=2),
        interpret=st.interpret, name=name)(*args, out)


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
    """-> dx x.dtype[B, L, H], dw w.dtype[H, V], summed in f32.

    The sums are padded to whole tiles, so every add is in bounds (Pallas' interpreter has no
    masked atomics); the padding receives zeros (da is 0 off counted rows and valid columns) and
    is sliced off.
    """
    (batch, seq_len, dim), vocab = x.shape, w.shape[1]
    up = lambda n, b: pl.cdiv(n, b) * b  # noqa: E731
    args = (x, w, targets, mask, lse, g_lse, g_tgt)
    dx = _launch(_dhidden_kernel, "segment_linear_cross_entropy_dhidden_gpu",
                 (batch, pl.cdiv(seq_len, st.block_tokens)),
                 (batch, up(seq_len, st.block_tokens), up(dim, st.block_hidden)), st, *args)
    dw = _launch(_dweight_kernel, "segment_linear_cross_entropy_dweight_gpu",
                 (pl.cdiv(vocab, st.block_vocab),),
                 (up(dim, st.block_hidden), up(vocab, st.block_vocab)), st, *args)
    return (dx[:, :seq_len, :dim].astype(x.dtype), dw[:dim, :vocab].astype(w.dtype))
