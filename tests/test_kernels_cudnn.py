"""The cuDNN family of segment_attention (kernels/gpu/cudnn.py) without a GPU: its guard, its
metadata, and the whole op on a jnp stand-in that reads memory as cuDNN does
(tests/helpers/cudnn.py: jax's own offset fix-up, NaN where cuDNN writes nothing), against the
reference; and the op lowered for CUDA to cuDNN's custom calls. On the chip: tests/test_device.py.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax._src.cudnn import fused_attention_stablehlo as fused

from seqpack import kernels
from seqpack.kernels import attention, reference
from seqpack.kernels.attention_schedule import AttentionCall
from seqpack.kernels.common import Impl
from seqpack.kernels.gpu import cudnn
from tests.helpers import cudnn as stand_in
from tests.helpers.kernels import lower_cuda, metadata, random_rows

B, L, D = 3, 64, 16
ROWS = [[(0, 10), (12, 20), (40, 24)], [(0, L)], []]


@pytest.fixture
def on_stand_in(monkeypatch):
    stand_in.install(monkeypatch, cudnn)


def _fixed(q_seqlen, kv_seqlen, q_offsets, kv_offsets, query, key):
    """jax's fix-up as PR #39521 made it: key offsets scaled by the key's own heads (the old
    fix-up given the key as both tensors)."""
    _, _, kv_fixed, _ = _FIX_SEQLEN_OFFSETS(kv_seqlen, kv_seqlen, kv_offsets, kv_offsets, key, key)
    q_seqlen, kv_seqlen, q_offsets, _ = _FIX_SEQLEN_OFFSETS(q_seqlen, kv_seqlen, q_offsets,
                                                            kv_offsets, query, key)
    return q_seqlen, kv_seqlen, q_offsets, kv_fixed


_FIX_SEQLEN_OFFSETS = fused._fix_seqlen_offsets


def _rows():
    offsets, lengths = metadata(ROWS, 4)
    lengths[0, 1] = 0  # an empty slot between two used ones
    return jnp.asarray(offsets), jnp.asarray(lengths)


def _inputs(heads, kv_heads, dtype, seed=0, seq_len=L, batch=B):
    rng = np.random.default_rng(seed)
    shape = lambda n: (batch, seq_len, n, D)  # noqa: E731
    return [jnp.asarray(rng.normal(size=shape(n)), dtype) for n in (heads, kv_heads, kv_heads)]


def _loss_and_grads(impl, q, k, v, offsets, lengths, causal=True):
    def loss(q, k, v):
        o = kernels.segment_attention(q, k, v, offsets, lengths, impl=impl, causal=causal)
        return (o.astype(jnp.float32) ** 2).sum(), o
    (value, o), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return value, o, grads


def _padding(offsets, lengths, seq_len=L):
    pos = np.arange(seq_len)[None, :, None]
    off, n = np.asarray(offsets)[:, None, :], np.asarray(lengths)[:, None, :]
    return ~((pos >= off) & (pos < off + n)).any(-1)


def _assert_like_reference(q, k, v, offsets, lengths, causal=True):
    _, o, grads = _loss_and_grads("cudnn", q, k, v, offsets, lengths, causal)
    _, o_ref, grads_ref = _loss_and_grads("reference", q, k, v, offsets, lengths, causal)
    pad = _padding(offsets, lengths, q.shape[1])
    for name, a, b in zip(("o", "dq", "dk", "dv"), (o, *grads), (o_ref, *grads_ref)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.isfinite(a).all(), name
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2 * max(np.abs(b).max(), 1),
                                   err_msg=name)
        assert not a[pad].any(), f"{name}: nonzero on padding"


@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.slow)])
def test_cudnn_family_matches_the_reference_and_keeps_padding_out(on_stand_in, causal, dtype):
    """Values and gradients, MHA; NaN in the padding of q, k and v reaches nothing, and what the
    stand-in leaves unwritten (NaN) never comes out."""
    offsets, lengths = _rows()
    q, k, v = _inputs(4, 4, dtype)
    pad = jnp.asarray(_padding(offsets, lengths))[:, :, None, None]
    nan = [jnp.where(pad, jnp.nan, x).astype(dtype) for x in (q, k, v)]
    _assert_like_reference(*nan, offsets, lengths, causal)
    seqlen, starts = cudnn.packed_metadata(offsets, lengths)
    raw = stand_in.dot_product_attention(  # the library alone: garbage on padding
        q, k, v, q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=starts, kv_offsets=starts,
        scale=0.25, mask_type=fused.MaskType.PADDING_CAUSAL)
    assert np.isnan(np.asarray(raw, np.float32)[np.asarray(pad[..., 0, 0])]).all()


def test_packed_metadata_marks_every_empty_slot():
    offsets = jnp.array([[0, 5, 5, 9], [0, 64, 64, 64]])
    lengths = jnp.array([[5, 0, 4, 0], [64, 0, 0, 0]])
    seqlen, starts = cudnn.packed_metadata(offsets, lengths)
    np.testing.assert_array_equal(seqlen, [[5, -1, 4, -1], [64, -1, -1, -1]])
    np.testing.assert_array_equal(starts, [[0, -1, 5, -1, -1], [0, -1, -1, -1, -1]])


@pytest.mark.slow
def test_gqa_is_refused_exactly_where_jax_reads_the_wrong_keys(on_stand_in, monkeypatch):
    """The probe of jax's fix-up says whether GQA is right here: where it says no, the op refuses
    impl="cudnn" and the library, run anyway, gives wrong values; with the fix-up as PR #39521
    made it, the probe says yes and the op matches the reference."""
    offsets, lengths = _rows()
    q, k, v = _inputs(4, 2, jnp.bfloat16)
    fixed = cudnn.kv_offsets_follow_key_heads()
    run = lambda: cudnn.ATTENTION.attend(  # noqa: E731 (past the guard)
        q, k, v, offsets, lengths, attention._config(
            q, k, causal=True, scale=None, blocks=cudnn.NoBlockSizes(), interpret=False,
            family=cudnn.ATTENTION, count_visits=False))
    want = reference.segment_attention(q, k, v, offsets, lengths)
    close = np.allclose(np.asarray(run(), np.float32), np.asarray(want, np.float32),
                        rtol=2e-2, atol=2e-2)
    assert close == fixed
    if not fixed:
        with pytest.raises(ValueError, match="wrong tokens under grouped-query attention"):
            _loss_and_grads("cudnn", q, k, v, offsets, lengths)
    monkeypatch.setattr(fused, "_fix_seqlen_offsets", _fixed)
    cudnn.kv_offsets_follow_key_heads.cache_clear()
    try:
        assert cudnn.kv_offsets_follow_key_heads()
        _assert_like_reference(q, k, v, offsets, lengths)
    finally:
        monkeypatch.undo()
        cudnn.kv_offsets_follow_key_heads.cache_clear()


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), causal=st.booleans())
def test_cudnn_family_on_random_rows(seed, causal):
    """Random packed rows (gaps, empty rows, segments to L), MHA, against the reference."""
    with pytest.MonkeyPatch.context() as mp:
        stand_in.install(mp, cudnn)
        rng = np.random.default_rng(seed)
        offsets, lengths = random_rows(rng, 2, 40, 5)
        q, k, v = _inputs(2, 2, jnp.bfloat16, seed, seq_len=40, batch=2)
        _assert_like_reference(q, k, v, jnp.asarray(offsets), jnp.asarray(lengths), causal)


@pytest.mark.parametrize("call,why", [
    (AttentionCall(jnp.dtype("float32"), 4, 4, 64, True, False), "bfloat16 or float16"),
    (AttentionCall(jnp.dtype("bfloat16"), 4, 4, 12, True, False), "multiples of 8 up to 128"),
    (AttentionCall(jnp.dtype("bfloat16"), 4, 4, 256, True, False), "multiples of 8 up to 128"),
    (AttentionCall(jnp.dtype("bfloat16"), 4, 4, 64, True, True), "ring step"),
    (AttentionCall(jnp.dtype("bfloat16"), 4, 4, 128, False, False), None),
])
def test_cudnn_refuses_calls_it_cannot_run(call, why):
    got = cudnn.ATTENTION.refuses(call)
    assert got is None if why is None else why in got


def test_cudnn_needs_a_hopper_gpu_here_and_is_refused_by_name():
    """On this CPU: not available, named; never what auto picks."""
    assert "CUDA GPU" in cudnn.requires()
    q, k, v = _inputs(2, 2, jnp.bfloat16)
    offsets, lengths = _rows()
    with pytest.raises(ValueError, match="impl='cudnn' is not available here: it needs a CUDA"):
        kernels.segment_attention(q, k, v, offsets, lengths, impl="cudnn")


def test_auto_on_a_gpu_passes_over_cudnn_where_it_refuses_or_stands_behind(monkeypatch):
    """On a GPU backend with cuDNN able to run: auto takes the first family of the platform
    that takes the call; a float32 call or given block sizes (they ask for a kernel) pass over
    cuDNN; impl="cudnn" on a float32 call raises naming why."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(cudnn, "requires", lambda: None)
    call = AttentionCall(jnp.dtype("bfloat16"), 4, 4, 64, True, False)
    f32 = call._replace(dtype=jnp.dtype("float32"))
    order = [f.target.impl for f in attention.FAMILIES.families if f.target.platform == "gpu"]
    family, _ = attention.FAMILIES.resolve("auto", False, None, call=call)
    assert family.target.impl is order[0]
    for args in ((None, f32), (kernels.GpuAttentionBlockSizes(), call)):
        family, _ = attention.FAMILIES.resolve("auto", False, args[0], call=args[1])
        assert family.target.impl is Impl.PALLAS_GPU
    family, blocks = attention.FAMILIES.resolve("cudnn", False, None, call=call)
    assert family is cudnn.ATTENTION and blocks == cudnn.NoBlockSizes()
    with pytest.raises(ValueError, match="impl='cudnn' cannot run this segment_attention call: "
                                         "cuDNN's flash attention takes bfloat16"):
        attention.FAMILIES.resolve("cudnn", False, None, call=f32)


