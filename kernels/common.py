"""Shared pieces of the kernels: the family registry, block sizes, tile sizes, launch.

What the public ops and both kernel wings (tpu/, gpu/; the package docstring lists the files)
share: the kernel families' seam (`Target`: where a family runs; `select`: which one `impl=`
picks; `Registry`: one op's families, keyed by `Impl`, in auto's order), the block-size classes
and their checks, `SegmentCall` (the static configuration of the reduce / broadcast kernels,
which the gather and cross-entropy backwards call too) and its `Mode`, tile sizes, and
`triton_call` (how every GPU kernel is launched). The wings import these, never each other.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

if TYPE_CHECKING:  # metadata.py imports this module
    from seqpack.kernels.metadata import MetadataLayout

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
    CUDNN = "cudnn"  # cuDNN's packed flash attention (segment_attention on a Hopper GPU)
    REFERENCE = "reference"  # the pure-jnp reference in kernels/reference.py


def parse_enum(cls: type[E], name: str, value: object) -> E:
    """cls(value), or a ValueError naming the option and its choices."""
    try:
        return cls(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{name}={value!r} is not known; pass one of {choices}") from None


ACCELERATORS = ("tpu", "gpu")  # the backends kernel families compile for


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a kernel family runs, what `select` reads: its name (the `impl=` value, its key in a
    Registry), the jax backend it compiles for, whether it is a Pallas family (which "pallas"
    may pick and `interpret=` runs anywhere), and `requires`: why it cannot run in this
    installation (versions, chip) or None, or None where it always can."""

    impl: Impl
    platform: str
    pallas: bool = True
    requires: Callable[[], str | None] | None = None

    def refusal(self, backend: str, interpret: Interpret) -> str | None:
        """Why the family cannot run on `backend` with `interpret`, or None. Off its platform
        it runs interpreted, or lowered ahead of time where no accelerator is attached."""
        name = f"impl={self.impl.value!r}"
        if isinstance(interpret, pltpu.InterpretParams) and self.platform != "tpu":
            return (f"{name} cannot run under pltpu.InterpretParams (the TPU interpreter); "
                    "pass interpret=True")
        if interpret and not self.pallas:
            return f"{name} has no interpreter (not a Pallas family); pass interpret=False"
        if not interpret and backend in ACCELERATORS and backend != self.platform:
            return (f"{name} cannot run on the {backend!r} backend; pass impl='auto' or 'pallas' "
                    f"(the {backend!r} kernel), 'reference', or interpret=True")
        reason = self.requires() if self.requires else None
        return f"{name} is not available here: {reason}" if reason else None


PALLAS_TPU = Target(Impl.PALLAS_TPU, "tpu")  # the Mosaic kernels, kernels/tpu/
PALLAS_GPU = Target(Impl.PALLAS_GPU, "gpu")  # the Triton kernels, kernels/gpu/


