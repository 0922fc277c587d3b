"""Shared pieces of the segment kernels: impl dispatch, block sizes, metadata, in-kernel masks.

Every Pallas kernel in this package walks a row of `L` tokens in blocks of `block_tokens` and, for
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
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TypeVar

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu

# Two i32 arrays of B * S entries are scalar-prefetched into SMEM (1 MiB on TPU v4+, 16 KiB on
# v2/v3). Keep them to a quarter of the v4+ SMEM so the compiler's own scalars still fit.
SMEM_METADATA_BUDGET_BYTES = 256 * 1024
# The reduce kernels keep a [S, 1, block_features] f32 accumulator per row in VMEM; each (1, bd)
# slab is padded to 8 sublanes. Cap it (times two for double buffering) at this many bytes.
ACCUMULATOR_BUDGET_BYTES = 2 * 1024 * 1024
LANES = 128

Interpret = bool | pltpu.InterpretParams
E = TypeVar("E", bound=enum.Enum)


class Impl(enum.StrEnum):
    """Which implementation a public kernel function runs."""

    AUTO = "auto"  # Pallas on TPU, the XLA reference elsewhere
    PALLAS = "pallas"  # Pallas everywhere (on CPU only with `interpret=`)
    REFERENCE = "reference"  # the pure-jnp reference in kernels/reference.py


def parse_enum(cls: type[E], name: str, value: object) -> E:
    """cls(value), or a ValueError naming the option and its choices."""
    try:
        return cls(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{name}={value!r} is not known; pass one of {choices}") from None


def use_pallas(impl: Impl | str, interpret: Interpret) -> bool:
    """Resolves `impl`: True when the Pallas kernel should run (auto: on TPU or if interpreting)."""
    impl = parse_enum(Impl, "impl", impl)
    if impl is Impl.REFERENCE:
        return False
    if impl is Impl.PALLAS:
        return True
    return jax.default_backend() == "tpu" or bool(interpret)


@dataclasses.dataclass(frozen=True)
class SegmentBlockSizes:
    """Block sizes of the segment reduce and broadcast kernels.

    block_tokens: tokens per grid step along L. 512 rows x 512 lanes of bf16 is a 512 KiB block,
      large enough that the ~0.35 us per-step overhead is small next to its DMA, small enough that
      two buffers plus the accumulator stay far below the 16 MiB default scoped VMEM.
    block_features: lanes per grid step along D (a multiple of 128; D itself when D is smaller).
      Lowered further so the [S, 8, bd] f32 accumulator stays within ACCUMULATOR_BUDGET_BYTES.
    chunk: rows per `pl.ds` read inside a block. A multiple of 16 keeps every read aligned to the
      native (8, 128) f32 and (16, 128) bf16 tiles; 32 bounds the masked waste at the two clipped
      ends of a segment to 2 x 32 rows.
    """

    block_tokens: int = 512
    block_features: int = 512
    chunk: int = 32

    def __post_init__(self) -> None:
        if self.chunk <= 0 or self.chunk % 16:
            raise ValueError(f"{self.chunk=} must be a positive multiple of 16 (bf16 tile rows)")
        if self.block_tokens <= 0 or self.block_tokens % self.chunk:
            raise ValueError(
                f"{self.block_tokens=} must be a positive multiple of chunk={self.chunk}"
            )
        if self.block_features <= 0 or self.block_features % LANES:
            raise ValueError(f"{self.block_features=} must be a positive multiple of {LANES}")


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def token_block(seq_len: int, block_tokens: int, multiple: int) -> int:
    """Block along L: `block_tokens`, or L rounded up to `multiple` when the row is shorter."""
    return block_tokens if seq_len > block_tokens else round_up(seq_len, multiple)


def feature_block(dim: int, requested: int) -> int:
    """Block along a lane axis of size `dim`: the whole axis when it fits, else a multiple of 128.

    Prefers a multiple of 128 that divides `dim` (no partial last block); otherwise the last block
    is partial, which is safe for lanes: values never mix across lanes and out-of-range lanes of an
    output block are dropped on write.
    """
    if dim <= requested:
        return dim
    for bd in range(requested // LANES * LANES, 0, -LANES):
        if dim % bd == 0:
            return bd
    return requested // LANES * LANES


def flat_metadata(
    segment_offsets: jax.Array,  # int[B, S]
    segment_lengths: jax.Array,  # int[B, S]
) -> tuple[jax.Array, jax.Array]:
    """1-D i32 copies for SMEM (2-D SMEM arrays pad their minor dimension to 128 words)."""
    return (
        segment_offsets.astype(jnp.int32).reshape(-1),
        segment_lengths.astype(jnp.int32).reshape(-1),
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


def row_end(offsets_ref, lengths_ref, row: jax.Array, num_segments: int) -> jax.Array:
    """Used length of a row: the end of its last slot (slots are in order and never overlap)."""
    last = row * num_segments + (num_segments - 1)
    return offsets_ref[last] + lengths_ref[last]


def last_used_block(offsets_ref, lengths_ref, row: jax.Array, num_segments: int, block: int):
    """Index of the last token block holding any segment token (0 for an empty row)."""
    end = row_end(offsets_ref, lengths_ref, row, num_segments)
    return jnp.maximum(cdiv_nonneg(jnp.maximum(end, 0), block) - 1, 0)


def chunk_mask(start: jax.Array, lo: jax.Array, hi: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """Rows `start + i` of a chunk that fall inside the block-local interval [lo, hi)."""
    pos = start + lax.broadcasted_iota(jnp.int32, shape, 0)
    return (pos >= lo) & (pos < hi)


class Normalize(enum.StrEnum):
    """How `segment_cross_entropy` turns per-segment sums into one loss."""

    TOKENS = "tokens"  # sum of token losses / counted tokens in the batch
    SEGMENTS = "segments"  # mean over non-empty segments of each segment's mean token loss
    NONE = "none"  # sum of token losses


def gather_offset(position: str | int) -> int:
    """'first' -> 0, 'last' -> -1, k -> k (k < 0 counts from the segment's end)."""
    if position == "first":
        return 0
    if position == "last":
        return -1
    if isinstance(position, int) and not isinstance(position, bool):
        return position
    raise ValueError(f"{position=} must be 'first', 'last' or an int (k-th token, -1 = last)")


def target_position(
    offset: jax.Array, length: jax.Array, k: int, seq_len: int
) -> tuple[jax.Array, jax.Array]:
    """Token picked by `segment_gather` (clamped into [0, L)) and whether the segment has it."""
    index = k if k >= 0 else length + k
    valid = (length > 0) & (index >= 0) & (index < length)
    return jnp.clip(offset + index, 0, seq_len - 1), valid
