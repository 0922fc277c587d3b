"""Public per-segment reductions and broadcast, with their custom VJPs wired to the Pallas kernels.

    segment_sum / segment_mean / segment_max   x f[B, L(, D)]       -> f[B, S(, D)]
    segment_broadcast                          values f[B, S(, D)]  -> f[B, L(, D)]

VJPs (a `pallas_call` with scalar prefetch has no JVP rule, hence `jax.custom_vjp`):

    sum        dx = broadcast(g)                        (zero on padding)
    mean       through sum, divided by max(length, 1)   (plain autodiff around the sum)
    max        dx = [x == broadcast(max)] * broadcast(g / ties)   (ties split evenly, as jnp.max)
    broadcast  dvalues = sum(g)

`impl` (common.resolve_impl's table) picks a family of FAMILIES, the TPU kernels
(tpu/segment_ops.py) or the GPU ones (gpu/segment_ops.py), or kernels/reference.py; the
SegmentCall carries the family to the VJPs. All functions are jitted with their options static.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from seqpack.kernels import gpu, reference, tpu
from seqpack.kernels.checks import check_metadata, check_tokens_input
from seqpack.kernels.common import (
    GpuBlockSizes,
    Impl,
    Interpret,
    Mode,
    Registry,
    SegmentBlockSizes,
    SegmentCall,
    SegmentFamily,
    per_slot,
)
from seqpack.kernels.metadata import family_metadata, row_ends

_STATIC = ("impl", "interpret", "block_sizes")
# auto's order within a platform: the first family that can run here is taken.
FAMILIES: Registry[SegmentFamily] = Registry("the segment ops",
                                             (tpu.SEGMENT_OPS, gpu.SEGMENT_OPS))
# offsets, lengths in the family's metadata_layout (metadata.family_metadata), then the row ends
Metadata = tuple[jax.Array, ...]


def reduce(x: jax.Array, meta: Metadata, mode: Mode, st: SegmentCall) -> jax.Array:
    """The reduce kernel of st's family (no checks, no VJP): f[B, L, D] -> f32[B, S, D]."""
    return st.family.reduce(x, *meta, mode=mode, st=st)


def broadcast(values: jax.Array, meta: Metadata, out_dtype: jnp.dtype,
              st: SegmentCall) -> jax.Array:
    """The broadcast kernel of st's family (no checks, no VJP): f[B, S, D] -> out_dtype[B, L, D].

    Also the gather's backward (its family's `scatter_call`); the TPU cross-entropy family calls
    its wing's broadcast kernel itself."""
    return st.family.broadcast(values, *meta[:2], out_dtype=out_dtype, st=st)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _pallas_sum(x, meta, st: SegmentCall):  # f[B, L, D] -> f32[B, S, D]
    return reduce(x, meta, "sum", st)


def _pallas_sum_fwd(x, meta, st):
    return reduce(x, meta, "sum", st), meta


def _pallas_sum_bwd(st, meta, g):
    return broadcast(g, meta, st.dtype, st), None


