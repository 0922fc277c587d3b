"""Packed-row metadata from [B, L] segment ids (Grain, MaxText, seqio): offsets and lengths [B, S].

Packers such as Grain's `FirstFitPackIterDataset` give each row `segment_ids` numbered 1..n in row
order with 0 on padding, not offsets and lengths. `segment_metadata` turns them into the kernels'
metadata under jit: slot j describes segment id j + 1 (its first position, its token count), and
slots with no tokens get length 0 and the row's used length as offset (the row contract):

    segment_ids      [1, 1, 1, 0, 2, 2, 0, 0]      max_segments = 3
    segment_offsets  [0, 4, 6]
    segment_lengths  [3, 2, 0]

Each id must cover one contiguous run (as packers write them); ids above `max_segments` (and
negative ids) are not counted, so pass the packer's segment cap.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.jit, static_argnames=("max_segments",))
def segment_metadata(
    segment_ids: jax.Array,  # int[B, L], 1..n per row, 0 on padding
    max_segments: int,
) -> tuple[jax.Array, jax.Array]:  # i32[B, S], i32[B, S]
    """(segment_offsets, segment_lengths) i32[B, max_segments] from 1-based segment ids."""
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
