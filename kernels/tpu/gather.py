"""Pallas TPU kernel picking one token per segment (first, last or k-th): pooling for heads.

Grid `(B, D / bd, S)`, all "parallel". The x BlockSpec's index map is data-dependent: it reads the
slot's offset and length from the scalar-prefetched SMEM metadata, computes the picked position
`p` (`common.target_position`) and loads the `rows`-row tile holding it, `(b, p // rows, d)`. The
kernel keeps row `p % rows` with an iota mask (a sum over one kept row and zeros, exact in f32),
so no dynamic sublane indexing is needed. `rows` is the dtype's native tile height (8 for 32-bit,
16 for 16-bit): the smallest block Mosaic accepts, so each step moves rows x bd elements. When
consecutive slots pick from the same tile, the block index repeats and Pallas skips the DMA.

Example, rows = 8, position = "last", slots (offset, length) = (0, 5), (5, 7), (12, 0):

    slot 0: p = 4   tile 0, row 4
    slot 1: p = 11  tile 1, row 3
    slot 2: empty   tile of p = clip(12 - 1) = 11, output 0

The VJP (kernels/gather.py) scatters the cotangent back with the broadcast kernel over one-token
"segments" [p, p + 1). On GPU, gpu/gather.py picks all slots of a row in one load.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from seqpack.kernels.common import Interpret, feature_block, target_position


def _tile_rows(dtype: jnp.dtype, seq_len: int) -> int:
    rows = 8 * 4 // max(jnp.dtype(dtype).itemsize, 1)
    return seq_len if seq_len < rows else rows


def _gather_kernel(offsets_ref, lengths_ref, x_ref, out_ref, *, num_segments: int, seq_len: int,
                   k: int, rows: int) -> None:
    # x_ref: VMEM [rows, bd], out_ref: VMEM [1, bd]
    row, j = pl.program_id(0), pl.program_id(2)
    idx = row * num_segments + j
    pos, valid = target_position(offsets_ref[idx], lengths_ref[idx], k, seq_len)
    keep = lax.broadcasted_iota(jnp.int32, x_ref.shape, 0) == lax.rem(pos, rows)
    picked = jnp.sum(jnp.where(keep, x_ref[...].astype(jnp.float32), 0.0), axis=0, keepdims=True)
    out_ref[...] = jnp.where(valid, picked, 0.0).astype(out_ref.dtype)


def gather_call(
    x: jax.Array,  # f[B, L, D]
    offsets: jax.Array,  # i32[B * S], metadata.flat_metadata
    lengths: jax.Array,  # i32[B * S]
    *,
    k: int,
    block_features: int,
    interpret: Interpret,
) -> jax.Array:  # f[B, S, D]
    """Runs the TPU gather kernel (no checks, no VJP: see kernels/gather.py)."""
    batch, seq_len, dim = x.shape
    num_segments = offsets.shape[0] // batch
    rows = _tile_rows(x.dtype, seq_len)
    bd = feature_block(dim, block_features)

    def x_index(b, d, j, offsets_ref, lengths_ref):
        idx = b * num_segments + j
        pos, _ = target_position(offsets_ref[idx], lengths_ref[idx], k, seq_len)
        return b, lax.div(pos, rows), d

    kernel = functools.partial(_gather_kernel, num_segments=num_segments, seq_len=seq_len,
                               k=k, rows=rows)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((batch, num_segments, 1, dim), x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, pl.cdiv(dim, bd), num_segments),
            in_specs=[pl.BlockSpec((None, rows, bd), x_index)],
            out_specs=pl.BlockSpec((None, None, 1, bd), lambda b, d, j, *_: (b, j, 0, d)),
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel")
        ),
        cost_estimate=pl.CostEstimate(
            flops=0,
            transcendentals=0,
            bytes_accessed=2 * batch * num_segments * rows * dim * x.dtype.itemsize,
        ),
        interpret=interpret,
        name="segment_gather",
    )(offsets, lengths, x)
    return out[:, :, 0, :]
