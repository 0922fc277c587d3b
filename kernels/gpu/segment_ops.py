"""Pallas GPU (Triton) kernels of the per-segment ops: reduce (sum / max) and broadcast.

GPU Pallas has no scalar prefetch: the metadata travels as ordinary i32 inputs, padded to a power
of two `sp >= S` slots with length-0 slots (`metadata.padded_metadata`), and every ref is the
whole array in global memory; the kernels load power-of-two tiles at computed positions with
masked loads (a masked-off element is never read, so padding and out-of-range rows cost no memory
traffic and can hold anything, NaN included). A slot takes part iff its length is > 0, whatever
its offset.

    reduce     grid (B, S, D / bd, n)   n = token_splits programs per segment and lane block,
                                        each looping over every n-th [bl, bd] tile of the
                                        segment's rows, accumulating in f32 registers; the tile,
                                        then the n partial results (jnp) are reduced (sum or max)
    broadcast  grid (B, L / bl, D / bd) one program per output tile: each row's slot is the first
                                        slot covering it (a [bl, sp] compare against the starts
                                        and ends), then a gather-load of values[b, slot, lanes];
                                        rows of no segment get 0. Every output element is written.

Example, reduce with bl = 4, n = 2, segment (offset 5, length 6) in a row of L = 12: program 0
reads rows 5..8, program 1 rows 9..12, where the load mask drops rows 11 and 12 (past the end).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from seqpack.kernels.common import (
    Mode,
    SegmentCall,
    first_slot,
    slot_membership,
    tile,
    triton_call,
)


def _reduce_kernel(offsets_ref, lengths_ref, x_ref, out_ref, *, mode: Mode, seq_len: int,
                   dim: int, bl: int, bd: int) -> None:
    # offsets, lengths i32[B, sp]; x [B, L, D]; out f32[B, S, n, D]
    b, j, d, split = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    splits = pl.num_programs(3)
    start = jnp.clip(offsets_ref[b, j], 0, seq_len)
    end = jnp.clip(offsets_ref[b, j] + lengths_ref[b, j], start, seq_len)
    cols = d * bd + jnp.arange(bd)
    col_ok = cols < dim
    init = 0.0 if mode == "sum" else -jnp.inf

    def step(i, acc):
        first = start + (split + i * splits) * bl
        keep = ((first + jnp.arange(bl)) < end)[:, None] & col_ok[None, :]
        values = plgpu.load(x_ref.at[b, pl.ds(first, bl), pl.ds(d * bd, bd)], mask=keep,
                            other=init).astype(jnp.float32)
        return acc + values if mode == "sum" else jnp.maximum(acc, values)

    num_tiles = lax.div(end - start + (bl - 1), bl)
    mine = lax.div(jnp.maximum(num_tiles - split, 0) + (splits - 1), splits)  # tiles split + i n
    acc = lax.fori_loop(0, mine, step, jnp.full((bl, bd), init, jnp.float32))
    total = jnp.sum(acc, axis=0) if mode == "sum" else jnp.max(acc, axis=0)
    plgpu.store(out_ref.at[b, j, split, pl.ds(d * bd, bd)], total, mask=col_ok)


def reduce_call(
    x: jax.Array,  # f[B, L, D]
    offsets: jax.Array,  # i32[B, sp], metadata.padded_metadata
    lengths: jax.Array,  # i32[B, sp]
    *,
    mode: Mode,
    st: SegmentCall,
) -> jax.Array:  # f32[B, S, D]; sum: 0 for empty slots, max: -inf for empty slots
    """Runs the GPU reduce kernel (no checks, no VJP: see kernels/segment_ops.py)."""
    batch, seq_len, dim = x.shape
    blocks = st.gpu
    assert blocks is not None
    bl, bd = tile(seq_len, blocks.block_tokens), tile(dim, blocks.block_features)
    splits = min(blocks.token_splits, pl.cdiv(seq_len, bl))
    partial = triton_call(
        functools.partial(_reduce_kernel, mode=mode, seq_len=seq_len, dim=dim, bl=bl, bd=bd),
        out_shape=jax.ShapeDtypeStruct((batch, st.num_segments, splits, dim), jnp.float32),
        grid=(batch, st.num_segments, pl.cdiv(dim, bd), splits), num_warps=blocks.num_warps,
        interpret=st.interpret, name=f"segment_{mode}_gpu",
    )(offsets, lengths, x)
    return partial.sum(2) if mode == "sum" else partial.max(2)


def _broadcast_kernel(offsets_ref, lengths_ref, values_ref, out_ref, *, seq_len: int, dim: int,
                      bl: int, bd: int) -> None:
    # offsets, lengths i32[B, sp]; values [B, S, D]; out [B, L, D]
    b, t, d = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = t * bl + jnp.arange(bl)
    cols = d * bd + jnp.arange(bd)
    col_ok = cols < dim
    slot = first_slot(slot_membership(offsets_ref, lengths_ref, b, rows))
    inside = slot < offsets_ref.shape[1]
    values = plgpu.load(values_ref.at[b, slot[:, None], cols[None, :]],
                        mask=inside[:, None] & col_ok[None, :], other=0.0)
    plgpu.store(out_ref.at[b, pl.ds(t * bl, bl), pl.ds(d * bd, bd)],
                values.astype(out_ref.dtype), mask=(rows < seq_len)[:, None] & col_ok[None, :])


def broadcast_call(
    values: jax.Array,  # f[B, S, D]
    offsets: jax.Array,  # i32[B, sp], metadata.padded_metadata
    lengths: jax.Array,  # i32[B, sp]
    *,
    out_dtype: jnp.dtype,
    st: SegmentCall,
) -> jax.Array:  # out_dtype[B, L, D]
    """Runs the GPU broadcast kernel (no checks, no VJP: see kernels/segment_ops.py)."""
    batch, _, dim = values.shape
    blocks, seq_len = st.gpu, st.seq_len
    assert blocks is not None
    bl, bd = tile(seq_len, blocks.block_tokens), tile(dim, blocks.block_features)
    return triton_call(
        functools.partial(_broadcast_kernel, seq_len=seq_len, dim=dim, bl=bl, bd=bd),
        out_shape=jax.ShapeDtypeStruct((batch, seq_len, dim), out_dtype),
        grid=(batch, pl.cdiv(seq_len, bl), pl.cdiv(dim, bd)), num_warps=blocks.num_warps,
        interpret=st.interpret, name="segment_broadcast_gpu",
    )(offsets, lengths, values)