_pallas_sum.defvjp(_pallas_sum_fwd, _pallas_sum_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _pallas_max(x, meta, st: SegmentCall):  # f[B, L, D] -> f32[B, S, D], -inf if empty
    return reduce(x, meta, "max", st)


def _pallas_max_fwd(x, meta, st):
    out = reduce(x, meta, "max", st)
    return out, (x, meta, out)


def _pallas_max_bwd(st, residuals, g):
    x, meta, out = residuals
    # Padding gets broadcast value 0 and may "tie" with x == 0 there, but the tie count is a
    # segment sum (padding excluded) and the broadcast share is 0 on padding, so dx stays 0.
    ties = x.astype(jnp.float32) == broadcast(out, meta, jnp.float32, st)
    count = reduce(ties.astype(jnp.float32), meta, "sum", st)
    share = broadcast(g / jnp.maximum(count, 1.0), meta, jnp.float32, st)
    return jnp.where(ties, share, 0.0).astype(st.dtype), None


_pallas_max.defvjp(_pallas_max_fwd, _pallas_max_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _pallas_broadcast(values, meta, st: SegmentCall):  # f[B, S, D] -> f[B, L, D]
    return broadcast(values, meta, st.dtype, st)


def _pallas_broadcast_fwd(values, meta, st):
    return broadcast(values, meta, st.dtype, st), meta


def _pallas_broadcast_bwd(st, meta, g):
    return reduce(g, meta, "sum", st).astype(st.dtype), None


_pallas_broadcast.defvjp(_pallas_broadcast_fwd, _pallas_broadcast_bwd)


def _setup(segment_offsets, segment_lengths, *, seq_len, dtype, impl, interpret, block_sizes,
           name) -> tuple[Metadata, SegmentCall] | None:
    """None for the reference, else (metadata for the family FAMILIES picks, SegmentCall)."""
    family, blocks = FAMILIES.resolve(impl, interpret, block_sizes, op=name)
    if family is None:
        return None
    meta: Metadata = (*family_metadata(segment_offsets, segment_lengths, family),
                      row_ends(segment_offsets, segment_lengths, seq_len))
    st = SegmentCall(seq_len, segment_offsets.shape[1], jnp.dtype(dtype), blocks, interpret,
                     family)
    return meta, st


def _kernel_reduce(x, segment_offsets, segment_lengths, mode: Mode, impl, interpret,
                   block_sizes, name) -> jax.Array | None:
    """Static checks; None for the reference, else the kernel's f32[B, S(, D)] (x's rank)."""
    check_tokens_input("x", x)
    check_metadata(segment_offsets, segment_lengths, x.shape[0])
    setup = _setup(segment_offsets, segment_lengths, seq_len=x.shape[1], dtype=x.dtype,
                   impl=impl, interpret=interpret, block_sizes=block_sizes, name=name)
    if setup is None:
        return None
    x3 = x if x.ndim == 3 else x[:, :, None]
    out = (_pallas_sum if mode == "sum" else _pallas_max)(x3, *setup)
    return out if x.ndim == 3 else out[..., 0]


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
    out = _kernel_reduce(x, segment_offsets, segment_lengths, "sum", impl, interpret,
                         block_sizes, "segment_sum")
    if out is None:
        return reference.segment_sum(x, segment_offsets, segment_lengths)
    return out.astype(x.dtype)


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
    total = _kernel_reduce(x, segment_offsets, segment_lengths, "sum", impl, interpret,
                           block_sizes, "segment_mean")
    if total is None:
        return reference.segment_mean(x, segment_offsets, segment_lengths)
    return reference.mean_of_sums(total, segment_lengths).astype(x.dtype)


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
    out = _kernel_reduce(x, segment_offsets, segment_lengths, "max", impl, interpret,
                         block_sizes, "segment_max")
    if out is None:
        return reference.segment_max(x, segment_offsets, segment_lengths, fill_value=fill_value)
    nonempty = per_slot(segment_lengths > 0, x.ndim)
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
    values3 = values if values.ndim == 3 else values[:, :, None]
    out = _pallas_broadcast(values3, *setup)
    return out if values.ndim == 3 else out[..., 0]


@functools.partial(jax.jit, static_argnames=("num_datasets",))
def segment_dataset_loss(
    per_segment_loss: jax.Array,  # f[B, S]: loss sums, e.g. from segment_cross_entropy
    per_segment_tokens: jax.Array,  # int[B, S]: tokens counted in each sum
    segment_dataset_id: jax.Array,  # int[B, S]: the segment's dataset, -1 on unused slots
    *,
    num_datasets: int,
) -> tuple[jax.Array, jax.Array]:  # (f32[K] loss sums, i32[K] tokens)
    """Per-dataset loss sums and token counts of packed rows (K = num_datasets): a plain
    reduction over the `[B, S]` slots, so jit- and shard_map-friendly (psum the two outputs
    over the batch axes for global figures). The per-dataset mean loss is sums / tokens.
    Slots whose id is outside [0, K) count nowhere; masked with `where`, never multiplied."""
    if not isinstance(num_datasets, int) or num_datasets < 1:
        raise ValueError(f"{num_datasets=} must be an int >= 1 (the mixture's dataset count)")
    shapes = {x.shape for x in (per_segment_loss, per_segment_tokens, segment_dataset_id)}
    if len(shapes) != 1:
        raise ValueError(f"per_segment_loss, per_segment_tokens and segment_dataset_id must "
                         f"share one [B, S] shape, got {sorted(shapes)}")
    hit = segment_dataset_id[..., None] == jnp.arange(num_datasets, dtype=jnp.int32)
    axes = tuple(range(hit.ndim - 1))
    loss = jnp.where(hit, per_segment_loss[..., None].astype(jnp.float32), 0.0).sum(axes)
    tokens = jnp.where(hit, per_segment_tokens[..., None].astype(jnp.int32), 0).sum(axes)
    return loss, tokens
