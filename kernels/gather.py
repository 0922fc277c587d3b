"""Public segment_gather: one token per segment (first, last or k-th), with its custom VJP.

    segment_gather   x f[B, L(, D)] -> f[B, S(, D)]
    VJP              dx = the cotangent scattered back to the picked tokens: the broadcast kernel
                     over one-token "segments" [p, p + 1) (0 elsewhere)

`impl` (common.resolve_impl) picks the TPU kernel (gather_tpu.py, a data-dependent index map per
slot), the GPU kernel (gather_gpu.py, one gather-load per row) or kernels/reference.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from seqpack.kernels import gather_gpu, gather_tpu, reference, segment_ops_gpu, segment_ops_tpu
from seqpack.kernels.checks import check_metadata, check_smem, check_tokens_input
from seqpack.kernels.common import (
    GpuBlockSizes,
    Impl,
    Interpret,
    SegmentBlockSizes,
    gather_offset,
    pick_block_sizes,
    resolve_impl,
    target_position,
)
from seqpack.kernels.metadata import flat_metadata, padded_metadata


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


@dataclasses.dataclass(frozen=True)
class _Static:
    seq_len: int
    num_segments: int
    k: int
    dtype: jnp.dtype
    block_sizes: GatherBlockSizes | GpuBlockSizes
    interpret: Interpret

    def gather(self, x, offsets, lengths):  # f[B, L, D] -> f[B, S, D]
        if isinstance(self.block_sizes, GpuBlockSizes):
            return gather_gpu.gather_call(x, offsets, lengths, num_segments=self.num_segments,
                                          k=self.k, blocks=self.block_sizes,
                                          interpret=bool(self.interpret))
        return gather_tpu.gather_call(x, offsets, lengths, num_segments=self.num_segments,
                                      k=self.k, block_features=self.block_sizes.block_features,
                                      interpret=self.interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _pallas_gather(x, offsets, lengths, st: _Static):
    return st.gather(x, offsets, lengths)


def _pallas_gather_fwd(x, offsets, lengths, st):
    return st.gather(x, offsets, lengths), (offsets, lengths)


def _pallas_gather_bwd(st, residuals, g):
    offsets, lengths = residuals
    pos, valid = target_position(offsets, lengths, st.k, st.seq_len)
    if isinstance(st.block_sizes, GpuBlockSizes):  # metadata padded to sp slots, g has S
        dx = segment_ops_gpu.broadcast_call(g, pos, valid.astype(jnp.int32), seq_len=st.seq_len,
                                            out_dtype=st.dtype, blocks=st.block_sizes,
                                            interpret=bool(st.interpret))
    else:
        dx = segment_ops_tpu.broadcast_call(g, pos, valid.astype(jnp.int32), seq_len=st.seq_len,
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
        metadata = padded_metadata(segment_offsets, segment_lengths)
    else:
        check_smem(batch, num_segments)
        metadata = flat_metadata(segment_offsets, segment_lengths)
    st = _Static(seq_len, num_segments, k, jnp.dtype(x.dtype), blocks, interpret)
    x3 = x if x.ndim == 3 else x[:, :, None]
    out = _pallas_gather(x3, *metadata, st)
    return out if x.ndim == 3 else out[..., 0]
