"""The GPU (Triton) kernels: interpret mode vs the reference, CUDA lowering, impl resolution.

Interpret mode (`interpret=True`, Pallas' HLO interpreter) fills outputs and padded block regions
with NaN, so an element a kernel forgets to write, or a masked load that leaks, shows up as NaN.
Every check runs all kernels of a family in one jitted computation: one compile per shape.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqpack import kernels
from seqpack.kernels import reference
from seqpack.kernels.common import Impl, resolve_impl
from tests.helpers.kernels import (
    BF16_SLOW,
    GPU_BLOCKS,
    INTERPRET,
    TRITON_CALL,
    B,
    D,
    L,
    S,
    assert_close,
    case,
    loads_under_conditionals,
    lower_cuda,
    metadata,
    random_array,
    run,
    zero_padded,
)

GPU = dict(impl="pallas_gpu", interpret=True, block_sizes=GPU_BLOCKS)
V = 300
CASE_NAMES = ("mixed", "empty_row", "aligned_16", "single_tokens", "ends_at_L")


def _segment_ops(x, offsets, lengths, g, g_tokens, **kw):
    """Every reduce / gather / broadcast value with its vjp, as one dict."""
    seq_len = x.shape[1]
    fns = {
        "sum": lambda x: kernels.segment_sum(x, offsets, lengths, **kw),
        "mean": lambda x: kernels.segment_mean(x, offsets, lengths, **kw),
        "max": lambda x: kernels.segment_max(x, offsets, lengths, **kw),
        "last": lambda x: kernels.segment_gather(x, offsets, lengths, **kw),
        "third": lambda x: kernels.segment_gather(x, offsets, lengths, position=2, **kw),
    }
    out = {}
    for name, f in fns.items():
        value, vjp = jax.vjp(f, x)
        out[name], out["d" + name] = value, vjp(g)[0]
    value, vjp = jax.vjp(
        lambda v: kernels.segment_broadcast(v, offsets, lengths, seq_len=seq_len, **kw), g)
    out["broadcast"], out["dbroadcast"] = value, vjp(g_tokens)[0]
    return out


_SEGMENT_GPU = jax.jit(functools.partial(_segment_ops, **GPU))
_SEGMENT_REF = jax.jit(functools.partial(_segment_ops, impl="reference"))


def _check_segment_ops(x, offsets, lengths, dtype, seed=0):
    rng = np.random.default_rng(seed)
    g = random_array(rng, (*offsets.shape, *x.shape[2:]), dtype)
    g_tokens = random_array(rng, x.shape, dtype)
    got = run(_SEGMENT_GPU, x, offsets, lengths, g, g_tokens)
    want = run(_SEGMENT_REF, x, offsets, lengths, g, g_tokens)
    for name, value in want.items():
        assert got[name].shape == value.shape and got[name].dtype == value.dtype, name
        assert np.isfinite(got[name]).all(), name
        assert_close(got[name], value, dtype, "grad" if name.startswith("d") else "value")
    return got


def _nan_on_padding(x, offsets, lengths):
    ids = np.asarray(reference.segment_index(offsets, lengths, x.shape[1]))
    x = np.array(x)
    x[ids == offsets.shape[1]] = np.nan
    return x, ids


@pytest.mark.parametrize("padding", ["contract", "zero_offsets"])
@pytest.mark.parametrize("name", CASE_NAMES)
def test_segment_ops_match_reference(name, padding):
    """Values and gradients; NaN on every padding token; unused slots at offset 0 or at the end."""
    offsets, lengths = case(name)
    if padding == "zero_offsets":
        offsets, lengths = zero_padded(offsets, lengths)
    x = random_array(np.random.default_rng(1), (B, L, D), jnp.float32)
    x, ids = _nan_on_padding(x, offsets, lengths)
    got = _check_segment_ops(x, offsets, lengths, jnp.float32)
    for grad in ("dsum", "dmean", "dmax", "dlast", "dthird"):
        assert np.all(got[grad][ids == S] == 0.0), grad
    assert np.all(got["broadcast"][ids == S] == 0.0)


@pytest.mark.parametrize("dtype", [jnp.float32, BF16_SLOW])
def test_segment_ops_odd_shapes(dtype):
    """L = 37, D = 5 and S = 3: partial token and lane tiles, slot count padded to 4."""
    offsets, lengths = metadata([[(0, 9), (9, 1), (20, 17)], [(3, 30)]], 3)
    x = random_array(np.random.default_rng(2), (B, 37, 5), dtype)
    _check_segment_ops(x, offsets, lengths, dtype)


@pytest.mark.slow
def test_segment_ops_2d_input():
    offsets, lengths = zero_padded(*case("mixed"))
    x = random_array(np.random.default_rng(3), (B, L), jnp.float32)
    _check_segment_ops(x, offsets, lengths, jnp.float32)


def _cross_entropy(logits, targets, offsets, lengths, mask, w, **kw):
    """(loss, per-segment loss, tokens, d(loss + sum(w * per-segment loss))/dlogits)."""

    def objective(logits):
        loss, seg_loss, tokens = kernels.segment_cross_entropy(
            logits, targets, offsets, lengths, normalize="segments", loss_mask=mask,
            z_loss=1e-3, **kw)
        return loss + jnp.sum(w * seg_loss), (loss, seg_loss, tokens)

    dlogits, aux = jax.grad(objective, has_aux=True)(logits)
    return (*aux, dlogits)


_CE_GPU = jax.jit(functools.partial(_cross_entropy, **GPU))
_CE_REF = jax.jit(functools.partial(_cross_entropy, impl="reference"))


def _check_cross_entropy(offsets, lengths, dtype=jnp.float32, seq_len=L, seed=4):
    rng = np.random.default_rng(seed)
    logits = random_array(rng, (B, seq_len, V), dtype, 3.0)
    logits, ids = _nan_on_padding(logits, offsets, lengths)
    targets = rng.integers(0, V, size=(B, seq_len)).astype(np.int32)
    mask = rng.random((B, seq_len)) > 0.25
    w = random_array(rng, offsets.shape, jnp.float32, 0.1)
    args = (logits, targets, offsets, lengths, mask, w)
    loss, seg_loss, tokens, dlogits = run(_CE_GPU, *args)
    r_loss, r_seg_loss, r_tokens, r_dlogits = run(_CE_REF, *args)
    np.testing.assert_array_equal(tokens, r_tokens)
    assert_close(loss, r_loss, jnp.float32)
    assert_close(seg_loss, r_seg_loss, jnp.float32)
    assert dlogits.dtype == dtype and np.isfinite(dlogits).all()
    assert_close(dlogits, r_dlogits, dtype, "grad")
    assert np.all(dlogits[ids == offsets.shape[1]] == 0.0)
    return tokens


@pytest.mark.parametrize("padding", ["contract", "zero_offsets"])
@pytest.mark.parametrize("name", ["mixed", "empty_row", "single_tokens"])
def test_cross_entropy_matches_reference(name, padding):
    offsets, lengths = case(name)
    if padding == "zero_offsets":
        offsets, lengths = zero_padded(offsets, lengths)
    _check_cross_entropy(offsets, lengths)


def test_cross_entropy_empty_batch():
    offsets, lengths = zero_padded(*metadata([[], []], S))
    tokens = _check_cross_entropy(offsets, lengths)
    assert not tokens.any()


@pytest.mark.parametrize("dtype", [jnp.float32, BF16_SLOW])
def test_cross_entropy_odd_length(dtype):
    """L = 37 (odd, a partial 16-token block), S = 3 slots padded to 4."""
    offsets, lengths = metadata([[(0, 9), (9, 1), (20, 17)], [(3, 30)]], 3)
    _check_cross_entropy(offsets, lengths, dtype, seq_len=37)


def test_segment_ops_lower_for_cuda():
    x = jnp.zeros((4, 1000, 384), jnp.bfloat16)
    meta = jnp.zeros((4, 16), jnp.int32)
    kw = dict(impl="pallas_gpu")
    text = lower_cuda(lambda x, o, n: _segment_ops(x, o, n, jnp.zeros((4, 16, 384), x.dtype),
                                                   x, **kw), x, meta, meta)
    assert TRITON_CALL in text
    for name in ("segment_sum_gpu", "segment_max_gpu", "segment_broadcast_gpu",
                 "segment_gather_gpu"):
        assert f'name = "{name}"' in text, name
    assert "pallas_call" not in text and "mosaic" not in text.lower()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cross_entropy_lowers_for_cuda(dtype):
    logits = jnp.zeros((4, 1000, 5000), dtype)
    targets = jnp.zeros((4, 1000), jnp.int32)
    meta = jnp.zeros((4, 16), jnp.int32)
    w = jnp.zeros((4, 16), jnp.float32)
    f = functools.partial(_cross_entropy, impl="pallas_gpu")
    text = lower_cuda(f, logits, targets, meta, meta, targets > 0, w)
    assert text.count(TRITON_CALL) == 2
    assert 'name = "segment_cross_entropy_fwd_gpu"' in text
    assert 'name = "segment_cross_entropy_bwd_gpu"' in text
    if dtype == jnp.bfloat16:  # no f32 copy of the [B, L, V] logits anywhere
        assert "tensor<4x1000x5000xbf16>" in text and "tensor<4x1000x5000xf32>" not in text


def test_impl_resolution(monkeypatch):
    assert resolve_impl("auto", False) is Impl.REFERENCE  # CPU
    assert resolve_impl("pallas", True) is Impl.PALLAS_TPU
    assert resolve_impl("pallas_gpu", True) is Impl.PALLAS_GPU
    with pytest.raises(ValueError, match=r"'cpu' backend.*'pallas_gpu'"):
        resolve_impl("pallas", False)
    with pytest.raises(ValueError, match="pass interpret=True"):
        resolve_impl("pallas_gpu", INTERPRET)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_impl("auto", False) is Impl.PALLAS_GPU
    assert resolve_impl("pallas", False) is Impl.PALLAS_GPU
    with pytest.raises(ValueError, match=r"impl='pallas_tpu' cannot run on the 'gpu' backend"):
        resolve_impl("pallas_tpu", False)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert resolve_impl("auto", False) is Impl.PALLAS_TPU
    with pytest.raises(ValueError, match=r"'pallas_gpu' cannot run on the 'tpu' backend.*Choices"):
        resolve_impl("pallas_gpu", False)


def test_impl_errors_reach_the_caller():
    x = np.zeros((B, L, D), np.float32)
    offsets, lengths = case("mixed")
    with pytest.raises(ValueError, match="no kernel on the 'cpu' backend"):
        kernels.segment_sum(x, offsets, lengths, impl="pallas")
    with pytest.raises(ValueError, match="pass a GpuBlockSizes"):
        kernels.segment_gather(x, offsets, lengths, impl="pallas_gpu", interpret=True,
                               block_sizes=kernels.GatherBlockSizes())
    with pytest.raises(ValueError, match="pass a CrossEntropyBlockSizes"):
        kernels.segment_cross_entropy(x, np.zeros((B, L), np.int32), offsets, lengths,
                                      impl="pallas_tpu", block_sizes=GPU_BLOCKS)
    with pytest.raises(ValueError, match="block_vocab=100 must be a power of two"):
        kernels.GpuBlockSizes(block_vocab=100)
    with pytest.raises(ValueError, match="token_splits=0 must be >= 1"):
        kernels.GpuBlockSizes(token_splits=0)


def test_lower_cuda_refuses_python_numbers_typed_as_the_predicate():
    """`lower_cuda` (which every CUDA lowering test uses) lets no Triton module through where a
    `jnp.where(scalar, 5, 0)` became i1 constants: jax 0.10's lowering did that, and the
    cross-entropy and loss-head kernels then built loops the chip's Triton refuses."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    def kernel(x_ref, o_ref):
        o_ref[0] = jnp.where(x_ref[0] > 0, 5, 0).astype(jnp.float32)

    call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16,), jnp.float32),
                          compiler_params=plgpu.CompilerParams(num_warps=4))
    try:
        text = lower_cuda(call, jnp.zeros(16, jnp.int32))
    except AssertionError as e:
        assert "lowered as i1" in str(e)
    else:  # a jax whose lowering keeps the numbers' type: the module is right and accepted
        assert TRITON_CALL in text


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_kernel_loops_load_outside_conditionals(kv_heads):
    """In every loop of the attention and loss-head Triton kernels the loads sit outside any
    conditional, where Triton's software pipeliner can prefetch them (the dk/dv kernel once ran
    each query block under `lax.cond`, and prefetched nothing)."""
    offsets = jnp.array([[0, 200, 512, 512]] * 2, jnp.int32)
    lengths = jnp.array([[200, 312, 0, 0]] * 2, jnp.int32)
    q = jnp.zeros((2, 512, 4, 64), jnp.bfloat16)
    kv = jnp.zeros((2, 512, kv_heads, 64), jnp.bfloat16)
    x, w = jnp.zeros((2, 512, 256), jnp.bfloat16), jnp.zeros((256, 1024), jnp.bfloat16)
    targets = jnp.zeros((2, 512), jnp.int32)
    seen = {}

    def attention(q, k, v):
        return kernels.segment_attention(q, k, v, offsets, lengths, impl="pallas_gpu")

    def loss_head(x, w):
        return kernels.segment_linear_cross_entropy(x, w, targets, offsets, lengths,
                                                    mode="recompute", impl="pallas_gpu")[0]

    record = lambda name, op: seen.setdefault(name, loads_under_conditionals(op))  # noqa: E731
    for fn, args in ((attention, (q, kv, kv)), (loss_head, (x, w))):
        grads = jax.grad(lambda *a, fn=fn: fn(*a).astype(jnp.float32).sum(),
                         tuple(range(len(args))))
        lower_cuda(grads, *args, on_module=record)
    assert set(seen) == {"segment_attention_fwd_gpu", "segment_attention_dq_gpu",
                         "segment_attention_dkv_gpu", "segment_linear_cross_entropy_fwd_gpu",
                         "segment_linear_cross_entropy_bwd_gpu"}
    assert not any(seen.values()), {k: v[:2] for k, v in seen.items() if v}
