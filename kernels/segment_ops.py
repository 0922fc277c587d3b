"""Public per-segment reductions and broadcast, with their custom VJPs wired to the Pallas kernels.

    segment_sum / segment_mean / segment_max   x f[B, L(, D)]       -> f[B, S(, D)]
    segment_broadcast                          values f[B, S(, D)]  -> f[B, L(, D)]

VJPs (a `pallas_call` with scalar prefetch has no JVP rule, hence `jax.custom_vjp`):

    sum        dx = broadcast(g)                        (zero on padding)
    mean       through sum, divided by max(length, 1)   (plain autodiff around the sum)
    max        dx = [x == broadcast(max)] * broadcast(g / ties)   (ties split evenly, as jnp.max)
    broadcast  dvalues = sum(g)

`impl` (common.resolve_impl) picks the TPU kernels (segment_ops_tpu.py), the GPU kernels
(segment_ops_gpu.py) or kernels/reference.py; all functions are jitted with their options static.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from seqpack.kernels import reference, segment_ops_gpu, segment_ops_tpu
from seqpack.kernels.checks import check_metadata, check_smem, check_tokens_input
from seqpack.kernels.common import (
    GpuBlockSizes,
    Impl,
    Interpret,
    SegmentBlockSizes,
    pick_block_sizes,
    resolve_impl,
)
from seqpack.kernels.metadata import flat_metadata, padded_metadata, row_ends
from seqpack.kernels.segment_ops_tpu import Mode

_STATIC = ("impl", "interpret", "block_sizes")
Metadata = tuple[jax.Array, jax.Array, jax.Array]  # offsets, lengths, row ends (TPU) / unused (GPU)


@dataclasses.dataclass(frozen=True)
class _Static:
    """Static (hashable) configuration carried through custom_vjp as a nondiff argument.

    The kernel family follows the block sizes: GpuBlockSizes runs kernels/segment_ops_gpu.py
    (metadata i32[B, sp] from `padded_metadata`), SegmentBlockSizes the TPU kernels in
    segment_ops_tpu.py (flat i32[B * S] metadata and the rows' used lengths, scalar-prefetched).
    """

    seq_len: int
    num_segments: int
    dtype: jnp.dtype
    block_sizes: SegmentBlockSizes | GpuBlockSizes
    interpret: Interpret

    def reduce(self, x: jax.Array, meta: Metadata, mode: Mode) -> jax.Array:
        """f[B, L, D] -> f32[B, S, D]."""
        offsets, lengths, ends = meta
        if isinstance(self.block_sizes, GpuBlockSizes):
            return segment_ops_gpu.reduce_call(x, offsets, lengths, num_segments=self.num_segments,
                                               mode=mode, blocks=self.block_sizes,
                                               interpret=bool(self.interpret))
        return segment_ops_tpu.reduce_call(x, offsets, lengths, ends,
                                           num_segments=self.num_segments, mode=mode,
                                           block_sizes=self.block_sizes, interpret=self.interpret)

    def broadcast(self, values: jax.Array, meta: Metadata,
                  out_dtype: jnp.dtype) -> jax.Array:  # f[B, S, D] -> out_dtype[B, L, D]
        offsets, lengths, _ = meta
        if isinstance(self.block_sizes, GpuBlockSizes):
            return segment_ops_gpu.broadcast_call(values, offsets, lengths, seq_len=self.seq_len,
                                                  out_dtype=out_dtype, blocks=self.block_sizes,
                                                  interpret=bool(self.interpret))
        return segment_ops_tpu.broadcast_call(values, offsets, lengths, seq_len=self.seq_len,
                                              out_dtype=out_dtype, block_sizes=self.block_sizes,
                                              interpret=self.interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _pallas_sum(x, meta, st: _Static):  # f[B, L, D] -> f32[B, S, D]
    return st.reduce(x, meta, "sum")


def _pallas_sum_fwd(x, meta, st):
    return st.reduce(x, meta, "sum"), meta


def _pallas_sum_bwd(st, meta, g):
    return st.broadcast(g, meta, st.dtype), None


_pallas_sum.defvjp(_pallas_sum_fwd, _pallas_sum_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _pallas_max(x, meta, st: _Static):  # f[B, L, D] -> f32[B, S, D], -inf if empty
    return st.reduce(x, meta, "max")


def _pallas_max_fwd(x, meta, st):
    out = st.reduce(x, meta, "max")
    return out, (x, meta, out)


def _pallas_max_bwd(st, residuals, g):
    x, meta, out = residuals
    # Padding gets broadcast value 0 and may "tie" with x == 0 there, but the tie count is a
    # segment sum (padding excluded) and the broadcast share is 0 on padding, so dx stays 0.
    ties = x.astype(jnp.float32) == st.broadcast(out, meta, jnp.float32)
    count = st.reduce(ties.astype(jnp.float32), meta, "sum")
    share = st.broadcast(g / jnp.maximum(count, 1.0), meta, jnp.float32)
    return jnp.where(ties, share, 0.0).astype(st.dtype), None


_pallas_max.defvjp(_pallas_max_fwd, _pallas_max_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _pallas_broadcast(values, meta, st: _Static):  # f[B, S, D] -> f[B, L, D]
    return st.broadcast(values, meta, st.dtype)


def _pallas_broadcast_fwd(values, meta, st):
    return st.broadcast(values, meta, st.dtype), meta


def _pallas_broadcast_bwd(st, meta, g):
    return st.reduce(g, meta, "sum").astype(st.dtype), None


_pallas_broadcast.defvjp(_pallas_broadcast_fwd, _pallas_broadcast_bwd)


def _setup(segment_offsets, segment_lengths, *, seq_len, dtype, impl, interpret, block_sizes,
           name):
    """None for the reference, else (metadata for the resolved kernel family, _Static)."""
    impl = resolve_impl(impl, interpret)
    blocks = pick_block_sizes(block_sizes, impl, SegmentBlockSizes, name)
    if impl is Impl.REFERENCE:
        return None
    batch, num_segments = segment_offsets.shape
    ends = row_ends(segment_offsets, segment_lengths, seq_len)
    if impl is Impl.PALLAS_GPU:
        meta = (*padded_metadata(segment_offsets, segment_lengths), ends)
    else:
        check_smem(batch, num_segments)
        meta = (*flat_metadata(segment_offsets, segment_lengths), ends)
    return meta, _Static(seq_len, num_segments, jnp.dtype(dtype), blocks, interpret)


def _prepare(x, segment_offsets, segment_lengths, impl, interpret, block_sizes, name):
    """Static checks; None for the reference, else (x as [B, L, D], metadata, _Static)."""
    check_tokens_input("x", x)
    check_metadata(segment_offsets, segment_lengths, x.shape[0])
    setup = _setup(segment_offsets, segment_lengths, seq_len=x.shape[1], dtype=x.dtype,
                   impl=impl, interpret=interpret, block_sizes=block_sizes, name=name)
    if setup is None:
        return None
    x3 = x if x.ndim == 3 else x[:, :, None]
    return x3, *setup


def _per_slot(lengths: jax.Array, ndim: int) -> jax.Array:
    """[B, S] -> broadcastable against [B, S, D] (D present when the input had it)."""
    return lengths.reshape(lengths.shape + (1,) * (ndim - 2))


@functools.partial(jax.jit, static_argnames=_STATIC)
def segment_sum(
    x: jax.Array,  # f[B, L] or f[B, L, D]
    segment_offsets: jax.Array,  # int[B, S]
    segment_lengths: jax.Array,  # int[B, S]
    *,
    impl: Impl | str = "auto",
    interpret: Interpret = False,
    block_sizes: SegmentBlockSizes | GpuBlockSizes | None = None,
) -> jax.Array:  # f[B, S] or f[B, S, D]
    """Sum over each segment's tokens (f32 accumulation); 0 for empty slots."""
    args = _prepare(x, segment_offsets, segment_lengths, impl, interpret, block_sizes,
                    "segment_sum")
    if args is None:
        return reference.segment_sum(x, segment_offsets, segment_lengths)
    x3, meta, st = args
    out = _pallas_sum(x3, meta, st)
    return (out if x.ndim == 3 else out[..., 0]).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=_STATIC)