def select(targets: Sequence[Target], impl: Impl | str, interpret: Interpret,
           op: str = "kernels") -> Target | None:
    """The target `impl` picks among `targets` (auto's order), or None for the reference.

    "auto" and "pallas" take the first target of the platform here that can run ("pallas":
    Pallas targets only): the backend's own, or the TPU's under `pltpu.InterpretParams` and with
    `interpret=` on a backend no family compiles for; where none can, "auto" runs the reference
    and "pallas" raises. A target named outright must be among `targets` and able to run here.
    """
    impl = parse_enum(Impl, "impl", impl)
    if impl is Impl.REFERENCE:
        return None
    backend = jax.default_backend()
    pallas = [t for t in targets if t.pallas]
    choices = ", ".join(repr(n) for n in ("auto", "pallas", *(t.impl.value for t in targets),
                                          "reference"))
    if impl not in (Impl.AUTO, Impl.PALLAS):
        target = next((t for t in targets if t.impl is impl), None)
        why = (f"impl={impl.value!r} has no kernel family in {op}" if target is None
               else target.refusal(backend, interpret))
        if why:
            raise ValueError(f"{why}. Choices: {choices}")
        return target
    platform = backend
    if isinstance(interpret, pltpu.InterpretParams) or (
            interpret and backend not in {t.platform for t in targets}):
        platform = "tpu"  # what interpret= simulates where the backend has no family
    mine = [t for t in (targets if impl is Impl.AUTO else pallas) if t.platform == platform]
    refusals = [t.refusal(backend, interpret) for t in mine]
    if None in refusals or impl is Impl.AUTO:
        return next((t for t, why in zip(mine, refusals) if why is None), None)
    if refusals:
        raise ValueError(f"{'; '.join(filter(None, refusals))}. Choices: {choices}")
    platforms = " and ".join(repr(p) for p in dict.fromkeys(t.platform for t in pallas))
    names = " or ".join(repr(t.impl.value) for t in pallas)
    raise ValueError(
        f"impl='pallas' has no kernel on the {backend!r} backend (Pallas kernels exist for "
        f"{platforms}); pass impl='reference', or interpret=True to simulate a kernel family "
        f"on the CPU (impl={names}). Choices: {choices}")


def resolve_impl(impl: Impl | str, interpret: Interpret) -> Impl:
    """`impl` -> REFERENCE, PALLAS_TPU or PALLAS_GPU for the current backend, or a ValueError.

        impl         on tpu       on gpu       on cpu              on cpu with interpret=
        auto         pallas_tpu   pallas_gpu   reference           pallas_tpu
        pallas       pallas_tpu   pallas_gpu   ValueError          pallas_tpu
        pallas_tpu   pallas_tpu   ValueError   pallas_tpu *        pallas_tpu
        pallas_gpu   ValueError   pallas_gpu   pallas_gpu *        pallas_gpu (interpret=True only)

    With `interpret=` on a TPU or GPU backend, the backend's own family runs interpreted.
    * accepted so the kernel can be lowered for its platform ahead of time (`lowering_platforms`
    "tpu" / "cuda"); running it on the CPU needs `interpret=`. `pltpu.InterpretParams` (TPU
    semantics) selects the TPU kernel under "auto" / "pallas" and is refused with "pallas_gpu".
    This is `select` over the Pallas targets; each op's Registry applies it to its families.
    """
    target = select((PALLAS_TPU, PALLAS_GPU), impl, interpret)
    return Impl.REFERENCE if target is None else target.impl


class Family(Protocol):
    """What a Registry reads of a kernel family; each op's protocol adds its kernels."""

    @property
    def target(self) -> Target: ...

    @property
    def block_sizes(self) -> type: ...  # its block-size class, whose instance is its defaults


F = TypeVar("F", bound=Family)


def fit_block_sizes(block_sizes: Any, want: type, impl: Impl, op: str) -> Any:
    """`block_sizes` when a `want` (None: its defaults), else a ValueError naming the family."""
    if block_sizes is not None and not isinstance(block_sizes, want):
        raise ValueError(f"block_sizes={block_sizes!r} does not fit impl={impl.value!r} in {op}; "
                         f"pass a {want.__name__} (or None for its defaults)")
    return want() if block_sizes is None else block_sizes


