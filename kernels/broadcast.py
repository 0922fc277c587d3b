"""Pallas TPU kernel writing each segment's value onto its tokens (zeros on padding).

The transpose of `reduce.py`'s segment sum, so it is the backward pass of the reductions and of the
cross-entropy (per-segment cotangents become per-token weights), and of the gather (with one-token
"segments" at the gathered positions). Public as `kernels.segment_broadcast`.

Grid `(B, D / bd, L / bl)`, all "parallel": every output block is written exactly once. A block is
zeroed, then for each slot `j` clipped to it (`common.block_interval`) the covered chunks are
read-modified-written with `pl.ds(start, chunk)` and an iota mask, so neighbouring segments that
share a chunk keep each other's rows. The `[S, 1, bd]` values block of a row stays in VMEM.

Example, L = 8, bl = 8, chunk = 4 (toy sizes), values [a, b], segments [1, 3) and [4, 7):

    chunk 0 (rows 0..3): slot 0 writes rows 1, 2          -> 0 a a 0
    chunk 1 (rows 4..7): slot 1 writes rows 4, 5, 6       -> b b b 0
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from seqpack.kernels.common import (
    Interpret,
    SegmentBlockSizes,
    block_interval,
    cdiv_nonneg,
    chunk_mask,
    feature_block,
    token_block,
)


def _broadcast_kernel(
    offsets_ref,  # SMEM i32[B * S]
    lengths_ref,  # SMEM i32[B * S]
    values_ref,  # VMEM [S, 1, bd]
    out_ref,  # VMEM [bl, bd]
    *,
    num_segments: int,
    seq_len: int,
    block_tokens: int,
    chunk: int,
) -> None:
    row, t = pl.program_id(0), pl.program_id(2)
    width = out_ref.shape[-1]
    base = t * block_tokens
    out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

    def segment(j, carry):
        idx = row * num_segments + j
        lo, hi = block_interval(offsets_ref[idx], lengths_ref[idx], base, block_tokens, seq_len)

        @pl.when(hi > lo)
        def _write_segment():
            value = values_ref[j].astype(jnp.float32)  # [1, bd]

            def chunk_step(c, carry):
                start = pl.multiple_of(c * chunk, chunk)
                keep = chunk_mask(start, lo, hi, (chunk, width))
                current = out_ref[pl.ds(start, chunk), :].astype(jnp.float32)
                out_ref[pl.ds(start, chunk), :] = jnp.where(keep, value, current).astype(
                    out_ref.dtype
                )
                return carry

            lax.fori_loop(lax.div(lo, chunk), cdiv_nonneg(hi, chunk), chunk_step, 0)

        return carry

    lax.fori_loop(0, num_segments, segment, 0)


def broadcast_call(
    values: jax.Array,  # f[B, S, D]
    offsets: jax.Array,  # i32[B * S]
    lengths: jax.Array,  # i32[B * S]
    *,
    seq_len: int,
    out_dtype: jnp.dtype,
    block_sizes: SegmentBlockSizes,
    interpret: Interpret,
) -> jax.Array:  # out_dtype[B, L, D]
    """Runs the broadcast kernel (no checks, no VJP: see kernels/segment_ops.py)."""
    batch, num_segments, dim = values.shape
    chunk = block_sizes.chunk
    bl = token_block(seq_len, block_sizes.block_tokens, chunk)
    bd = feature_block(dim, block_sizes.block_features)
    kernel = functools.partial(
        _broadcast_kernel,
        num_segments=num_segments,
        seq_len=seq_len,
        block_tokens=bl,
        chunk=chunk,
    )
    out_itemsize = jnp.dtype(out_dtype).itemsize
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((batch, seq_len, dim), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, pl.cdiv(dim, bd), pl.cdiv(seq_len, bl)),
            in_specs=[
                pl.BlockSpec((None, num_segments, 1, bd), lambda b, d, t, *_: (b, 0, 0, d))
            ],
            out_specs=pl.BlockSpec((None, bl, bd), lambda b, d, t, *_: (b, t, d)),
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel")
        ),
        cost_estimate=pl.CostEstimate(
            flops=0,
            transcendentals=0,
            bytes_accessed=values.size * values.dtype.itemsize
            + batch * seq_len * dim * out_itemsize,
        ),
        interpret=interpret,
        name="segment_broadcast",
    )(offsets, lengths, values[:, :, None, :])
