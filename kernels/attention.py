"""Public segment_attention: attention within packed segments, whose schedule follows the segments.

    segment_attention   q f[B, L, H, D], k, v f[B, L, K, D] (H % K == 0) -> f[B, L, H, D]

A token attends to the earlier tokens (causal) or all tokens of its own segment; tokens outside
every segment give 0. The kernels visit only the pairs of (query block, key block) that hold
tokens of one segment (attention_schedule.py: the schedule, its worked example and its bound),
where a masked kernel computes the whole causal triangle (how much is skipped on real rows:
benchmarks/README.md).

    pallas_tpu   tpu/attention.py (forward), tpu/attention_bwd.py (dq, dk / dv): the schedule
                 is scalar-prefetched; data-dependent index maps repeat the last block of a
                 range (no copy) and `pl.when` skips the compute of the steps past it
    pallas_gpu   gpu/attention.py: the same schedule as loop bounds (`lax.fori_loop`)
    cudnn        gpu/cudnn.py: cuDNN's packed flash attention fed the offsets and lengths
                 (Hopper; guarded, differentiated by cuDNN itself)
    reference    kernels/reference.py: dense and masked, on any backend

The kernel families are looked up in FAMILIES (a common.Registry of
attention_schedule.AttentionFamily: each wing's family.py says its block sizes, whether it runs
on the schedule, its logsumexp layout and its calls); `impl="auto"` takes the first of the
current platform's families that can run here and take the call (`refuses`), else the
reference. A new backend is one more wing with a family, listed in FAMILIES ahead of the one it
should win over. cuDNN stands behind pallas_gpu until a chip has measured it faster
(`impl="cudnn"` runs it).

Forward and backward are a `custom_vjp` (dq, dk, dv; no gradient for the metadata), flash
attention style: an online softmax in f32 whatever the input dtype (bfloat16, float16, float32),
the f32 logsumexp saved for the backward, which recomputes the probabilities. Matmul inputs stay
in the input dtype with f32 accumulation (probabilities are cast to it for `p @ v`, as in every
flash kernel), so bfloat16 agrees with the f32 reference to bfloat16 rounding.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu

from seqpack.kernels import gpu, reference, ring, tpu
from seqpack.kernels.attention_schedule import (
    AttentionCall,
    AttentionConfig,
    AttentionFamily,
    Schedule,
    make_schedule,
)
from seqpack.kernels.checks import FLOAT_DTYPES, check_metadata
from seqpack.kernels.common import Impl, Interpret, Registry
from seqpack.kernels.context_parallel import LAYOUTS
from seqpack.kernels.gpu import GpuAttentionBlockSizes
from seqpack.kernels.tpu import AttentionBlockSizes

# auto's order within a platform: the first family that can run here is taken.
FAMILIES: Registry[AttentionFamily] = Registry("segment_attention",
                                              (tpu.ATTENTION, gpu.ATTENTION,
                                               gpu.CUDNN_ATTENTION))
Setup = tuple[Schedule | None, AttentionConfig, AttentionFamily]
BLOCKS = ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd")


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _pallas_attention(q, k, v, sched: Schedule | None, cfg: AttentionConfig,
                      family: AttentionFamily):
    return family.forward(q, k, v, sched, cfg)[0]


def _pallas_attention_fwd(q, k, v, sched, cfg, family):
    o, lse = family.forward(q, k, v, sched, cfg)
    return o, (q, k, v, sched, o, lse)


def _pallas_attention_bwd(cfg, family, residuals, do):
    q, k, v, sched, o, lse = residuals
    dq, dk, dv = family.backward(q, k, v, o, lse, do, sched, cfg)
    return dq, dk, dv, None


_pallas_attention.defvjp(_pallas_attention_fwd, _pallas_attention_bwd)


def _check(q, k, v, segment_offsets, segment_lengths) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4 or jnp.dtype(x.dtype) not in FLOAT_DTYPES:
            raise ValueError(f"{name}.shape={x.shape} dtype={x.dtype} must be float "
                             f"{'[B, L, H, D]' if name == 'q' else '[B, L, K, D]'}")
    if k.shape != v.shape or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"k {k.shape} {k.dtype} and v {v.shape} {v.dtype} must match, in q's "
                         f"dtype {q.dtype}")
    batch, seq_len, heads, dim = q.shape
    if k.shape[:2] != (batch, seq_len) or k.shape[3] != dim or heads % k.shape[2]:
        raise ValueError(f"k.shape={k.shape} must be [B, L, K, D] = [{batch}, {seq_len}, K, {dim}]"
                         f" with K dividing the H={heads} query heads (grouped-query attention)")
    if seq_len < 1 or dim < 1:
        raise ValueError(f"q.shape={q.shape} needs L >= 1 and D >= 1")
    check_metadata(segment_offsets, segment_lengths, batch)


def _call(q, k, causal: bool, ring: bool) -> AttentionCall:
    return AttentionCall(jnp.dtype(q.dtype), q.shape[2], k.shape[2], q.shape[3], causal, ring)


def _config(q, k, *, causal, scale, blocks, interpret, family: AttentionFamily,
            count_visits) -> AttentionConfig:
    """The call's config, fitted by the family (which refuses a call it cannot run)."""
    batch, seq_len, heads, dim = q.shape
    cfg = AttentionConfig(
        seq_len=seq_len, heads=heads, kv_heads=k.shape[2], head_dim=dim, causal=causal,
        scale=float(dim**-0.5 if scale is None else scale), interpret=interpret,
        count_visits=count_visits,
        **{name: getattr(blocks, name, 0) for name in BLOCKS})  # 0: a family without blocks
    return family.configure(cfg, blocks, batch)


