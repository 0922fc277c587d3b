"""Public segment_gather: one token per segment (first, last or k-th), with its custom VJP.

    segment_gather   x f[B, L(, D)] -> f[B, S(, D)]
    VJP              dx = the cotangent scattered back to the picked tokens: the broadcast kernel
                     over one-token "segments" [p, p + 1) (0 elsewhere)

`impl` (common.resolve_impl's table) picks a family of FAMILIES: the TPU one (tpu/gather.py, a
data-dependent index map per slot), the GPU one (gpu/gather.py, one gather-load per row), each
its wing's GATHER behind the GatherFamily protocol, or kernels/reference.py. A family also says
which segment-ops family, at which block sizes, its backward scatters with (`scatter_call`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from seqpack.kernels import gpu, reference, segment_ops, tpu
from seqpack.kernels.checks import check_metadata, check_tokens_input
from seqpack.kernels.common import (
    Family,
    GpuBlockSizes,
    Impl,
    Interpret,
    Registry,
    SegmentCall,
    gather_offset,
    target_position,
)
from seqpack.kernels.metadata import MetadataLayout, family_metadata
from seqpack.kernels.tpu import GatherBlockSizes  # also importable from here, as before


class GatherFamily(Family, Protocol):
    """A kernel family of segment_gather (`target`, `block_sizes`: common.Family).

    gather: x f[B, L, D], offsets / lengths in its `metadata_layout` -> f[B, S, D] (S =
    num_segments), the token `k` (common.gather_offset) of each slot, 0 where the slot lacks it.
    scatter_call: the broadcast its backward runs (a segment-ops family and its block sizes).
    """

    @property
    def metadata_layout(self) -> MetadataLayout: ...

    def scatter_call(self, seq_len: int, num_segments: int, dtype: jnp.dtype, blocks: Any,
                     interpret: Interpret) -> SegmentCall: ...

    def gather(self, x: jax.Array, offsets: jax.Array, lengths: jax.Array, *, k: int,
               num_segments: int, blocks: Any, interpret: Interpret) -> jax.Array: ...


# auto's order within a platform: the first family that can run here is taken.
FAMILIES: Registry[GatherFamily] = Registry("segment_gather", (tpu.GATHER, gpu.GATHER))


@dataclasses.dataclass(frozen=True)
class _Static:
    """Static configuration (a custom_vjp nondiff argument): the picked token `k` (gather_offset),
    the family that runs, its block sizes, and the backward's broadcast call (same L, S, dtype)."""

    k: int
    family: GatherFamily
    block_sizes: Any
    scatter: SegmentCall

    def gather(self, x, offsets, lengths):  # f[B, L, D] -> f[B, S, D]
        return self.family.gather(x, offsets, lengths, k=self.k,
                                  num_segments=self.scatter.num_segments,
                                  blocks=self.block_sizes, interpret=self.scatter.interpret)


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
    family, blocks = FAMILIES.resolve(impl, interpret, block_sizes, op="segment_gather")
    if family is None:
        return reference.segment_gather(x, segment_offsets, segment_lengths, position=position)
    metadata = family_metadata(segment_offsets, segment_lengths, family)
    scatter = family.scatter_call(seq_len, num_segments, jnp.dtype(x.dtype), blocks, interpret)
    st = _Static(k, family, blocks, scatter)
    x3 = x if x.ndim == 3 else x[:, :, None]
    out = _pallas_gather(x3, *metadata, st)
    return out if x.ndim == 3 else out[..., 0]
