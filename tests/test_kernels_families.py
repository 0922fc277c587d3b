"""The kernel-family registries: which family `impl=` picks on each backend and in what order,
what is refused (an unavailable family, an unregistered name, the wrong block sizes), and what
each family declares (its logsumexp layout, its metadata layout, its block-size class)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from seqpack import kernels
from seqpack.kernels import attention, cross_entropy, gather, gpu, segment_ops, tpu
from seqpack.kernels import attention_schedule as sched
from seqpack.kernels.common import (
    PALLAS_TPU,
    GpuBlockSizes,
    Impl,
    Registry,
    SegmentBlockSizes,
    SegmentCall,
    Target,
    resolve_impl,
    select,
)
from seqpack.kernels.fused import families as head
from seqpack.kernels.metadata import MetadataLayout, family_metadata
from seqpack.kernels.ring import Ring

REGISTRIES = {"attention": attention.FAMILIES, "segment_ops": segment_ops.FAMILIES,
              "cross_entropy": cross_entropy.FAMILIES, "gather": gather.FAMILIES,
              "loss_head": head.FAMILIES}
# the registries whose families read the slot metadata (metadata.family_metadata)
METADATA = ("segment_ops", "cross_entropy", "gather")
TPU_PARAMS = pltpu.InterpretParams()
# (backend, interpret) -> the platform whose family "auto" runs (None: the reference)
AUTO = [("tpu", False, "tpu"), ("gpu", False, "gpu"), ("cpu", False, None),
        ("cpu", True, "tpu"), ("tpu", True, "tpu"), ("gpu", True, "gpu"),
        ("gpu", TPU_PARAMS, "tpu"), ("cpu", TPU_PARAMS, "tpu")]


@dataclasses.dataclass(frozen=True)
class Fake:
    """A family with only what a Registry reads."""

    target: Target
    block_sizes: type = SegmentBlockSizes


@pytest.fixture
def backend(monkeypatch):
    def use(name: str) -> None:
        monkeypatch.setattr(jax, "default_backend", lambda: name)
    return use


@pytest.mark.parametrize("op", REGISTRIES)
@pytest.mark.parametrize("platform,interpret,want", AUTO)
def test_auto_runs_the_platforms_family(op, platform, interpret, want, backend):
    backend(platform)
    registry = REGISTRIES[op]
    family, blocks = registry.resolve("auto", interpret, None)
    if want is None:
        assert (family, blocks) == (None, None)
        return
    assert family is registry[{"tpu": Impl.PALLAS_TPU, "gpu": Impl.PALLAS_GPU}[want]]
    assert family.target.platform == want
    assert blocks == family.block_sizes()  # its defaults


@pytest.mark.parametrize("op", REGISTRIES)
@pytest.mark.parametrize("platform", ["tpu", "gpu", "cpu"])
@pytest.mark.parametrize("interpret", [False, True, TPU_PARAMS], ids=["none", "true", "params"])
@pytest.mark.parametrize("impl", [m.value for m in Impl if m is not Impl.CUDNN])
def test_every_registry_keeps_resolve_impls_table(op, platform, interpret, impl, backend):
    """Each op's registry picks what common.resolve_impl's documented table says, or refuses
    with the same error."""
    backend(platform)
    try:
        want = resolve_impl(impl, interpret)
    except ValueError as e:
        with pytest.raises(ValueError) as got:
            REGISTRIES[op].resolve(impl, interpret, None)
        assert str(got.value).split(". Choices")[0] == str(e).split(". Choices")[0]
        return
    family, _ = REGISTRIES[op].resolve(impl, interpret, None)
    assert (Impl.REFERENCE if family is None else family.target.impl) is want


def test_auto_tries_a_platforms_families_in_order(backend):
    """The first family of the platform that can run is taken: a library family listed ahead
    (not Pallas, as cuDNN's would be) wins while it is available, the Pallas one after it
    otherwise, and under interpret= (which only Pallas families run)."""
    why: list[str | None] = [None]
    library = Target(Impl.PALLAS_GPU, "gpu", pallas=False, requires=lambda: why[0])
    pallas = Target(Impl.PALLAS_GPU, "gpu")
    targets = (PALLAS_TPU, library, pallas)
    backend("gpu")
    assert select(targets, "auto", False) is library
    assert select(targets, "pallas", False) is pallas  # "pallas": Pallas families only
    assert select(targets, "auto", True) is pallas  # the library has no interpreter
    why[0] = "needs cuDNN >= 9.1"
    assert select(targets, "auto", False) is pallas
    backend("tpu")
    assert select(targets, "auto", False) is PALLAS_TPU
    backend("cpu")
    assert select(targets, "auto", False) is None
    assert select(targets, "auto", True) is PALLAS_TPU


def test_auto_falls_back_to_the_reference_where_no_family_can_run(backend):
    down = Target(Impl.PALLAS_TPU, "tpu", requires=lambda: "needs a newer libtpu")
    registry = Registry("an op", (Fake(down), Fake(Target(Impl.PALLAS_GPU, "gpu"))))
    backend("tpu")
    assert registry.resolve("auto", False, None) == (None, None)
    with pytest.raises(ValueError, match="impl='pallas_tpu' is not available here: needs a "
                                         "newer libtpu.*Choices: 'auto', 'pallas', 'pallas_tpu'"):
        registry.resolve("pallas", False, None)


@pytest.mark.parametrize("op", REGISTRIES)
def test_an_unavailable_family_is_never_picked_and_refused_by_name(op, backend, monkeypatch):
    registry = REGISTRIES[op]
    family = registry[Impl.PALLAS_GPU]
    monkeypatch.setattr(type(family), "target",
                        Target(Impl.PALLAS_GPU, "gpu", requires=lambda: "no Triton here"))
    backend("gpu")
    assert registry.resolve("auto", False, None) == (None, None)
    assert registry.resolve("auto", True, None) == (None, None)
    for impl, interpret in (("pallas_gpu", False), ("pallas_gpu", True), ("pallas", False)):
        with pytest.raises(ValueError, match="impl='pallas_gpu' is not available here: no Triton"):
            registry.resolve(impl, interpret, None)
    backend("tpu")  # the other platform's family is untouched
    assert registry.resolve("auto", False, None)[0] is registry[Impl.PALLAS_TPU]


def test_an_unavailable_family_is_refused_through_the_public_op(backend, monkeypatch):
    monkeypatch.setattr(type(gpu.SEGMENT_OPS), "target",
                        Target(Impl.PALLAS_GPU, "gpu", requires=lambda: "no Triton here"))
    x = jnp.ones((3, 37, 5), jnp.float32)  # shapes no other test traces: no cached trace
    offsets, lengths = jnp.array([[0, 10, 37]] * 3), jnp.array([[10, 20, 0]] * 3)
    with pytest.raises(ValueError, match="impl='pallas_gpu' is not available here"):
        kernels.segment_sum(x, offsets, lengths, impl="pallas_gpu", interpret=True)


def test_a_name_no_family_holds_is_refused():
    registry = Registry("an op", (Fake(PALLAS_TPU),))
    with pytest.raises(ValueError, match="impl='pallas_gpu' has no kernel family in an op.*"
                                         "Choices: 'auto', 'pallas', 'pallas_tpu', 'reference'"):
        registry.resolve("pallas_gpu", True, None)
    with pytest.raises(ValueError, match="has no kernel family in an op"):
        registry[Impl.PALLAS_GPU]


@pytest.mark.parametrize("impl,layout,blocks", [
    ("pallas_tpu", sched.LseLayout.BHL1, kernels.AttentionBlockSizes),
    ("pallas_gpu", sched.LseLayout.BHL, kernels.GpuAttentionBlockSizes),
])
def test_attention_families_declare_their_lse_layout_and_block_sizes(impl, layout, blocks):
    """What each family declares is what its kernels do: the forward's lse has the declared
    layout, and the backward takes it back (abstract evaluation, no kernel runs)."""
    family = attention.FAMILIES[Impl(impl)]
    assert family.lse_layout is layout and family.block_sizes is blocks
    assert family.needs_schedule and "blhd" in family.operands
    batch, seq_len, heads, dim = 2, 200, 4, 32
    q = jax.ShapeDtypeStruct((batch, seq_len, heads, dim), jnp.float32)
    kv = jax.ShapeDtypeStruct((batch, seq_len, 2, dim), jnp.float32)
    b = blocks()
    cfg = family.configure(sched.AttentionConfig(
        seq_len=seq_len, heads=heads, kv_heads=2, head_dim=dim, causal=True, scale=1.0,
        block_q=b.block_q, block_kv=b.block_kv, block_q_bwd=b.block_q_bwd,
        block_kv_bwd=b.block_kv_bwd, interpret=True), b, batch)
    s = sched.make_schedule(jnp.array([[0, 120]] * batch), jnp.array([[120, 80]] * batch), cfg)
    o, lse = jax.eval_shape(lambda q, k, v: family.forward(q, k, v, s, cfg), q, kv, kv)
    assert o.shape == q.shape and lse.shape == layout.shape(batch, heads, seq_len)
    grads = jax.eval_shape(lambda q, k, v, o, lse: family.backward(q, k, v, o, lse, o, s, cfg),
                           q, kv, kv, o, lse)
    assert [g.shape for g in grads] == [q.shape, kv.shape, kv.shape]


def test_every_family_declares_a_target_and_block_sizes():
    for registry in REGISTRIES.values():
        impls = [f.target.impl for f in registry.families]
        library = [Impl.CUDNN] if registry is attention.FAMILIES else []
        assert sorted(impls) == sorted([Impl.PALLAS_TPU, Impl.PALLAS_GPU, *library]), registry.op
        for family in registry.families:
            assert isinstance(family.block_sizes(), family.block_sizes)
            assert family.target.platform == {"pallas_tpu": "tpu", "pallas_gpu": "gpu",
                                              "cudnn": "gpu"}[family.target.impl]
            assert family.target.pallas == (family.target.impl is not Impl.CUDNN)


def _attention_args():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, 48, 2, 16)), jnp.float32)
    return q, q, q, jnp.array([[0, 20]]), jnp.array([[20, 28]])


@pytest.mark.parametrize("impl,given,want", [
    ("pallas_gpu", kernels.AttentionBlockSizes(), "GpuAttentionBlockSizes"),
    ("pallas_tpu", kernels.GpuAttentionBlockSizes(), "AttentionBlockSizes"),
])
def test_attention_refuses_another_familys_block_sizes(impl, given, want):
    with pytest.raises(ValueError, match=f"does not fit impl='{impl}' in segment_attention; "
                                         f"pass a {want} "):
        kernels.segment_attention(*_attention_args(), impl=impl, interpret=True,
                                  block_sizes=given)


def test_segment_ops_and_loss_head_refuse_another_familys_block_sizes():
    x = jnp.ones((1, 48, 4), jnp.float32)
    offsets, lengths = jnp.array([[0, 20]]), jnp.array([[20, 28]])
    with pytest.raises(ValueError, match="impl='pallas_tpu' in segment_sum; pass a "
                                         "SegmentBlockSizes"):
        kernels.segment_sum(x, offsets, lengths, impl="pallas_tpu", interpret=True,
                            block_sizes=kernels.GpuBlockSizes())
    w, targets = jnp.ones((4, 40), jnp.float32), jnp.zeros((1, 48), jnp.int32)
    with pytest.raises(ValueError, match="impl='pallas_gpu' in segment_linear_cross_entropy; "
                                         "pass a GpuBlockSizes"):
        kernels.segment_linear_cross_entropy(
            x, w, targets, offsets, lengths, mode="recompute", impl="pallas_gpu",
            interpret=True, block_sizes=kernels.LinearCrossEntropyBlockSizes())


def test_static_configs_carry_the_family_and_stay_hashable():
    """The family objects are equal by kind (fresh instances equal the registered ones) and tell
    the two platforms apart; the static configs that carry them hash and compare."""
    assert type(tpu.ATTENTION)() == tpu.ATTENTION and tpu.ATTENTION != gpu.ATTENTION
    cfg = sched.AttentionConfig(64, 2, 2, 16, True, 1.0, 128, 128, 128, 128, True)
    rings = [Ring("c", 2, 128, True, 1.0, family, cfg) for family in (tpu.ATTENTION,
                                                                      gpu.ATTENTION)]
    assert hash(rings[0]) == hash(Ring("c", 2, 128, True, 1.0, type(tpu.ATTENTION)(), cfg))
    assert rings[0] != rings[1]
    call = SegmentCall(64, 2, jnp.dtype(jnp.float32), SegmentBlockSizes(), True, tpu.SEGMENT_OPS)
    assert hash(call) == hash(dataclasses.replace(call)) and call.family is tpu.SEGMENT_OPS
    blocks = kernels.LinearCrossEntropyBlockSizes()
    tiling = tpu.LOSS_HEAD.tiling(64, 40, 8, blocks, None, True)
    assert hash(head.HeadCall(tpu.LOSS_HEAD, tiling)) == hash(head.HeadCall(tpu.LOSS_HEAD,
                                                                            tiling))


@pytest.mark.parametrize("op,impl,given,want", [
    ("segment_cross_entropy", "pallas_tpu", GpuBlockSizes(), "CrossEntropyBlockSizes"),
    ("segment_cross_entropy", "pallas_gpu", kernels.CrossEntropyBlockSizes(), "GpuBlockSizes"),
    ("segment_gather", "pallas_tpu", GpuBlockSizes(), "GatherBlockSizes"),
    ("segment_gather", "pallas_gpu", kernels.GatherBlockSizes(), "GpuBlockSizes"),
])
def test_cross_entropy_and_gather_refuse_another_familys_block_sizes(op, impl, given, want):
    x = jnp.ones((1, 48, 4), jnp.float32)
    offsets, lengths = jnp.array([[0, 20]]), jnp.array([[20, 28]])
    args = (x, jnp.zeros((1, 48), jnp.int32)) if op == "segment_cross_entropy" else (x,)
    with pytest.raises(ValueError, match=f"does not fit impl='{impl}' in {op}; pass a {want} "):
        getattr(kernels, op)(*args, offsets, lengths, impl=impl, interpret=True,
                             block_sizes=given)


def test_the_moved_block_sizes_stay_importable_where_they_were():
    assert cross_entropy.CrossEntropyBlockSizes is kernels.CrossEntropyBlockSizes
    assert cross_entropy.CrossEntropyBlockSizes is tpu.CROSS_ENTROPY.block_sizes
    assert gather.GatherBlockSizes is kernels.GatherBlockSizes is tpu.GATHER.block_sizes
    assert gpu.CROSS_ENTROPY.block_sizes is gpu.GATHER.block_sizes is GpuBlockSizes


@pytest.mark.parametrize("op", METADATA)
def test_families_declare_their_metadata_layout(op):
    """The TPU families read flat metadata (scalar-prefetched, within the SMEM budget), the GPU
    ones slots padded to a power of two; family_metadata lays it out by the family alone."""
    registry = REGISTRIES[op]
    offsets, lengths = jnp.array([[0, 5, 9]] * 2), jnp.array([[5, 4, 0]] * 2)
    shapes = {MetadataLayout.FLAT: (6,), MetadataLayout.PADDED: (2, 4)}
    for impl, layout in ((Impl.PALLAS_TPU, MetadataLayout.FLAT),
                         (Impl.PALLAS_GPU, MetadataLayout.PADDED)):
        family = registry[impl]
        assert family.metadata_layout is layout
        for got in (family_metadata(offsets, lengths, family),
                    family_metadata(offsets, lengths, layout)):
            assert [a.shape for a in got] == [shapes[layout]] * 2
            assert all(a.dtype == jnp.int32 for a in got)


def test_family_metadata_refuses_what_is_not_a_layout():
    offsets = lengths = jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ValueError, match="is not a valid MetadataLayout"):
        family_metadata(offsets, lengths, Impl.PALLAS_TPU)  # an Impl is not a layout
    with pytest.raises(ValueError, match="SMEM"):  # the flat layout's budget
        family_metadata(jnp.zeros((1024, 64), jnp.int32), jnp.zeros((1024, 64), jnp.int32),
                        tpu.SEGMENT_OPS)


@pytest.mark.parametrize("impl", [Impl.PALLAS_TPU, Impl.PALLAS_GPU])
def test_cross_entropy_families_run_forward_and_backward(impl):
    """Each family takes targets and mask as [B, L] (the TPU one makes its own columns) and
    gives per-slot sums [B, S] and dlogits like the logits (abstract evaluation)."""
    family = cross_entropy.FAMILIES[impl]
    batch, seq_len, vocab, nseg = 2, 40, 300, 3
    offsets, lengths = jnp.array([[0, 10, 30]] * batch), jnp.array([[10, 20, 0]] * batch)
    meta = family_metadata(offsets, lengths, family)
    st = family.tiling(seq_len, vocab, nseg, 0.0, family.block_sizes(), True)
    assert hash(st) == hash(family.tiling(seq_len, vocab, nseg, 0.0, family.block_sizes(), True))
    logits = jax.ShapeDtypeStruct((batch, seq_len, vocab), jnp.bfloat16)
    targets = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    mask = jax.ShapeDtypeStruct((batch, seq_len), jnp.float32)
    used = jnp.full((batch,), 30, jnp.int32)
    loss, count, lse = jax.eval_shape(
        lambda lg, t, m: family.forward(lg, t, m, *meta, used, st), logits, targets, mask)
    assert loss.shape == count.shape == (batch, nseg)
    g = jax.ShapeDtypeStruct((batch, nseg), jnp.float32)
    dlogits = jax.eval_shape(
        lambda lg, t, m, lse, g: family.backward(lg, t, m, lse, g, *meta, used, st),
        logits, targets, mask, lse, g)
    assert (dlogits.shape, dlogits.dtype) == (logits.shape, logits.dtype)


@pytest.mark.parametrize("impl,scatter_blocks", [
    (Impl.PALLAS_TPU, SegmentBlockSizes()),  # the broadcast kernel's own defaults
    (Impl.PALLAS_GPU, GpuBlockSizes(block_features=64)),  # the gather's, as given
])
def test_gather_families_own_their_scatter_and_slots(impl, scatter_blocks):
    """A gather family gives S slots (the GPU one slices its padded slots back) and says how
    its backward scatters: with its own wing's segment-ops family, at which block sizes."""
    family = gather.FAMILIES[impl]
    blocks = family.block_sizes(block_features=64 if impl is Impl.PALLAS_GPU else 128)
    call = family.scatter_call(40, 3, jnp.dtype(jnp.bfloat16), blocks, True)
    assert call.family is segment_ops.FAMILIES[impl] and call.block_sizes == scatter_blocks
    assert (call.seq_len, call.num_segments, call.dtype) == (40, 3, jnp.dtype(jnp.bfloat16))
    offsets, lengths = jnp.array([[0, 10, 30]] * 2), jnp.array([[10, 20, 0]] * 2)
    meta = family_metadata(offsets, lengths, family)
    x = jax.ShapeDtypeStruct((2, 40, 200), jnp.bfloat16)
    out = jax.eval_shape(lambda x: family.gather(x, *meta, k=-1, num_segments=3, blocks=blocks,
                                                 interpret=True), x)
    assert (out.shape, out.dtype) == ((2, 3, 200), x.dtype)
