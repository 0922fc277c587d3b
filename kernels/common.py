"""Shared pieces of the kernels: impl dispatch, block sizes, tile sizes, in-kernel masks, launch.

What the public ops and both kernel wings (tpu/, gpu/; the package docstring lists the files)
share: `resolve` (the implementation and its block sizes), the block-size classes and their
checks, `SegmentCall` (the static configuration of the reduce / broadcast kernels, which the
gather and cross-entropy backwards call too) and its `Mode`, tile sizes, masks, and `triton_call`
(how every GPU kernel is launched). The wings import these, never each other.

The segment kernels walk a row of `L` tokens in blocks of `block_tokens` and, for
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
from typing import Any, Literal, TypeVar

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

# Two i32 arrays of B * S entries are scalar-prefetched into SMEM (1 MiB on TPU v4+, 16 KiB on
# v2/v3). Keep them to a quarter of the v4+ SMEM so the compiler's own scalars still fit.
SMEM_METADATA_BUDGET_BYTES = 256 * 1024
# The reduce kernels keep a [S, 1, block_features] f32 accumulator per row in VMEM; each (1, bd)
# slab is padded to 8 sublanes. Cap it (times two for double buffering) at this many bytes.
ACCUMULATOR_BUDGET_BYTES = 2 * 1024 * 1024
LANES = 128

Interpret = bool | pltpu.InterpretParams
Mode = Literal["sum", "max"]  # what the reduce kernels compute per segment
E = TypeVar("E", bound=enum.Enum)


class Impl(enum.StrEnum):
    """Which implementation a public kernel function runs."""

    AUTO = "auto"  # the current backend's kernel on TPU and GPU, the XLA reference elsewhere
    PALLAS = "pallas"  # the current backend's kernel (on CPU: the TPU kernel, with `interpret=`)
    PALLAS_TPU = "pallas_tpu"  # the Pallas TPU (Mosaic) kernel
    PALLAS_GPU = "pallas_gpu"  # the Pallas GPU (Triton) kernel
    REFERENCE = "reference"  # the pure-jnp reference in kernels/reference.py


def parse_enum(cls: type[E], name: str, value: object) -> E:
    """cls(value), or a ValueError naming the option and its choices."""
    try:
        return cls(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{name}={value!r} is not known; pass one of {choices}") from None


_NATIVE = {"tpu": Impl.PALLAS_TPU, "gpu": Impl.PALLAS_GPU}


def resolve_impl(impl: Impl | str, interpret: Interpret) -> Impl:
    """`impl` -> REFERENCE, PALLAS_TPU or PALLAS_GPU for the current backend, or a ValueError.

        impl         on tpu       on gpu       on cpu              on cpu with interpret=
        auto         pallas_tpu   pallas_gpu   reference           pallas_tpu
        pallas       pallas_tpu   pallas_gpu   ValueError          pallas_tpu
        pallas_tpu   pallas_tpu   ValueError   pallas_tpu *        pallas_tpu
        pallas_gpu   ValueError   pallas_gpu   pallas_gpu *        pallas_gpu (interpret=True only)

    With `interpret=` on a TPU or GPU backend, the backend's own family runs interpreted; the
    ValueErrors name the backend and the choices.
    * accepted so the kernel can be lowered for its platform ahead of time
    (`jax.jit(f).trace(...).lower(lowering_platforms=("tpu",))` / `("cuda",)`); running it on
    the CPU needs `interpret=`. `pltpu.InterpretParams` is TPU semantics, so it selects the TPU
    kernel under "auto" / "pallas" and is refused with "pallas_gpu".
    """
    impl = parse_enum(Impl, "impl", impl)
    backend = jax.default_backend()
    choices = ", ".join(repr(m.value) for m in Impl)
    tpu_interpreter = isinstance(interpret, pltpu.InterpretParams)
    if impl is Impl.REFERENCE:
        return impl
    if impl in (Impl.AUTO, Impl.PALLAS):
        if tpu_interpreter:
            return Impl.PALLAS_TPU
        if backend in _NATIVE:
            return _NATIVE[backend]
        if interpret:
            return Impl.PALLAS_TPU
        if impl is Impl.AUTO:
            return Impl.REFERENCE
        raise ValueError(
            f"impl='pallas' has no kernel on the {backend!r} backend (Pallas kernels exist for "
            f"'tpu' and 'gpu'); pass impl='reference', or interpret=True to simulate a kernel "
            f"family on the CPU (impl='pallas_tpu' or 'pallas_gpu'). Choices: {choices}"
        )
    if impl is Impl.PALLAS_GPU and tpu_interpreter:
        raise ValueError(
            "impl='pallas_gpu' cannot run under pltpu.InterpretParams (the TPU interpreter); "
            "pass interpret=True"
        )
    foreign = {Impl.PALLAS_TPU: "gpu", Impl.PALLAS_GPU: "tpu"}[impl]
    if backend == foreign and not interpret:
        raise ValueError(
            f"impl={impl.value!r} cannot run on the {backend!r} backend; pass impl='auto' or "
            f"'pallas' (the {backend!r} kernel), 'reference', or interpret=True. Choices: "
            f"{choices}"
        )
    return impl


def check_multiple(name: str, value: int, multiple: int, why: str = "") -> None:
    """The block-size rule of the Mosaic (TPU) kernels: a positive multiple of `multiple`."""
    if value <= 0 or value % multiple:
        raise ValueError(f"{name}={value} must be a positive multiple of {multiple}{why}")


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
        check_multiple("chunk", self.chunk, 16, " (bf16 tile rows)")
        check_multiple("block_tokens", self.block_tokens, self.chunk, f" (chunk={self.chunk})")
        check_multiple("block_features", self.block_features, LANES, " (lanes)")


def check_power_of_two(name: str, value: int, least: int = 1) -> None:
    """The tile rule of the Triton kernels: a power of two, at least `least` (16 for `tl.dot`)."""
    if value < least or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two >= {least} (Triton tiles)")


@dataclasses.dataclass(frozen=True)
class GpuBlockSizes:
    """Tile sizes of the Pallas GPU (Triton) kernels; every size a power of two (Triton's rule).

    block_tokens x block_features: the [rows, lanes] tile the reduce, broadcast and gather kernels
      load per step (32 x 256 = 8192 elements: 64 f32 registers per thread at 4 warps).
    ce_block_tokens x block_vocab: the logits tile of the cross-entropy kernels (16 x 512: the same
      8192 elements, and the exp / where temporaries stay in registers).
    head_block_tokens x head_block_vocab: the logits tile of the fused loss head
      (segment_linear_cross_entropy), summed over head_block_hidden-wide chunks of H; its backward
      adds (tokens + vocab) x H f32 per tile for 6 x tokens x vocab x H FLOPs, so the tile is
      squarer than the cross-entropy's (64 x 128: 64 f32 registers a thread at 4 warps).
    num_warps: warps per program (Triton's `num_warps`).
    token_splits: programs per segment in the reduce kernel, taking its tiles in turn (tile c goes
      to program c % token_splits), so one long segment still spreads over several SMs.
    Defaults are chosen by register budget (their measurements: benchmarks/README.md).
    """

    block_tokens: int = 32
    block_features: int = 256
    ce_block_tokens: int = 16
    block_vocab: int = 512
    num_warps: int = 4
    token_splits: int = 4
    head_block_tokens: int = 64
    head_block_vocab: int = 128
    head_block_hidden: int = 32

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "token_splits":
                if value < 1:
                    raise ValueError(f"token_splits={value} must be >= 1")
            else:
                check_power_of_two(field.name, value)


def resolve(impl: Impl | str, interpret: Interpret, block_sizes, tpu_type: type, name: str,
            gpu_type: type | None = None) -> tuple[Impl, Any]:
    """(resolve_impl(impl, interpret), the block sizes for it): the family's default when
    `block_sizes` is None, else checked against the family; None for the reference.

    gpu_type: the GPU family's block-size class (default GpuBlockSizes).
    """
    impl = resolve_impl(impl, interpret)
    if impl is Impl.REFERENCE:
        return impl, None
    want = (gpu_type or GpuBlockSizes) if impl is Impl.PALLAS_GPU else tpu_type
    if block_sizes is None:
        return impl, want()
    if not isinstance(block_sizes, want):
        raise ValueError(
            f"block_sizes={block_sizes!r} does not fit impl={impl.value!r} in {name}; pass a "
            f"{want.__name__} (or None for its defaults)"
        )
    return impl, block_sizes


@dataclasses.dataclass(frozen=True)
class SegmentCall:
    """Static (hashable) configuration of one call of the reduce / broadcast kernels, carried
    through custom_vjp as a nondiff argument.

    The kernel family follows the block sizes: GpuBlockSizes runs kernels/gpu/segment_ops.py
    (metadata i32[B, sp] from `metadata.padded_metadata`), SegmentBlockSizes the TPU kernels in
    kernels/tpu/segment_ops.py (flat i32[B * S] metadata and the rows' used lengths, scalar-
    prefetched).
    """

    seq_len: int
    num_segments: int
    dtype: jnp.dtype  # of the differentiated input: the dtype of its cotangent
    block_sizes: SegmentBlockSizes | GpuBlockSizes
    interpret: Interpret

    @property
    def gpu(self) -> GpuBlockSizes | None:
        """The Triton tile sizes when the GPU family runs, else None."""
        return self.block_sizes if isinstance(self.block_sizes, GpuBlockSizes) else None

    @property
    def tpu(self) -> SegmentBlockSizes:
        """The TPU block sizes (only when the TPU family runs)."""
        assert isinstance(self.block_sizes, SegmentBlockSizes)
        return self.block_sizes


def per_slot(a: jax.Array, ndim: int) -> jax.Array:
    """[B, S] -> broadcastable against [B, S, D] when the data has `ndim` = 3 dimensions."""
    return a.reshape(a.shape + (1,) * (ndim - 2))


def next_power_of_two(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


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
class LossHeadTiling:
    """What both families' fused loss-head kernels are configured by (each wing's LinearTiling
    adds its own fields); hashable: a custom_vjp nondiff argument."""

    seq_len: int
    vocab: int
    block_tokens: int
    block_vocab: int
    softcap: float | None  # logits c * tanh(z / c); None: plain


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


# -- GPU (Triton) helpers -------------------------------------------------------------------------
def tile(size: int, requested: int) -> int:
    """A power-of-two tile edge: `requested`, or `size` rounded up to a power of two if smaller."""
    return min(requested, next_power_of_two(size))


def slot_membership(offsets_ref, lengths_ref, row, positions):
    """[n, sp] bool: position i lies in slot j of `row` (slots of length 0 cover nothing)."""
    sp = offsets_ref.shape[1]
    starts = offsets_ref[row, pl.ds(0, sp)]
    ends = starts + lengths_ref[row, pl.ds(0, sp)]
    pos = positions[:, None]
    return (pos >= starts[None, :]) & (pos < ends[None, :])


def first_slot(member):
    """[n, sp] membership -> [n] i32 index of the first covering slot, sp where none covers."""
    sp = member.shape[1]
    slots = lax.broadcasted_iota(jnp.int32, member.shape, 1)
    return jnp.min(jnp.where(member, slots, sp), axis=1)


def varying_like(out_shapes: list[jax.ShapeDtypeStruct], *args: Any
                 ) -> list[jax.ShapeDtypeStruct]:
    """`out_shapes` varying over the mesh axes the inputs vary over: inside `shard_map` (which
    checks how values vary, `check_vma`) a pallas_call's outputs must say so; elsewhere they
    come back unchanged. The inputs' widest manual axis type is taken."""
    types = [getattr(jax.typeof(a), "manual_axis_type", None) for a in args
             if isinstance(a, jax.Array | jax.core.Tracer)]
    widest = max((t for t in types if t is not None), key=lambda t: len(t.varying), default=None)
    if widest is None or not widest.varying:
        return out_shapes
    return [jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=widest) for s in out_shapes]


def triton_call(kernel, *, out_shape, grid: tuple[int, ...], num_warps: int, interpret: Interpret,
                name: str, num_stages: int = 2):
    """`pl.pallas_call` of a GPU (Triton) kernel: no BlockSpecs, every ref is the whole array in
    global memory and the kernel loads and stores tiles with masks at computed positions."""
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=grid,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=bool(interpret), name=name)
