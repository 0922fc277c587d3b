"""Pallas TPU kernels of the per-segment ops: reduce (sum / max over a segment) and broadcast.

Both kernels walk a row of `L` tokens in blocks of `block_tokens` and, for
each segment `j` (`segment_offsets[j]`, `segment_lengths[j]` read from SMEM), clips the segment to
the block. Worked example, `block_tokens = 8`, block `t = 1` covers positions 8..15:

    segment   offset  length   [start, end)   clipped to block 1   local [lo, hi)
    0         0       5        [0, 5)         empty                 lo=0 hi=0  (skipped)
    1         8       6        [8, 14)        [8, 14)               lo=0 hi=6
    2         16      3        [16, 19)       empty                 lo=8 hi=8  (skipped)

Inside a block, the rows `[lo, hi)` are visited in aligned chunks of `chunk` rows
(`pl.ds(pl.multiple_of(c * chunk, chunk), chunk)`), and an `iota` mask keeps exactly the rows of the
segment (and below the array's true length `L`, so the undefined tail of a partial last block never
enters a reduction). Integer division uses `lax.div` on values known to be non-negative: `//`
lowers through `sign`, which the Mosaic lowering cannot resolve without a TPU attached.

Reduce, grid `(B, D / bd, L / bl)`, semantics `("parallel", "parallel", "arbitrary")`. Offsets,
lengths and each row's used length (`metadata.row_ends`) are scalar-prefetched into SMEM. At
token block `t` the kernel walks the S slots, clips each segment to the block
(`block_interval`) and reads only the chunks it covers with `pl.ds(start, chunk)` at a
chunk-aligned start; an iota mask keeps the segment's rows. The per-row accumulator is the
`[S, 1, bd]` output block itself, resident across the trailing "arbitrary" token axis, indexed on
its leading (untiled) axis by the slot `j`.

Work per block is O(bl * bd + segments_in_block * 2 * chunk * bd): each token row is read about
once, plus at most two partially covered chunks per segment. Blocks after the row's used length
(the largest end of a non-empty slot, so empty slots may hold any offset, e.g. 0) are neither
computed nor fetched: the index map clamps them to the last used block, and Pallas skips the DMA
when the block index does not change.

Example, L = 10, bl = 4, chunk = 4 (toy sizes), segments [0, 3) and [5, 9):

    block t=0 rows 0..3: slot 0 lo=0 hi=3 -> chunk 0, rows 0..2 kept
    block t=1 rows 4..7: slot 1 lo=1 hi=4 -> chunk 0, rows 5..7 kept
    block t=2 rows 8..9: slot 1 lo=0 hi=1 -> chunk 0, row 8 kept (rows 10, 11 are past L: masked)

Broadcast: the transpose of the segment sum, so it is the backward pass of the reductions and of
the cross-entropy (per-segment cotangents become per-token weights), and of the gather (with
one-token "segments" at the gathered positions). Public as `kernels.segment_broadcast`.

Its grid `(B, D / bd, L / bl)` is all "parallel": every output block is written exactly once. A
block is zeroed, then for each slot `j` clipped to it (`block_interval`) the covered chunks
are read-modified-written with `pl.ds(start, chunk)` and an iota mask, so neighbouring segments
that share a chunk keep each other's rows. The `[S, 1, bd]` values block of a row stays in VMEM.

Example, L = 8, bl = 8, chunk = 4 (toy sizes), values [a, b], segments [1, 3) and [4, 7):

    chunk 0 (rows 0..3): slot 0 writes rows 1, 2          -> 0 a a 0
    chunk 1 (rows 4..7): slot 1 writes rows 4, 5, 6       -> b b b 0
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from seqpack.kernels.common import (
    ACCUMULATOR_BUDGET_BYTES,
    LANES,
    Mode,
    SegmentCall,
    feature_block,
    token_block,
)


def cdiv_nonneg(a: jax.Array, b: int) -> jax.Array:
    """ceil(a / b) for a >= 0, without the `sign` op `//` lowers through."""
    return lax.div(a + (b - 1), b)


def block_interval(
    offset: jax.Array, length: jax.Array, base: jax.Array, block: int, bound: int
) -> tuple[jax.Array, jax.Array]:
    """Segment [offset, offset + length) clipped to the block [base, base + block) and [0, bound).

    Returns block-local `lo, hi` in [0, block]; the block holds rows of the segment iff hi > lo.
    """
    start = jnp.maximum(offset, base)
    end = jnp.minimum(jnp.minimum(offset + length, bound), base + block)
    lo = jnp.clip(start - base, 0, block)
    hi = jnp.clip(end - base, 0, block)
    return lo, hi


def last_used_block(ends_ref, row: jax.Array, block: int):
    """Index of the last token block holding any segment token (0 for an empty row)."""
    return jnp.maximum(cdiv_nonneg(ends_ref[row], block) - 1, 0)


def chunk_mask(start: jax.Array, lo: jax.Array, hi: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """Rows `start + i` of a chunk that fall inside the block-local interval [lo, hi)."""
    pos = start + lax.broadcasted_iota(jnp.int32, shape, 0)
    return (pos >= lo) & (pos < hi)


@dataclasses.dataclass(frozen=True)
class _Walk:
    """How both kernels walk a row: its S slots, clipped to token blocks of `block_tokens` rows,
    each read in aligned chunks of `chunk` rows (the module's first worked example)."""

    num_segments: int
    seq_len: int
    block_tokens: int
    chunk: int

    @classmethod
    def of(cls, st: SegmentCall, num_segments: int) -> _Walk:
        blocks = st.tpu
        bl = token_block(st.seq_len, blocks.block_tokens, blocks.chunk)
        return cls(num_segments, st.seq_len, bl, blocks.chunk)

    def segments(self, offsets_ref, lengths_ref, row, base,
                 body: Callable[[jax.Array, jax.Array, jax.Array], None]) -> None:
        """body(j, lo, hi) for every slot j of `row` holding rows of the token block that starts
        at `base`; [lo, hi) is block-local (block_interval)."""

        def segment(j, carry):
            idx = row * self.num_segments + j
            lo, hi = block_interval(offsets_ref[idx], lengths_ref[idx], base, self.block_tokens,
                                    self.seq_len)
            pl.when(hi > lo)(functools.partial(body, j, lo, hi))
            return carry

        lax.fori_loop(0, self.num_segments, segment, 0)

    def chunks(self, lo, hi, step, init):
        """fori_loop of step(start, carry) over the chunk-aligned starts of the chunks covering
        the block-local rows [lo, hi)."""

        def chunk_step(c, carry):
            return step(pl.multiple_of(c * self.chunk, self.chunk), carry)

        return lax.fori_loop(lax.div(lo, self.chunk), cdiv_nonneg(hi, self.chunk), chunk_step,
                             init)


def _reduce_kernel(
    offsets_ref,  # SMEM i32[B * S]
    lengths_ref,  # SMEM i32[B * S]
    ends_ref,  # SMEM i32[B], the used length of each row
    x_ref,  # VMEM [bl, bd]
    out_ref,  # VMEM f32[S, 1, bd], resident over the token axis
    *,
    mode: Mode,
    walk: _Walk,
) -> None:
    row, t = pl.program_id(0), pl.program_id(2)
    width = out_ref.shape[-1]
    init = 0.0 if mode == "sum" else -jnp.inf
    combine = jnp.add if mode == "sum" else jnp.maximum
    reduce = jnp.sum if mode == "sum" else jnp.max

    @pl.when(t == 0)
    def _init():
        out_ref[...] = jnp.full(out_ref.shape, init, jnp.float32)

    base = t * walk.block_tokens

    def reduce_segment(j, lo, hi):
        def chunk_step(start, acc):
            values = x_ref[pl.ds(start, walk.chunk), :].astype(jnp.float32)
            keep = chunk_mask(start, lo, hi, (walk.chunk, width))
            return combine(acc, reduce(jnp.where(keep, values, init), axis=0, keepdims=True))

        acc = walk.chunks(lo, hi, chunk_step, jnp.full((1, width), init, jnp.float32))
        out_ref[j] = combine(out_ref[j], acc)

    @pl.when(base < ends_ref[row])
    def _accumulate():
        walk.segments(offsets_ref, lengths_ref, row, base, reduce_segment)


def reduce_call(
    x: jax.Array,  # f[B, L, D]
    offsets: jax.Array,  # i32[B * S], metadata.flat_metadata
    lengths: jax.Array,  # i32[B * S]
    ends: jax.Array,  # i32[B], metadata.row_ends
    *,
    mode: Mode,
    st: SegmentCall,
) -> jax.Array:  # f32[B, S, D]; sum: 0 for empty slots, max: -inf for empty slots
    """Runs the reduce kernel (no checks, no VJP: see kernels/segment_ops.py)."""
    batch, seq_len, dim = x.shape
    num_segments = st.num_segments
    walk = _Walk.of(st, num_segments)
    bl = walk.block_tokens
    acc_lanes = ACCUMULATOR_BUDGET_BYTES // (2 * num_segments * 8 * 4) // LANES * LANES
    bd = feature_block(dim, min(st.tpu.block_features, max(LANES, acc_lanes)))

    def x_index(b, d, t, offsets_ref, lengths_ref, ends_ref):
        last = last_used_block(ends_ref, b, bl)
        return b, jnp.minimum(t, last), d

    out = pl.pallas_call(
        functools.partial(_reduce_kernel, mode=mode, walk=walk),
        out_shape=jax.ShapeDtypeStruct((batch, num_segments, 1, dim), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(batch, pl.cdiv(dim, bd), pl.cdiv(seq_len, bl)),
            in_specs=[pl.BlockSpec((None, bl, bd), x_index)],
            out_specs=pl.BlockSpec((None, num_segments, 1, bd), lambda b, d, t, *_: (b, 0, 0, d)),
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        cost_estimate=pl.CostEstimate(
            flops=batch * seq_len * dim,
            transcendentals=0,
            bytes_accessed=x.size * x.dtype.itemsize + batch * num_segments * dim * 4,
        ),
        interpret=st.interpret,
        name=f"segment_{mode}",
    )(offsets, lengths, ends, x)
    return out[:, :, 0, :]


def _broadcast_kernel(
    offsets_ref,  # SMEM i32[B * S]
    lengths_ref,  # SMEM i32[B * S]
    values_ref,  # VMEM [S, 1, bd]
    out_ref,  # VMEM [bl, bd]
    *,
    walk: _Walk,
) -> None:
    row, t = pl.program_id(0), pl.program_id(2)
    width = out_ref.shape[-1]
    out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

    def write_segment(j, lo, hi):
        value = values_ref[j].astype(jnp.float32)  # [1, bd]

        def chunk_step(start, carry):
            keep = chunk_mask(start, lo, hi, (walk.chunk, width))
            current = out_ref[pl.ds(start, walk.chunk), :].astype(jnp.float32)
            out_ref[pl.ds(start, walk.chunk), :] = jnp.where(keep, value, current).astype(
                out_ref.dtype
            )
            return carry

        walk.chunks(lo, hi, chunk_step, 0)

    walk.segments(offsets_ref, lengths_ref, row, t * walk.block_tokens, write_segment)


def broadcast_call(
    values: jax.Array,  # f[B, S, D]
    offsets: jax.Array,  # i32[B * S], metadata.flat_metadata
    lengths: jax.Array,  # i32[B * S]
    *,
    out_dtype: jnp.dtype,
    st: SegmentCall,
) -> jax.Array:  # out_dtype[B, L, D]
    """Runs the broadcast kernel (no checks, no VJP: see kernels/segment_ops.py)."""
    batch, num_segments, dim = values.shape
    walk = _Walk.of(st, num_segments)
    bl, bd = walk.block_tokens, feature_block(dim, st.tpu.block_features)
    out_bytes = batch * st.seq_len * dim * jnp.dtype(out_dtype).itemsize
    return pl.pallas_call(
        functools.partial(_broadcast_kernel, walk=walk),
        out_shape=jax.ShapeDtypeStruct((batch, st.seq_len, dim), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, pl.cdiv(dim, bd), pl.cdiv(st.seq_len, bl)),
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
            bytes_accessed=values.size * values.dtype.itemsize + out_bytes,
        ),
        interpret=st.interpret,
        name="segment_broadcast",
    )(offsets, lengths, values[:, :, None, :])