def test_cudnn_family_lowers_for_cuda_to_cudnns_fused_attention(monkeypatch):
    """Forward and backward lowered for CUDA without a GPU (jax's Hopper and cuDNN checks
    answered as a Hopper machine would): cuDNN's fused attention custom calls, no Triton."""
    monkeypatch.setattr(cudnn, "requires", lambda: None)
    monkeypatch.setattr(fused, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(fused, "check_compute_capability", lambda capability: True)
    monkeypatch.setattr(fused, "is_cuda_compute_capability_equal", lambda capability: False)
    q, k, v = _inputs(4, 4, jnp.bfloat16, seq_len=128)
    offsets, lengths = metadata([[(0, 100)], [(0, 10), (20, 108)], []], 4)
    text = lower_cuda(lambda q, k, v: _loss_and_grads("cudnn", q, k, v, offsets, lengths)[2],
                      q, k, v)
    calls = set(re.findall(r"__cudnn\$\w+", text))
    assert calls == {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}, calls
    assert "triton" not in text.lower()


@pytest.mark.parametrize("platform,capability,why", [
    ("cuda 12.9", "9.0", None), ("cuda 13.0", "10.0", None),
    ("cuda 12.9", "8.0", "needs compute capability >= 9.0 (Hopper); this GPU has 8.0"),
    ("rocm 6.2", "9.0", "needs a CUDA GPU"),
])
def test_cudnn_requires_a_hopper_or_later_cuda_gpu(monkeypatch, platform, capability, why):
    class Client:
        platform_version = platform

    class Device:
        client = Client()
        compute_capability = capability

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *a: [Device()])
    got = cudnn.requires()
    assert got is None if why is None else why in got