@dataclasses.dataclass(frozen=True)
class Registry(Generic[F]):
    """The kernel families of one op, keyed by their Impl, in auto's order within a platform."""

    op: str
    families: tuple[F, ...]

    def __getitem__(self, impl: Impl) -> F:
        for family in self.families:
            if family.target.impl is impl:
                return family
        raise ValueError(f"impl={impl.value!r} has no kernel family in {self.op}")

    def resolve(self, impl: Impl | str, interpret: Interpret, block_sizes: Any,
                op: str | None = None, call: Any = None) -> tuple[F | None, Any]:
        """(the family `impl` picks here (`select`), its block sizes: its defaults for None,
        else checked against its class); (None, None) for the reference. `op` names the caller
        in errors. A family's `refuses(call)`, where it has one, turns down one call (a dtype, a
        head dim): "auto" and "pallas" pass over it, and over a library family (not Pallas)
        when `block_sizes` are given; named outright, it raises with its reason."""
        op = op or self.op
        refuses = lambda f: getattr(f, "refuses", lambda c: None)(call) if call else None  # noqa: E731
        families = self.families
        if parse_enum(Impl, "impl", impl) in (Impl.AUTO, Impl.PALLAS):
            families = tuple(f for f in families
                             if not refuses(f) and (block_sizes is None or f.target.pallas))
        target = select([f.target for f in families], impl, interpret, op)
        if target is None:
            return None, None
        family = self[target.impl]
        if why := refuses(family):
            raise ValueError(f"impl={target.impl.value!r} cannot run this {op} call: {why}")
        return family, fit_block_sizes(block_sizes, family.block_sizes, target.impl, op)


def check_multiple(name: str, value: int, multiple: int, why: str = "") -> None:
    """The block-size rule of the Mosaic (TPU) kernels: a positive multiple of `multiple`."""
    if value <= 0 or value % multiple:
        raise ValueError(f"{name}={value} must be a positive multiple of {multiple}{why}")


@dataclasses.dataclass(frozen=True)
class SegmentBlockSizes:
    """Block sizes of the segment reduce and broadcast kernels.

    block_tokens: tokens per grid step along L (512 x 512 bf16: a 512 KiB block, its DMA long
      next to a step's overhead, two buffers far below the default scoped VMEM).
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
      squarer than the cross-entropy's (64 x 128: 64 f32 registers a thread at 4 warps). The
      backward sums H in head_block_hidden_bwd chunks: its x^T da is a Hopper wgmma from 64 rows.
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
    head_block_hidden_bwd: int = 64

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "token_splits":
                if value < 1:
                    raise ValueError(f"token_splits={value} must be >= 1")
            else:
                check_power_of_two(field.name, value)


class SegmentFamily(Family, Protocol):
    """A kernel family of the segment reduce and broadcast (its Registry: segment_ops.py).

    offsets / lengths in the layout it declares (`metadata_layout`, which
    metadata.family_metadata reads), ends: the rows' used lengths (metadata.row_ends), which a
    family may ignore.
    """

    @property
    def metadata_layout(self) -> MetadataLayout: ...

    def reduce(self, x: jax.Array, offsets: jax.Array, lengths: jax.Array, ends: jax.Array, *,
               mode: Mode, st: SegmentCall) -> jax.Array: ...  # f[B, L, D] -> f32[B, S, D]

    def broadcast(self, values: jax.Array, offsets: jax.Array, lengths: jax.Array, *,
                  out_dtype: jnp.dtype, st: SegmentCall) -> jax.Array: ...  # -> [B, L, D]


@dataclasses.dataclass(frozen=True)
class SegmentCall:
    """Static (hashable) configuration of one call of the reduce / broadcast kernels, carried
    through custom_vjp as a nondiff argument: the family that runs and its block sizes
    (SegmentBlockSizes for the TPU family, GpuBlockSizes for the GPU one). The gather and
    cross-entropy backwards call the broadcast too.
    """

    seq_len: int
    num_segments: int
    dtype: jnp.dtype  # of the differentiated input: the dtype of its cotangent
    block_sizes: SegmentBlockSizes | GpuBlockSizes
    interpret: Interpret
    family: SegmentFamily

    @property
    def gpu(self) -> GpuBlockSizes:
        """The Triton tile sizes (the GPU family's kernels read them)."""
        assert isinstance(self.block_sizes, GpuBlockSizes)
        return self.block_sizes

    @property
    def tpu(self) -> SegmentBlockSizes:
        """The TPU block sizes (the TPU family's kernels read them)."""
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