def segment_mean(
    x: jax.Array,  # f[B, L] or f[B, L, D]
    segment_offsets: jax.Array,  # int[B, S]
    segment_lengths: jax.Array,  # int[B, S]
    *,
    impl: Impl | str = "auto",
    interpret: Interpret = False,
    block_sizes: SegmentBlockSizes | GpuBlockSizes | None = None,
) -> jax.Array:  # f[B, S] or f[B, S, D]
    """Mean over each segment's tokens (f32 accumulation); 0 for empty slots."""
    args = _prepare(x, segment_offsets, segment_lengths, impl, interpret, block_sizes,
                    "segment_mean")
    if args is None:
        return reference.segment_mean(x, segment_offsets, segment_lengths)
    x3, meta, st = args
    out = _pallas_sum(x3, meta, st)
    out = out if x.ndim == 3 else out[..., 0]
    count = jnp.maximum(segment_lengths, 1).astype(jnp.float32)  # length <= 0: an empty slot
    return (out / _per_slot(count, x.ndim)).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=(*_STATIC, "fill_value"))
def segment_max(
    x: jax.Array,  # f[B, L] or f[B, L, D]
    segment_offsets: jax.Array,  # int[B, S]
    segment_lengths: jax.Array,  # int[B, S]
    *,
    fill_value: float = 0.0,
    impl: Impl | str = "auto",
    interpret: Interpret = False,
    block_sizes: SegmentBlockSizes | GpuBlockSizes | None = None,
) -> jax.Array:  # f[B, S] or f[B, S, D]
    """Max over each segment's tokens; `fill_value` (default 0.0) for empty slots.

    `jax.ops.segment_max` fills empty segments with -inf instead; 0.0 keeps pooled features finite
    (no NaN from -inf * 0 downstream). The gradient is split evenly between tied maxima.
    """
    args = _prepare(x, segment_offsets, segment_lengths, impl, interpret, block_sizes,
                    "segment_max")
    if args is None:
        return reference.segment_max(x, segment_offsets, segment_lengths, fill_value=fill_value)
    x3, meta, st = args
    out = _pallas_max(x3, meta, st)
    out = out if x.ndim == 3 else out[..., 0]
    nonempty = _per_slot(segment_lengths > 0, x.ndim)
    return jnp.where(nonempty, out, fill_value).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=(*_STATIC, "seq_len"))
