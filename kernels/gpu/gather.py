"""Pallas GPU (Triton) kernel picking one token per segment (first, last or k-th).

GPU Pallas has no scalar prefetch: the metadata travels as ordinary i32 inputs, padded to a power
of two `sp >= S` slots (`metadata.padded_metadata`). Grid `(B, D / bd)`: one program per row and
lane block computes the `[sp]` picked positions (`common.target_position`) and gathers them in one
masked load, so slots without the picked token (empty, or shorter than k + 1) read nothing and
give 0. Example, slots (offset, length) = (0, 5), (5, 7), (12, 0), position "last": the program
loads rows 4 and 11 and writes 0 for slot 2.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from seqpack.kernels.common import GpuBlockSizes, target_position, tile, triton_call


def _gather_kernel(offsets_ref, lengths_ref, x_ref, out_ref, *, k: int, seq_len: int, dim: int,
                   bd: int) -> None:
    # offsets, lengths i32[B, sp]; x [B, L, D]; out [B, sp, D]
    b, d = pl.program_id(0), pl.program_id(1)
    sp = offsets_ref.shape[1]
    pos, valid = target_position(offsets_ref[b, pl.ds(0, sp)], lengths_ref[b, pl.ds(0, sp)], k,
                                 seq_len)
    cols = d * bd + jnp.arange(bd)
    col_ok = cols < dim
    picked = plgpu.load(x_ref.at[b, pos[:, None], cols[None, :]],
                        mask=valid[:, None] & col_ok[None, :], other=0.0)
    plgpu.store(out_ref.at[b, pl.ds(0, sp), pl.ds(d * bd, bd)], picked.astype(out_ref.dtype),
                mask=col_ok[None, :])


def gather_call(
    x: jax.Array,  # f[B, L, D]
    offsets: jax.Array,  # i32[B, sp], padded_metadata
    lengths: jax.Array,  # i32[B, sp]
    *,
    k: int,
    blocks: GpuBlockSizes,
    interpret: bool,
) -> jax.Array:  # f[B, sp, D], the padding slots (past S) hold 0
    """Runs the GPU gather kernel (no checks, no VJP: see kernels/gather.py)."""
    batch, seq_len, dim = x.shape
    bd = tile(dim, blocks.block_features)
    return triton_call(
        functools.partial(_gather_kernel, k=k, seq_len=seq_len, dim=dim, bd=bd),
        out_shape=jax.ShapeDtypeStruct((batch, offsets.shape[1], dim), x.dtype),
        grid=(batch, pl.cdiv(dim, bd)), num_warps=blocks.num_warps, interpret=interpret,
        name="segment_gather_gpu",
    )(offsets, lengths, x)