def _setup(q, k, v, segment_offsets, segment_lengths, *, causal, scale, impl, interpret,
           block_sizes, count_visits=False, schedule=None) -> Setup | None:
    """Checks; None for the reference, else (Schedule or None, AttentionConfig, the family).
    q, k, v: [B, L, N, D] (or their shapes, for operands passed [B, N, L, D]); `schedule`: one
    made beforehand (segment_attention_schedule), checked against the call's."""
    _check(q, k, v, segment_offsets, segment_lengths)
    family, blocks = FAMILIES.resolve(impl, interpret, block_sizes,
                                      call=_call(q, k, causal, ring=False))
    if family is None:
        return None
    cfg = _config(q, k, causal=causal, scale=scale, blocks=blocks, interpret=interpret,
                  family=family, count_visits=count_visits)
    if not family.needs_schedule:
        return None, cfg, family
    if schedule is None:
        return make_schedule(segment_offsets, segment_lengths, cfg), cfg, family
    want = jax.eval_shape(functools.partial(make_schedule, cfg=cfg), segment_offsets,
                          segment_lengths)
    got = jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), tuple(schedule))
    if got != jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), tuple(want)):
        raise ValueError("schedule= was made for another call (its arrays' shapes differ from "
                         "this call's: another L, causality, block sizes or family); make it "
                         "with "
                         "segment_attention_schedule and this call's q, k, causal, impl, "
                         "interpret and block_sizes")
    return Schedule(*schedule), cfg, family