def segment_broadcast(
    values: jax.Array,  # f[B, S] or f[B, S, D]
    segment_offsets: jax.Array,  # int[B, S]
    segment_lengths: jax.Array,  # int[B, S]
    *,
    seq_len: int,
    impl: Impl | str = "auto",
    interpret: Interpret = False,
    block_sizes: SegmentBlockSizes | GpuBlockSizes | None = None,
) -> jax.Array:  # f[B, L] or f[B, L, D]
    """Each segment's value on each of its tokens, 0 on padding (e.g. per-document rewards)."""
    if seq_len < 1:
        raise ValueError(f"{seq_len=} must be >= 1 (the packed row length L)")
    check_tokens_input("values", values)
    batch, num_segments = values.shape[:2]
    if check_metadata(segment_offsets, segment_lengths, batch) != num_segments:
        raise ValueError(
            f"values.shape={values.shape} must be [B, S] or [B, S, D] with "
            f"S={segment_offsets.shape[1]} slots, like segment_offsets"
        )
    setup = _setup(segment_offsets, segment_lengths, seq_len=seq_len, dtype=values.dtype,
                   impl=impl, interpret=interpret, block_sizes=block_sizes,
                   name="segment_broadcast")
    if setup is None:
        return reference.segment_broadcast(values, segment_offsets, segment_lengths,
                                           seq_len=seq_len)
    meta, st = setup
    values3 = values if values.ndim == 3 else values[:, :, None]
    out = _pallas_broadcast(values3, meta, st)
    return out if values.ndim == 3 else out[..., 0]
