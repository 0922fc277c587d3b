"""Packed-row metadata: from [B, L] segment ids, and in the layout each kernel family reads.

Packers such as Grain's `FirstFitPackIterDataset` give each row `segment_ids` numbered 1..n in
row order with 0 on padding, not offsets and lengths. `segment_metadata` (public) turns them into
the kernels' metadata under jit: slot j describes segment id j + 1 (its first position, its
token count), and slots with no tokens get length 0 and the row's used length as offset (the row
contract):

    segment_ids      [1, 1, 1, 0, 2, 2, 0, 0]      max_segments = 3
    segment_offsets  [0, 4, 6]
    segment_lengths  [3, 2, 0]

Each id must cover one contiguous run (as packers write them); ids above `max_segments` (and
negative ids) are not counted, so pass the packer's segment cap.

The kernels take the metadata in one of two layouts, a `MetadataLayout` each kernel family
declares (its `metadata_layout`), so the op modules never branch on the family:

    flat_metadata     FLAT (TPU): 1-D i32[B * S] offsets and lengths, scalar-prefetched into SMEM
    padded_metadata   PADDED (GPU): i32[B, sp], sp = S rounded up to a power of two (Triton
                      tiles), extra slots of length 0
    row_ends          both: i32[B] used length of each row (largest end of a non-empty slot)

`family_metadata` lays the metadata out for a layout or a family (and checks the flat layout
fits SMEM).
"""

from __future__ import annotations

import enum
import functools
from typing import Any

import jax
import jax.numpy as jnp

from seqpack.kernels.checks import check_smem
from seqpack.kernels.common import next_power_of_two


class MetadataLayout(enum.Enum):
    """How a kernel family reads the slot metadata (`family_metadata` lays it out so)."""

    FLAT = "flat"  # 1-D i32[B * S], scalar-prefetched into SMEM (the TPU kernels)
    PADDED = "padded"  # i32[B, sp], sp a power of two >= S (the Triton kernels' tiles)


@functools.partial(jax.jit, static_argnames=("max_segments",))
def segment_metadata(
    segment_ids: jax.Array,  # int[B, L], 1..n per row, 0 on padding
    max_segments: int,
) -> tuple[jax.Array, jax.Array]:  # i32[B, S], i32[B, S]
    """(segment_offsets, segment_lengths) i32[B, max_segments] from 1-based segment ids.

    A segment whose id is above `max_segments` is left out, its tokens treated as padding
    (no attention, no loss): pass the packer's cap, or check `lengths.sum(1)` against the
    rows' non-zero ids."""
    if segment_ids.ndim != 2 or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(
            f"segment_ids.shape={segment_ids.shape} dtype={segment_ids.dtype} must be int [B, L] "
            "(1..n per row, 0 on padding)"
        )
    if max_segments < 1:
        raise ValueError(f"{max_segments=} must be >= 1 (the packer's cap on segments per row)")
    batch, seq_len = segment_ids.shape
    ids = segment_ids.astype(jnp.int32)
    # Bucket 0 collects padding and ids out of [1, max_segments]; it is dropped at the end.
    bucket = jnp.where((ids >= 1) & (ids <= max_segments), ids, 0)
    rows = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], (batch, seq_len))
    positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
    shape = (batch, max_segments + 1)
    lengths = jnp.zeros(shape, jnp.int32).at[rows, bucket].add(1)[:, 1:]
    starts = jnp.full(shape, seq_len, jnp.int32).at[rows, bucket].min(positions)[:, 1:]
    used = jnp.max(jnp.where(lengths > 0, starts + lengths, 0), axis=1, keepdims=True)
    return jnp.where(lengths > 0, starts, used), lengths


def flat_metadata(
    segment_offsets: jax.Array,  # int[B, S]
    segment_lengths: jax.Array,  # int[B, S]
) -> tuple[jax.Array, jax.Array]:  # i32[B * S], i32[B * S]
    """1-D i32 copies for SMEM (2-D SMEM arrays pad their minor dimension to 128 words)."""
    return (
        segment_offsets.astype(jnp.int32).reshape(-1),
        segment_lengths.astype(jnp.int32).reshape(-1),
    )


def padded_metadata(
    segment_offsets: jax.Array,  # int[B, S]
    segment_lengths: jax.Array,  # int[B, S]
) -> tuple[jax.Array, jax.Array]:  # i32[B, sp], i32[B, sp]
    """i32 copies padded to a power-of-two number of slots (offset 0, length 0: ignored)."""
    num_segments = segment_offsets.shape[1]
    pad = ((0, 0), (0, next_power_of_two(num_segments) - num_segments))
    return (jnp.pad(segment_offsets.astype(jnp.int32), pad),
            jnp.pad(jnp.maximum(segment_lengths.astype(jnp.int32), 0), pad))


def family_metadata(
    segment_offsets: jax.Array,  # int[B, S]
    segment_lengths: jax.Array,  # int[B, S]
    layout: MetadataLayout | Any,  # or a kernel family: its `metadata_layout`
) -> tuple[jax.Array, jax.Array]:  # i32[B, sp] (PADDED) or i32[B * S] (FLAT), twice
    """Offsets and lengths in `layout`, or in the layout a family declares; a ValueError for
    anything else. The flat layout must fit the SMEM budget (checks.check_smem)."""
    layout = MetadataLayout(getattr(layout, "metadata_layout", layout))
    if layout is MetadataLayout.PADDED:
        return padded_metadata(segment_offsets, segment_lengths)
    check_smem(*segment_offsets.shape)
    return flat_metadata(segment_offsets, segment_lengths)


def row_ends(
    segment_offsets: jax.Array,  # int[B, S]
    segment_lengths: jax.Array,  # int[B, S]
    seq_len: int,
) -> jax.Array:  # i32[B]
    """Used length of each row: the largest end of a non-empty slot, within [0, L].

    Slots with length 0 are ignored whatever their offset (cu_seqlens-style metadata often pads
    them with offset 0), and slot order does not matter.
    """
    ends = segment_offsets.astype(jnp.int32) + segment_lengths.astype(jnp.int32)
    used = jnp.max(jnp.where(segment_lengths > 0, ends, 0), axis=1)
    return jnp.clip(used, 0, seq_len)