def _ring(q, k, v, segment_offsets, segment_lengths, axis: str, *, causal, scale, impl,
          interpret, block_sizes, layout, positions, count_visits=False) -> ring.Ring | None:
    """The ring of a call with a context_parallel_axis (None when the axis has one rank)."""
    _check(q, k, v, segment_offsets, segment_lengths)
    if layout not in (*LAYOUTS, "balanced"):
        raise ValueError(f"context_parallel_layout={layout!r} must be one of "
                         f"{(*LAYOUTS, 'balanced')}")
    if positions is None and layout not in LAYOUTS:
        raise ValueError(f"context_parallel_layout={layout!r} is not computed on device: pass "
                         "this rank's row positions, context_parallel_positions= (the batch's "
                         "'<feature>_row_positions', sharded as q is)")
    if positions is not None and (tuple(positions.shape) != tuple(q.shape[:2]) or
                                  not jnp.issubdtype(positions.dtype, jnp.integer)):
        raise ValueError(f"context_parallel_positions: {positions.dtype}{list(positions.shape)} "
                         f"must be integer [B, L/C] = {list(q.shape[:2])}, this rank's tokens' "
                         "row positions")
    try:
        size = lax.axis_size(axis)
    except NameError:
        raise ValueError(f"context_parallel_axis={axis!r} is not an axis here: call "
                         "segment_attention inside shard_map over a mesh with that axis") from None
    if size == 1:
        return None
    computed = layout if layout in LAYOUTS else "te"  # unused where positions are given
    if q.shape[1] % 2:
        raise ValueError(f"q.shape={q.shape}: a rank's shard of the load-balanced layout holds "
                         "L / C tokens, an even number (rows are multiples of 2C)")
    family, blocks = FAMILIES.resolve(impl, interpret, block_sizes,
                                      call=_call(q, k, causal, ring=True))
    dim = q.shape[3]
    scale = float(dim**-0.5 if scale is None else scale)
    if family is None:
        if count_visits:
            raise ValueError("visited_block_pairs counts the Pallas kernels' visits; pass "
                             "impl='pallas_tpu' or 'pallas_gpu' (with interpret= on a CPU)")
        return ring.Ring(axis, size, q.shape[1] * size, causal, scale, layout=computed)
    if not family.needs_schedule:
        raise ValueError(f"impl={family.target.impl.value!r} does not run on the block schedule "
                         "that each ring step computes; pass impl='reference' or a Pallas family")
    # causality is in each step's bounds: the kernels run non-causal
    cfg = _config(q, k, causal=False, scale=scale, blocks=blocks, interpret=interpret,
                  family=family, count_visits=count_visits)
    return ring.Ring(axis, size, q.shape[1] * size, causal, scale, family, cfg,
                     skip=not isinstance(interpret, pltpu.InterpretParams), layout=computed)


def _positions(positions, offsets, lengths, cp: ring.Ring) -> jax.Array:
    """This rank's row positions: the caller's, else computed from the metadata."""
    if positions is None:
        return ring.local_positions(offsets, lengths, cp)
    return positions.astype(jnp.int32)


def _check_options(layout: str, axis, positions, schedule) -> None:
    if axis is None and positions is not None:
        raise ValueError("context_parallel_positions is for a call with a "
                         "context_parallel_axis (inside shard_map)")
    if axis is not None and schedule is not None:
        raise ValueError("schedule= is not for a call with a context_parallel_axis: each ring "
                         "step schedules its own blocks")
    if layout not in ("blhd", "bhld"):
        raise ValueError(f"{layout=} must be 'blhd' (q [B, L, H, D]) or 'bhld' (q [B, H, L, D])")


def _heads_second(x: jax.Array) -> jax.Array:  # [B, L, N, D] <-> [B, N, L, D]
    return x.transpose(0, 2, 1, 3)


def _relayout(xs: tuple, layout: str, want: str) -> tuple:
    """Arrays in `layout` ("blhd" / "bhld") as `want`: as they are, or heads and L swapped."""
    return xs if layout == want else tuple(map(_heads_second, xs))


def _shape_of(x: jax.Array, layout: str):
    """[B, L, N, D] view of an operand (its shape and dtype alone) for the checks."""
    if layout == "blhd":
        return x
    if len(x.shape) != 4:
        raise ValueError(f"shape={x.shape} must be [B, N, L, D] with layout='bhld'")
    batch, heads, seq_len, dim = x.shape
    return jax.ShapeDtypeStruct((batch, seq_len, heads, dim), x.dtype)


@functools.partial(jax.jit, static_argnames=("causal", "scale", "impl", "interpret",
                                             "block_sizes", "context_parallel_axis",
                                             "context_parallel_layout", "layout"))
