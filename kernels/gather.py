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

The VJP scatters the cotangent back with the broadcast kernel over one-token "segments" [p, p + 1).
On GPU, `gpu_segment.gather_call` picks all slots of a row in one gather-load instead.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from seqpack.kernels import gpu_segment, reference
from seqpack.kernels.broadcast import broadcast_call
from seqpack.kernels.checks import check_metadata, check_smem, check_tokens_input
from seqpack.kernels.common import (
    GpuBlockSizes,
    Impl,
    Interpret,
    SegmentBlockSizes,
    feature_block,
    flat_metadata,
    gather_offset,
    pick_block_sizes,
    resolve_impl,
    target_position,
)


@dataclasses.dataclass(frozen=True)
class GatherBlockSizes:
    """Block sizes of the gather kernel.

    block_features: lanes per step (a multiple of 128; D itself when D is smaller). A step moves
      only rows x bd elements (16 x 2048 bf16 = 64 KiB), so wide blocks amortize the per-step cost.
    """

    block_features: int = 2048

    def __post_init__(self) -> None:
        if self.block_features <= 0 or self.block_features % 128:
            raise ValueError(f"{self.block_features=} must be a positive multiple of 128")


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


def _gather_call(x, offsets, lengths, *, st: _Static):  # f[B, L, D] -> f[B, S, D]
    if isinstance(st.block_sizes, GpuBlockSizes):
        return gpu_segment.gather_call(x, offsets, lengths, num_segments=st.num_segments, k=st.k,
                                       blocks=st.block_sizes, interpret=bool(st.interpret))
    batch, seq_len, dim = x.shape
    rows = _tile_rows(x.dtype, seq_len)
    bd = feature_block(dim, st.block_sizes.block_features)

    def x_index(b, d, j, offsets_ref, lengths_ref):
        idx = b * st.num_segments + j
        pos, _ = target_position(offsets_ref[idx], lengths_ref[idx], st.k, seq_len)
        return b, lax.div(pos, rows), d

    kernel = functools.partial(_gather_kernel, num_segments=st.num_segments, seq_len=seq_len,
                               k=st.k, rows=rows)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((batch, st.num_segments, 1, dim), x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, pl.cdiv(dim, bd), st.num_segments),
            in_specs=[pl.BlockSpec((None, rows, bd), x_index)],
            out_specs=pl.BlockSpec((None, None, 1, bd), lambda b, d, j, *_: (b, j, 0, d)),
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel")
        ),
        cost_estimate=pl.CostEstimate(
            flops=0,
            transcendentals=0,
            bytes_accessed=2 * batch * st.num_segments * rows * dim * x.dtype.itemsize,
        ),
        interpret=st.interpret,
        name="segment_gather",
    )(offsets, lengths, x)
    return out[:, :, 0, :]


@dataclasses.dataclass(frozen=True)
class _Static:
    seq_len: int
    num_segments: int
    k: int
    dtype: jnp.dtype
    block_sizes: GatherBlockSizes | GpuBlockSizes
    interpret: Interpret


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _pallas_gather(x, offsets, lengths, st: _Static):
    return _gather_call(x, offsets, lengths, st=st)


def _pallas_gather_fwd(x, offsets, lengths, st):
    return _gather_call(x, offsets, lengths, st=st), (offsets, lengths)


def _pallas_gather_bwd(st, residuals, g):
    offsets, lengths = residuals
    pos, valid = target_position(offsets, lengths, st.k, st.seq_len)
    if isinstance(st.block_sizes, GpuBlockSizes):  # metadata padded to sp slots, g has S
        dx = gpu_segment.broadcast_call(g, pos, valid.astype(jnp.int32), seq_len=st.seq_len,
                                        out_dtype=st.dtype, blocks=st.block_sizes,
                                        interpret=bool(st.interpret))
    else:
        dx = broadcast_call(g, pos, valid.astype(jnp.int32), seq_len=st.seq_len,
                            out_dtype=st.dtype, block_sizes=SegmentBlockSizes(),
                            interpret=st.interpret)
    return dx, None, None


_pallas_gather.defvjp(_pallas_gather_fwd, _pallas_gather_bwd)


@functools.partial(jax.jit, static_argnames=("position", "impl", "interpret", "block_sizes"))
def segment_gather(
    x: jax.Array,  # f[B, L] or f[B, L, D]
    segment_offsets: jax.Array,  # int[B, S]
    segment_lengths: jax.Array,  # int[B, S]
    *,
    position: str | int = "last",
    impl: Impl | str = "auto",
    interpret: Interpret = False,
    block_sizes: GatherBlockSizes | GpuBlockSizes | None = None,
) -> jax.Array:  # f[B, S] or f[B, S, D]
    """The first, last or k-th token of each segment (k < 0 counts from the end, -1 = last).

    Slots that are empty, or shorter than k + 1 tokens, give 0.
    """
    k = gather_offset(position)
    check_tokens_input("x", x)
    batch, seq_len = x.shape[:2]
    num_segments = check_metadata(segment_offsets, segment_lengths, batch)
    impl = resolve_impl(impl, interpret)
    blocks = pick_block_sizes(block_sizes, impl, GatherBlockSizes, "segment_gather")
    if impl is Impl.REFERENCE:
        return reference.segment_gather(x, segment_offsets, segment_lengths, position=position)
    if impl is Impl.PALLAS_GPU:
        metadata = gpu_segment.padded_metadata(segment_offsets, segment_lengths)
    else:
        check_smem(batch, num_segments)
        metadata = flat_metadata(segment_offsets, segment_lengths)
    st = _Static(seq_len, num_segments, k, jnp.dtype(x.dtype), blocks, interpret)
    x3 = x if x.ndim == 3 else x[:, :, None]
    out = _pallas_gather(x3, *metadata, st)
    return out if x.ndim == 3 else out[..., 0]
