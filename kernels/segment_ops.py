"""Public per-segment reductions and broadcast, with their custom VJPs wired to the Pallas kernels.

    segment_sum / segment_mean / segment_max   x f[B, L(, D)]       -> f[B, S(, D)]
    segment_broadcast                          values f[B, S(, D)]  -> f[B, L(, D)]

VJPs (a `pallas_call` with scalar prefetch has no JVP rule, hence `jax.custom_vjp`):

    sum        dx = broadcast(g)                        (zero on padding)
    mean       through sum, divided by max(length, 1)   (plain autodiff around the sum)
    max        dx = [x == broadcast(max)] * broadcast(g / ties)   (ties split evenly, as jnp.max)
    broadcast  dvalues = sum(g)

`impl="auto"` runs the kernels on TPU (or when `interpret=` is given) and kernels/reference.py
elsewhere; all functions are jitted with their options static.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from seqpack.kernels import reference
from seqpack.kernels.broadcast import broadcast_call
from seqpack.kernels.checks import check_metadata, check_smem, check_tokens_input
from seqpack.kernels.common import Impl, Interpret, SegmentBlockSizes, flat_metadata, use_pallas
from seqpack.kernels.reduce import Mode, reduce_call

_STATIC = ("impl", "interpret", "block_sizes")


@dataclasses.dataclass(frozen=True)
class _Static:
    """Static (hashable) configuration carried through custom_vjp as a nondiff argument."""

    seq_len: int
    num_segments: int
    dtype: jnp.dtype
    block_sizes: SegmentBlockSizes
    interpret: Interpret

    def reduce(self, x: jax.Array, offsets: jax.Array, lengths: jax.Array,
               mode: Mode) -> jax.Array:  # f[B, L, D] -> f32[B, S, D]
        return reduce_call(x, offsets, lengths, num_segments=self.num_segments, mode=mode,
                           block_sizes=self.block_sizes, interpret=self.interpret)

    def broadcast(self, values: jax.Array, offsets: jax.Array, lengths: jax.Array,
                  out_dtype: jnp.dtype) -> jax.Array:  # f[B, S, D] -> out_dtype[B, L, D]
        return broadcast_call(values, offsets, lengths, seq_len=self.seq_len, out_dtype=out_dtype,
                              block_sizes=self.block_sizes, interpret=self.interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _pallas_sum(x, offsets, lengths, st: _Static):  # f[B, L, D] -> f32[B, S, D]
    return st.reduce(x, offsets, lengths, "sum")


def _pallas_sum_fwd(x, offsets, lengths, st):
    return st.reduce(x, offsets, lengths, "sum"), (offsets, lengths)


def _pallas_sum_bwd(st, residuals, g):
    offsets, lengths = residuals
    return st.broadcast(g, offsets, lengths, st.dtype), None, None


_pallas_sum.defvjp(_pallas_sum_fwd, _pallas_sum_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _pallas_max(x, offsets, lengths, st: _Static):  # f[B, L, D] -> f32[B, S, D], -inf if empty
    return st.reduce(x, offsets, lengths, "max")


def _pallas_max_fwd(x, offsets, lengths, st):
    out = st.reduce(x, offsets, lengths, "max")
    return out, (x, offsets, lengths, out)


def _pallas_max_bwd(st, residuals, g):
    x, offsets, lengths, out = residuals
    # Padding gets broadcast value 0 and may "tie" with x == 0 there, but the tie count is a
    # segment sum (padding excluded) and the broadcast share is 0 on padding, so dx stays 0.
    ties = x.astype(jnp.float32) == st.broadcast(out, offsets, lengths, jnp.float32)
    count = st.reduce(ties.astype(jnp.float32), offsets, lengths, "sum")
    share = st.broadcast(g / jnp.maximum(count, 1.0), offsets, lengths, jnp.float32)
    return jnp.where(ties, share, 0.0).astype(st.dtype), None, None


_pallas_max.defvjp(_pallas_max_fwd, _pallas_max_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _pallas_broadcast(values, offsets, lengths, st: _Static):  # f[B, S, D] -> f[B, L, D]
    return st.broadcast(values, offsets, lengths, st.dtype)


def _pallas_broadcast_fwd(values, offsets, lengths, st):
    return st.broadcast(values, offsets, lengths, st.dtype), (offsets, lengths)


def _pallas_broadcast_bwd(st, residuals, g):
    offsets, lengths = residuals
    return st.reduce(g, offsets, lengths, "sum").astype(st.dtype), None, None


_pallas_broadcast.defvjp(_pallas_broadcast_fwd, _pallas_broadcast_bwd)


def _prepare(x, segment_offsets, segment_lengths, impl, interpret, block_sizes):
    """Static checks; None for the reference, else (x as [B, L, D], flat metadata, _Static)."""
    check_tokens_input("x", x)
    batch, seq_len = x.shape[:2]
    num_segments = check_metadata(segment_offsets, segment_lengths, batch)
    if not use_pallas(impl, interpret):
        return None
    check_smem(batch, num_segments)
    st = _Static(seq_len, num_segments, jnp.dtype(x.dtype), block_sizes or SegmentBlockSizes(),
                 interpret)
    x3 = x if x.ndim == 3 else x[:, :, None]
    return x3, *flat_metadata(segment_offsets, segment_lengths), st


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
    block_sizes: SegmentBlockSizes | None = None,
) -> jax.Array:  # f[B, S] or f[B, S, D]
    """Sum over each segment's tokens (f32 accumulation); 0 for empty slots."""
    args = _prepare(x, segment_offsets, segment_lengths, impl, interpret, block_sizes)
    if args is None:
        return reference.segment_sum(x, segment_offsets, segment_lengths)
    x3, offsets, lengths, st = args
    out = _pallas_sum(x3, offsets, lengths, st)
    return (out if x.ndim == 3 else out[..., 0]).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=_STATIC)