def segment_attention(
    q: jax.Array,  # f[B, L, H, D] (layout="bhld": f[B, H, L, D])
    k: jax.Array,  # f[B, L, K, D], H % K == 0
    v: jax.Array,  # f[B, L, K, D]
    segment_offsets: jax.Array,  # int[B, S]
    segment_lengths: jax.Array,  # int[B, S]
    *,
    layout: str = "blhd",
    causal: bool = True,
    scale: float | None = None,
    impl: Impl | str = "auto",
    interpret: Interpret = False,
    block_sizes: AttentionBlockSizes | GpuAttentionBlockSizes | None = None,
    context_parallel_axis: str | None = None,
    context_parallel_layout: str = "te",
    context_parallel_positions: jax.Array | None = None,  # int[B, L/C]
    schedule: Schedule | None = None,
) -> jax.Array:  # f[B, L, H, D]
    """softmax(q k^T * scale) v within each segment (scale default D^-0.5); 0 outside segments.

    Query head h uses key/value head h // (H / K). `layout`: "blhd" (q [B, L, H, D]) or "bhld"
    (q [B, H, L, D], splash attention's; the result in the same layout). Each family's kernels
    read one layout (its `operands[0]`: the TPU's [B, H, L, D], the GPU's [B, L, H, D]); other
    operands are transposed once, here, outside the custom VJP, where XLA fuses the transpose
    into the neighbouring ops. `impl`: common.resolve_impl's table over FAMILIES, and "cudnn";
    `block_sizes`: the family's class, AttentionBlockSizes for the TPU kernels,
    GpuAttentionBlockSizes for the Triton ones.

    context_parallel_axis: a mesh axis of C ranks; call inside `shard_map`, q / k / v being this
    rank's `[B, L/C, ...]` shard of the load-balanced layout (`packer.context_parallel_order`,
    rows packed with `PackConfig(context_parallel=C)`; `context_parallel_layout` names it: "te",
    "rotated" or "balanced", the last with `context_parallel_positions`, this rank's tokens' row
    positions, which any layout may pass) and the metadata the whole rows' `[B, S]`, every
    used offset a multiple of 2C (not checked here, under jit: other rows give wrong values;
    `validate_segments(..., context_parallel=C)` checks a host batch). Returns this rank's
    shard of the result: ring attention (ring.py), K / V passed round by `ppermute`, each
    step's blocks scheduled from the metadata.

    schedule: the block schedule of this call made once per batch by segment_attention_schedule
    (same q / k shapes, metadata, causal, impl, interpret, block_sizes) and handed to every
    layer's call, instead of each call computing its own; not with a context_parallel_axis.
    """
    _check_options(layout, context_parallel_axis, context_parallel_positions, schedule)
    views = [_shape_of(x, layout) for x in (q, k, v)]  # [B, L, N, D] for the checks
    if context_parallel_axis is not None:
        cp = _ring(*views, segment_offsets, segment_lengths, context_parallel_axis,
                   causal=causal, scale=scale, impl=impl, interpret=interpret,
                   block_sizes=block_sizes, layout=context_parallel_layout,
                   positions=context_parallel_positions)
        if cp is not None:  # the ring reads [B, L/C, N, D]
            run = ring.reference_ring if cp.family is None else ring.pallas_ring
            out = run(*_relayout((q, k, v), layout, "blhd"), segment_offsets, segment_lengths,
                      _positions(context_parallel_positions, segment_offsets, segment_lengths,
                                 cp), cp)
            return _relayout((out,), "blhd", layout)[0]
    setup = _setup(*views, segment_offsets, segment_lengths, causal=causal, scale=scale,
                   impl=impl, interpret=interpret, block_sizes=block_sizes, schedule=schedule)
    if setup is None:
        out = reference.segment_attention(*_relayout((q, k, v), layout, "blhd"),
                                          segment_offsets, segment_lengths, causal=causal,
                                          scale=scale)
        return _relayout((out,), "blhd", layout)[0]
    sched, cfg, family = setup
    want = family.operands[0]  # the one layout the kernels are handed: transposed once, here,
    # outside the custom VJP, so XLA may fuse it into the neighbouring ops (splash's QKVLayout)
    operands = _relayout((q, k, v), layout, want)
    if family.own_vjp:
        out = family.attend(*operands, segment_offsets, segment_lengths, cfg)
    else:
        out = _pallas_attention(*operands, sched, dataclasses.replace(cfg, operand=want), family)
    return _relayout((out,), want, layout)[0]


def segment_attention_schedule(
    q: jax.Array | jax.ShapeDtypeStruct,  # f[B, L, H, D] (layout="bhld": [B, H, L, D])
    k: jax.Array | jax.ShapeDtypeStruct,  # f[B, L, K, D]
    segment_offsets: jax.Array,  # int[B, S]
    segment_lengths: jax.Array,  # int[B, S]
    *,
    layout: str = "blhd",
    causal: bool = True,
    impl: Impl | str = "auto",
    interpret: Interpret = False,
    block_sizes: AttentionBlockSizes | GpuAttentionBlockSizes | None = None,
) -> Schedule | None:
    """The block schedule segment_attention computes for a call with these q / k shapes and
    options: made once per batch and passed to every layer (`schedule=`), a model's layers
    share one (a few O(B L) ops) whatever the compiler hoists. None where the family that runs
    takes none (the reference, cuDNN): segment_attention then ignores `schedule=None`."""
    if layout not in ("blhd", "bhld"):
        raise ValueError(f"{layout=} must be 'blhd' (q [B, L, H, D]) or 'bhld' (q [B, H, L, D])")
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k)]
    q, k = (_shape_of(x, layout) for x in shapes)
    setup = _setup(q, k, k, segment_offsets, segment_lengths, causal=causal, scale=None,
                   impl=impl, interpret=interpret, block_sizes=block_sizes)
    return None if setup is None else setup[0]


