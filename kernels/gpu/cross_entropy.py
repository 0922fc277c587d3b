"""Pallas GPU (Triton) kernels of the per-segment cross-entropy, forward and backward.

The logits are read tile by tile in their own dtype and never copied: no f32 `[B, L, V]` array
exists at any point (the backward writes dlogits in the logits' dtype, the only `[B, L, V]` output).

Forward, grid `(B, L / bl)`: a program takes `bl` tokens of a row, finds each token's slots with a
`[bl, sp]` compare against the row's segment starts and ends (`common.slot_membership`; a
length-0 slot covers nothing), and runs an online log-sum-exp over `[bl, bv]` logits tiles (running
max `m`, rescaled sum `s`, target logit picked by an iota compare). Tokens not counted (padding,
`loss_mask` 0) are masked out of every load, so their logits are never read (NaN there is
harmless); a block without counted tokens skips the vocabulary loop. It writes the per-token lse
(the backward's residual) and its `[sp]` partial sums of loss and counted tokens per slot, which
jnp adds over the `L / bl` blocks (deterministic, no atomics).

Backward, grid `(B, L / bl, V / bv)`: per-token weights `w = g_loss[slot] * counted` come from the
same membership compare (no broadcast kernel), and each tile is
`w * ((1 + 2 z_loss lse) * exp(x - lse) - onehot(target))`; rows with `w == 0` read nothing and
get 0. Every element of dlogits is written.

Example, bl = 4, row segments (0, 3) and (3, 2), L = 8: block 0 covers tokens 0..3 -> slot 0 gets
tokens 0..2, slot 1 token 3; block 1 (tokens 4..7) -> slot 1 token 4, tokens 5..7 uncounted.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from seqpack.kernels.common import GpuBlockSizes, slot_membership, tile, triton_call


def _counted_tokens(offsets_ref, lengths_ref, mask_ref, b, t, bl, seq_len):
    """Positions, in-row flags, slot membership [bl, sp] and counted flags [bl] of block t."""
    rows = t * bl + jnp.arange(bl)
    row_ok = rows < seq_len
    member = slot_membership(offsets_ref, lengths_ref, b, rows)
    in_mask = plgpu.load(mask_ref.at[b, pl.ds(t * bl, bl)], mask=row_ok, other=0.0) > 0.0
    counted = (jnp.max(member.astype(jnp.int32), axis=1) > 0) & in_mask & row_ok
    return rows, row_ok, member, counted


def _forward_kernel(offsets_ref, lengths_ref, logits_ref, targets_ref, mask_ref, lse_ref,
                    loss_ref, count_ref, *, seq_len: int, vocab: int, z_loss: float, bl: int,
                    bv: int) -> None:
    # offsets, lengths i32[B, sp]; logits [B, L, V]; targets i32[B, L]; mask f32[B, L];
    # lse f32[B, L]; loss, count f32[B, L / bl, sp]
    b, t = pl.program_id(0), pl.program_id(1)
    _, row_ok, member, counted = _counted_tokens(offsets_ref, lengths_ref, mask_ref, b, t, bl,
                                                 seq_len)
    targets = plgpu.load(targets_ref.at[b, pl.ds(t * bl, bl)], mask=row_ok, other=0)

    def step(v, carry):
        m, s, tgt = carry
        cols = v * bv + jnp.arange(bv)
        col_ok = cols < vocab
        x = plgpu.load(logits_ref.at[b, pl.ds(t * bl, bl), pl.ds(v * bv, bv)],
                       mask=counted[:, None] & col_ok[None, :], other=0.0).astype(jnp.float32)
        x = jnp.where(col_ok[None, :], x, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(x, axis=1))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(x - m_new[:, None]), axis=1)
        tgt = tgt + jnp.sum(jnp.where(cols[None, :] == targets[:, None], x, 0.0), axis=1)
        return m_new, s, tgt

    # A trip count as i32 arithmetic: Pallas's Triton lowering of `jnp.where(pred, n, 0)` on
    # Python ints types both constants like the predicate (i1), an scf.for Triton refuses.
    num_tiles = pl.cdiv(vocab, bv) * jnp.max(counted.astype(jnp.int32))
    init = (jnp.full((bl,), -jnp.inf, jnp.float32), jnp.zeros((bl,), jnp.float32),
            jnp.zeros((bl,), jnp.float32))
    m, s, tgt = jax.lax.fori_loop(0, num_tiles, step, init)
    lse = jnp.where(counted, m + jnp.log(s), 0.0)
    token_loss = lse - tgt + z_loss * lse * lse
    keep = member & counted[:, None]
    plgpu.store(lse_ref.at[b, pl.ds(t * bl, bl)], lse, mask=row_ok)
    sp = loss_ref.shape[2]
    loss_ref[b, t, pl.ds(0, sp)] = jnp.sum(jnp.where(keep, token_loss[:, None], 0.0), axis=0)
    count_ref[b, t, pl.ds(0, sp)] = jnp.sum(jnp.where(keep, 1.0, 0.0), axis=0)


def forward_call(
    logits: jax.Array,  # f[B, L, V]
    targets: jax.Array,  # i32[B, L]
    mask: jax.Array,  # f32[B, L], 1 where the loss counts
    offsets: jax.Array,  # i32[B, sp], metadata.padded_metadata
    lengths: jax.Array,  # i32[B, sp]
    *,
    num_segments: int,
    z_loss: float,
    blocks: GpuBlockSizes,
    interpret: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # loss f32[B, S], count f32[B, S], lse f32[B, L]
    batch, seq_len, vocab = logits.shape
    bl, bv = tile(seq_len, blocks.ce_block_tokens), tile(vocab, blocks.block_vocab)
    num_blocks, sp = pl.cdiv(seq_len, bl), offsets.shape[1]
    kernel = functools.partial(_forward_kernel, seq_len=seq_len, vocab=vocab, z_loss=z_loss,
                               bl=bl, bv=bv)
    partial_sums = jax.ShapeDtypeStruct((batch, num_blocks, sp), jnp.float32)
    lse, loss, count = triton_call(
        kernel, out_shape=(jax.ShapeDtypeStruct((batch, seq_len), jnp.float32), partial_sums,
                           partial_sums),
        grid=(batch, num_blocks), num_warps=blocks.num_warps, interpret=interpret,
        name="segment_cross_entropy_fwd_gpu",
    )(offsets, lengths, logits, targets, mask)
    return loss.sum(1)[:, :num_segments], count.sum(1)[:, :num_segments], lse


def _backward_kernel(offsets_ref, lengths_ref, logits_ref, targets_ref, mask_ref, lse_ref,
                     g_ref, dl_ref, *, seq_len: int, vocab: int, z_loss: float, bl: int,
                     bv: int) -> None:
    # logits, dl [B, L, V]; targets i32[B, L]; mask, lse f32[B, L]; g f32[B, sp]
    b, t, v = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    _, row_ok, member, counted = _counted_tokens(offsets_ref, lengths_ref, mask_ref, b, t, bl,
                                                 seq_len)
    g = g_ref[b, pl.ds(0, g_ref.shape[1])]
    w = jnp.where(counted, jnp.sum(jnp.where(member, g[None, :], 0.0), axis=1), 0.0)
    live = w != 0.0
    targets = plgpu.load(targets_ref.at[b, pl.ds(t * bl, bl)], mask=row_ok, other=0)
    lse = plgpu.load(lse_ref.at[b, pl.ds(t * bl, bl)], mask=row_ok, other=0.0)
    cols = v * bv + jnp.arange(bv)
    col_ok = cols < vocab
    tile_ref = logits_ref.at[b, pl.ds(t * bl, bl), pl.ds(v * bv, bv)]
    x = plgpu.load(tile_ref, mask=live[:, None] & col_ok[None, :], other=0.0).astype(jnp.float32)
    probs = jnp.exp(x - lse[:, None]) * (1.0 + 2.0 * z_loss * lse)[:, None]
    grad = probs - jnp.where(cols[None, :] == targets[:, None], 1.0, 0.0)
    out = jnp.where(live[:, None], w[:, None] * grad, 0.0)
    plgpu.store(dl_ref.at[b, pl.ds(t * bl, bl), pl.ds(v * bv, bv)], out.astype(dl_ref.dtype),
                mask=row_ok[:, None] & col_ok[None, :])


def backward_call(
    logits: jax.Array,  # f[B, L, V]
    targets: jax.Array,  # i32[B, L]
    mask: jax.Array,  # f32[B, L]
    lse: jax.Array,  # f32[B, L], from forward_call
    g_loss: jax.Array,  # f32[B, S], cotangent of the per-slot loss sums
    offsets: jax.Array,  # i32[B, sp]
    lengths: jax.Array,  # i32[B, sp]
    *,
    z_loss: float,
    blocks: GpuBlockSizes,
    interpret: bool,
) -> jax.Array:  # dlogits, logits.dtype[B, L, V]
    batch, seq_len, vocab = logits.shape
    bl, bv = tile(seq_len, blocks.ce_block_tokens), tile(vocab, blocks.block_vocab)
    g = jnp.pad(g_loss.astype(jnp.float32), ((0, 0), (0, offsets.shape[1] - g_loss.shape[1])))
    kernel = functools.partial(_backward_kernel, seq_len=seq_len, vocab=vocab, z_loss=z_loss,
                               bl=bl, bv=bv)
    return triton_call(
        kernel, out_shape=jax.ShapeDtypeStruct(logits.shape, logits.dtype),
        grid=(batch, pl.cdiv(seq_len, bl), pl.cdiv(vocab, bv)), num_warps=blocks.num_warps,
        interpret=interpret, name="segment_cross_entropy_bwd_gpu",
    )(offsets, lengths, logits, targets, mask, lse, g)