def segment_mean(
    x: jax.Array,  # f[B, L] or f[B, L, D]
    segment_offsets: jax.Array,  # int[B, S]
    segment_lengths: jax.Array,  # int[B, S]
    *,
    impl: Impl | str = "auto",
    interpret: Interpret = False,
    block_sizes: SegmentBlockSizes | None = None,
) -> jax.Array:  # f[B, S] or f[B, S, D]
    """Mean over each segment's tokens (f32 accumulation); 0 for empty slots."""
    args = _prepare(x, segment_offsets, segment_lengths, impl, interpret, block_sizes)
    if args is None:
        return reference.segment_mean(x, segment_offsets, segment_lengths)
    x3, offsets, lengths, st = args
    out = _pallas_sum(x3, offsets, lengths, st)
    out = out if x.ndim == 3 else out[..., 0]
    count = jnp.maximum(segment_lengths, 1).astype(jnp.float32)
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
    block_sizes: SegmentBlockSizes | None = None,
) -> jax.Array:  # f[B, S] or f[B, S, D]
    """Max over each segment's tokens; `fill_value` (default 0.0) for empty slots.

    `jax.ops.segment_max` fills empty segments with -inf instead; 0.0 keeps pooled features finite
    (no NaN from -inf * 0 downstream). The gradient is split evenly between tied maxima.
    """
    args = _prepare(x, segment_offsets, segment_lengths, impl, interpret, block_sizes)
    if args is None:
        return reference.segment_max(x, segment_offsets, segment_lengths, fill_value=fill_value)
    x3, offsets, lengths, st = args
    out = _pallas_max(x3, offsets, lengths, st)
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
    block_sizes: SegmentBlockSizes | None = None,
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
    if not use_pallas(impl, interpret):
        return reference.segment_broadcast(values, segment_offsets, segment_lengths,
                                           seq_len=seq_len)
    check_smem(batch, num_segments)
    st = _Static(seq_len, num_segments, jnp.dtype(values.dtype),
                 block_sizes or SegmentBlockSizes(), interpret)
    values3 = values if values.ndim == 3 else values[:, :, None]
    out = _pallas_broadcast(values3, *flat_metadata(segment_offsets, segment_lengths), st)
    return out if values.ndim == 3 else out[..., 0]