@functools.partial(jax.jit, static_argnames=("causal", "scale", "impl", "interpret",
                                             "block_sizes", "context_parallel_axis",
                                             "context_parallel_layout"))
def visited_block_pairs(
    q: jax.Array,  # f[B, L, H, D]
    k: jax.Array,  # f[B, L, K, D]
    v: jax.Array,  # f[B, L, K, D]
    segment_offsets: jax.Array,  # int[B, S]
    segment_lengths: jax.Array,  # int[B, S]
    do: jax.Array | None = None,  # f[B, L, H, D], the output's cotangent (default ones)
    *,
    causal: bool = True,
    scale: float | None = None,
    impl: Impl | str = "pallas",
    interpret: Interpret = False,
    block_sizes: AttentionBlockSizes | GpuAttentionBlockSizes | None = None,
    context_parallel_axis: str | None = None,
    context_parallel_layout: str = "te",
    context_parallel_positions: jax.Array | None = None,  # int[B, L/C]
) -> dict[str, jax.Array]:
    """Debug: the kernels' results and how many block pairs each kernel computed.

    Runs the forward and both backward kernels (counting runs the dq kernel apart, even where
    fused_bwd would form dq in the dk / dv kernel) with a counter output (+1 at every computed
    step, inside the kernel): {"visits_fwd": i32[B, H, nq], "visits_dq": i32[B, H, nq'],
    "visits_dkv": i32[B, K, nk'] (summed over the G query heads of the group), the results "o",
    "dq", "dk", "dv", and the schedule's ranges "lo", "hi" (forward block sizes), "lo_bwd",
    "hi_bwd"}, for tests and benchmarks. With a context_parallel_axis (inside shard_map) each
    count and range gets a leading axis of the C ring steps, and "ran" bool[C] says which
    steps ran kernels at all (ring.ring_visits).
    """
    if context_parallel_axis is not None:
        cp = _ring(q, k, v, segment_offsets, segment_lengths, context_parallel_axis,
                   causal=causal, scale=scale, impl=impl, interpret=interpret,
                   block_sizes=block_sizes, layout=context_parallel_layout,
                   positions=context_parallel_positions, count_visits=True)
        if cp is not None:
            do = jnp.ones_like(q) if do is None else do
            return ring.ring_visits(q, k, v, segment_offsets, segment_lengths,
                                    _positions(context_parallel_positions, segment_offsets,
                                               segment_lengths, cp), do, cp)
    setup = _setup(q, k, v, segment_offsets, segment_lengths, causal=causal, scale=scale,
                   impl=impl, interpret=interpret, block_sizes=block_sizes, count_visits=True)
    if setup is None:
        raise ValueError("visited_block_pairs counts the Pallas kernels' visits; pass "
                         "impl='pallas_tpu' or 'pallas_gpu' (with interpret= on a CPU)")
    sched, cfg, family = setup
    if sched is None:
        raise ValueError(f"visited_block_pairs counts visits of the block schedule, which "
                         f"impl={family.target.impl.value!r} does not run on")
    o, lse, visits_fwd = family.forward(q, k, v, sched, cfg)
    do = jnp.ones_like(o) if do is None else do
    (dq, dk, dv), visits_dq, visits_dkv = family.backward(q, k, v, o, lse, do, sched, cfg)
    return {"visits_fwd": visits_fwd, "visits_dq": visits_dq, "visits_dkv": visits_dkv, "o": o,
            "dq": dq, "dk": dk, "dv": dv, "lo": sched.lo, "hi": sched.hi,
            "lo_bwd": sched.lo_bwd, "hi_bwd": sched.hi_bwd}
