"""Public segment_gather: one token per segment (first, last or k-th), with its custom VJP.

    segment_gather   x f[B, L(, D)] -> f[B, S(, D)]
    VJP              dx = the cotangent scattered back to the picked tokens: the broadcast kernel
                     over one-token "segments" [p, p + 1) (0 elsewhere)

`impl` (common.resolve_impl) picks the TPU kernel (tpu/gather.py, a data-dependent index map per
slot), the GPU kernel (gpu/gather.py, one gather-load per row) or kernels/reference.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from seqpack.kernels import gpu, reference, segment_ops, tpu
from seqpack.kernels.checks import check_metadata, check_tokens_input
from seqpack.kernels.common import (
    LANES,
    GpuBlockSizes,
    Impl,
    Interpret,
    SegmentBlockSizes,
    SegmentCall,
    check_multiple,
    gather_offset,
    resolve,
    target_position,
)
from seqpack.kernels.metadata import family_metadata


@dataclasses.dataclass(frozen=True)
class GatherBlockSizes:
    """Block sizes of the gather kernel.

    block_features: lanes per step (a multiple of 128; D itself when D is smaller). A step moves
      only rows x bd elements (16 x 2048 bf16 = 64 KiB), so wide blocks amortize the per-step cost.
    """

    block_features: int = 2048

    def __post_init__(self) -> None:
        check_multiple("block_features", self.block_features, LANES, " (lanes)")


@dataclasses.dataclass(frozen=True)
class _Static:
    """Static configuration (a custom_vjp nondiff argument): the picked token `k` (gather_offset),
    the gather kernel's block sizes, and the backward's broadcast call (same L, S, dtype)."""

    k: int
    block_sizes: GatherBlockSizes | GpuBlockSizes
    scatter: SegmentCall

    def gather(self, x, offsets, lengths):  # f[B, L, D] -> f[B, S, D]
        interpret = self.scatter.interpret
        if isinstance(self.block_sizes, GpuBlockSizes):
            out = gpu.gather_call(x, offsets, lengths, k=self.k, blocks=self.block_sizes,
                                  interpret=bool(interpret))
            return out[:, :self.scatter.num_segments]  # drop the padding slots
        return tpu.gather_call(x, offsets, lengths, k=self.k,
                               block_features=self.block_sizes.block_features,
                               interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _pallas_gather(x, offsets, lengths, st: _Static):
    return st.gather(x, offsets, lengths)


def _pallas_gather_fwd(x, offsets, lengths, st):
    return st.gather(x, offsets, lengths), (offsets, lengths)


def _pallas_gather_bwd(st, residuals, g):
    offsets, lengths = residuals  # in the family's layout (GPU: padded to sp slots, g has S)
    pos, valid = target_position(offsets, lengths, st.k, st.scatter.seq_len)
    dx = segment_ops.broadcast(g, (pos, valid.astype(jnp.int32)), st.scatter.dtype, st.scatter)
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
    impl, blocks = resolve(impl, interpret, block_sizes, GatherBlockSizes, "segment_gather")
    if impl is Impl.REFERENCE:
        return reference.segment_gather(x, segment_offsets, segment_lengths, position=position)
    metadata = family_metadata(segment_offsets, segment_lengths, impl)
    # The backward scatters with the broadcast kernel: the TPU one at its own block sizes.
    scatter_blocks = blocks if impl is Impl.PALLAS_GPU else SegmentBlockSizes()
    scatter = SegmentCall(seq_len, num_segments, jnp.dtype(x.dtype), scatter_blocks, interpret,
                          segment_ops.FAMILIES[impl])
    st = _Static(k, blocks, scatter)
    x3 = x if x.ndim == 3 else x[:, :, None]
    out = _pallas_gather(x3, *metadata, st)
    return out if x.ndim == 3 else out[..., 0]
