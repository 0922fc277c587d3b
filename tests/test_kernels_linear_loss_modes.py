"""segment_linear_cross_entropy's modes (logits, chunked, recompute; kernels/fused/in_forward.py):
values and both gradients against the materialized logits for every option, the per-segment
cotangent's fallback, segment_weights, how "auto" chooses, and each mode's compiled memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.loss_head import jaxpr_values, matmul_flops
from seqpack import kernels
from seqpack.kernels import reference
from seqpack.kernels.fused import policy
from tests.helpers.kernels import case, run, zero_padded
from tests.test_kernels_linear_loss import NORMALIZE, XLA, V, _args, _fn, check

# N = B * L = 200 tokens: "chunked" with a budget of 64 tokens' logits runs the smallest chunk,
# 128 tokens: a first chunk of 72 tokens, then a scan over one of 128.
MODES = {
    "logits": (("mode", "logits"),),
    "chunked": (("mode", "chunked"), ("max_logits_bytes", 4 * V * 64)),
    "recompute": XLA,
}
IN_FORWARD = ("logits", "chunked")
SLOW = pytest.mark.slow
# The fast run: chunked (padding, the scan, the carried d weight) in full, the others slow.
FAST_MODES = ["chunked", pytest.param("logits", marks=SLOW), pytest.param("recompute", marks=SLOW)]
FAST_IN_FORWARD = ["chunked", pytest.param("logits", marks=SLOW)]


@pytest.mark.parametrize("loss_only", [True, False], ids=["loss", "loss+per_segment"])
@pytest.mark.parametrize("normalize", NORMALIZE)
@pytest.mark.parametrize("mode", FAST_MODES)
def test_modes_match_materialized(mode, normalize, loss_only):
    """The loss's gradients (computed in the forward) alone, and with a cotangent on
    per_segment_loss too (added by the recomputing fallback)."""
    rng = np.random.default_rng(40)
    check(normalize, _args(rng, *case("mixed")), impl=MODES[mode], softcap=4.0,
          loss_only=loss_only)


@pytest.mark.parametrize("mode,normalize", [
    *(("chunked", n) for n in NORMALIZE), ("recompute", "segments"),
    *(pytest.param(m, n, marks=SLOW) for m in ("logits", "recompute") for n in NORMALIZE
      if (m, n) != ("recompute", "segments"))])
def test_segment_weights(mode, normalize):
    """loss = normalize(segment_weights * per_segment_loss); per_segment_loss unweighted."""
    rng = np.random.default_rng(41)
    check(normalize, _args(rng, *case("mixed")), impl=MODES[mode], weighted=True, loss_only=True)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(jnp.float32, marks=SLOW)])
@pytest.mark.parametrize("mode", FAST_IN_FORWARD)
def test_bf16(mode, dtype):
    rng = np.random.default_rng(42)
    check("segments", _args(rng, *case("mixed"), dtype), dtype, impl=MODES[mode], softcap=4.0,
          loss_only=True)


@pytest.mark.parametrize("z_loss,softcap", [(1e-3, 5.0), pytest.param(0.0, None, marks=SLOW),
                                            pytest.param(0.0, 2.0, marks=SLOW)])
@pytest.mark.parametrize("mode", FAST_IN_FORWARD)
def test_z_loss_and_softcap(mode, z_loss, softcap):
    rng = np.random.default_rng(43)
    check("tokens", _args(rng, *case("aligned_16")), impl=MODES[mode], z_loss=z_loss,
          softcap=softcap, loss_only=True)


@pytest.mark.parametrize("name", ["empty_row", pytest.param("single_tokens", marks=SLOW),
                                  pytest.param("fills_row", marks=SLOW)])
@pytest.mark.parametrize("mode", FAST_IN_FORWARD)
def test_row_layouts(mode, name):
    """Empty rows and slots (zero offsets), single tokens: padding (NaN hidden) gets exactly 0."""
    offsets, lengths = zero_padded(*case(name))
    args = _args(np.random.default_rng(44), offsets, lengths)
    _, _, _, dh, _ = check("segments", args, impl=MODES[mode], loss_only=True)
    ids = np.asarray(reference.segment_index(offsets, lengths, args[0].shape[1]))
    assert np.all(dh[ids == offsets.shape[1]] == 0.0)


@pytest.mark.parametrize("mode", IN_FORWARD)
def test_empty_batch_gives_zero(mode):
    offsets, lengths = zero_padded(*case("mixed"))
    args = _args(np.random.default_rng(45), offsets, np.zeros_like(lengths))
    loss, seg_loss, tokens, dh, dw = check("segments", args, impl=MODES[mode])
    assert loss == 0.0 and not seg_loss.any() and not tokens.any()
    assert not dh.any() and not dw.any()


@pytest.mark.parametrize("mode", FAST_IN_FORWARD)
def test_logits_dtype(mode):
    """bf16 inputs: the logits are stored in bf16 by default, each rounded once as materialized
    logits are (the loss equals the reference's on `(hidden @ weight)` in bf16, to f32
    rounding), and logits_dtype="float32" keeps them unrounded (the reference's on f32 logits);
    the two differ, so the rounding is not elided."""
    hidden, weight, targets, offsets, lengths, mask, _ = _args(
        np.random.default_rng(47), *case("mixed"), jnp.bfloat16)

    counted = (mask != 0) & (targets >= 0)  # segment_cross_entropy takes ids in [0, V) only

    def want(logits):
        return float(kernels.segment_cross_entropy(
            logits, jnp.maximum(targets, 0), offsets, lengths, loss_mask=counted,
            impl="reference")[0])

    def got(**kw):
        return float(kernels.segment_linear_cross_entropy(
            hidden, weight, targets, offsets, lengths, loss_mask=mask, **dict(MODES[mode]),
            **kw)[0])

    wide = jnp.einsum("blh,hv->blv", hidden, weight, preferred_element_type=jnp.float32)
    rounded, exact = want(wide.astype(jnp.bfloat16).astype(jnp.float32)), want(wide)
    assert abs(rounded - exact) > 1e-5 * abs(exact)
    np.testing.assert_allclose(got(), rounded, rtol=2e-6)
    np.testing.assert_allclose(got(logits_dtype="float32"), exact, rtol=2e-6)
    with pytest.raises(ValueError, match="logits_dtype"):
        got(logits_dtype="int32")


@pytest.mark.parametrize("mode", FAST_IN_FORWARD)
def test_weight_grad_dtype(mode):
    """weight_grad_dtype="bfloat16" carries d weight in bf16: beside bf16 hidden and an f32
    master weight (whose gradient is f32), every value of d weight is a bf16 number, within the
    carry's rounding of the f32 carry's; the loss, per-segment values and d hidden are the same
    bits."""
    hidden, weight, *rest = _args(np.random.default_rng(50), *case("mixed"), jnp.bfloat16)
    master = np.asarray(weight, np.float32)
    wide = run(_fn("tokens", True, impl=MODES[mode], loss_only=True), hidden, master, *rest)
    narrow = run(_fn("tokens", True, impl=(*MODES[mode], ("weight_grad_dtype", "bfloat16")),
                     loss_only=True), hidden, master, *rest)
    for name, a, b in zip(("loss", "per_segment_loss", "tokens", "dhidden"), narrow, wide):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                      err_msg=name)
    dw, dw_wide = np.asarray(narrow[4]), np.asarray(wide[4])
    assert dw.dtype == np.float32
    assert (np.asarray(jnp.asarray(dw).astype(jnp.bfloat16), np.float32) == dw).all()
    assert (np.asarray(jnp.asarray(dw_wide).astype(jnp.bfloat16), np.float32) != dw_wide).any()
    np.testing.assert_allclose(dw, dw_wide, rtol=0, atol=2 * 2**-8 * np.abs(dw_wide).max())
    with pytest.raises(ValueError, match="weight_grad_dtype"):
        kernels.segment_linear_cross_entropy(hidden, master, *rest[:3], mode="chunked",
                                             weight_grad_dtype="int8")


def _loss(mode, **kw):
    def f(hidden, weight, targets, offsets, lengths, mask, segment_weights):
        return kernels.segment_linear_cross_entropy(
            hidden, weight, targets, offsets, lengths, loss_mask=mask, normalize="segments",
            z_loss=1e-3, logit_softcap=4.0, segment_weights=segment_weights, **dict(MODES[mode]),
            **kw)
    return f


@pytest.mark.slow
@pytest.mark.parametrize("mode", FAST_IN_FORWARD)
def test_eval_and_partial_gradients(mode):
    """No differentiation (jit of the values), the gradient of one input alone (the forward
    skips the other's), and the gradient of segment_weights: all equal the recompute mode's."""
    hidden, weight, targets, offsets, lengths, mask, w = _args(np.random.default_rng(46),
                                                              *case("mixed"))
    data = (targets, offsets, lengths, mask)
    sw = 1.0 + w
    got, want = _loss(mode), _loss("recompute")
    for a, b in zip(run(got, hidden, weight, *data, sw), run(want, hidden, weight, *data, sw)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    for argnum in (0, 1, 6):
        a, b = (run(jax.grad(lambda *x, f=f: f(*x)[0], argnum), hidden, weight, *data, sw)
                for f in (got, want))
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(b).max())


def test_choose():
    """Chunks balanced and rounded up to 128; auto: logits when N fits, chunked down to
    MIN_CHUNK_TOKENS, recompute below; forced modes keep their mode."""
    choose, mode = policy.choose, kernels.LossHeadMode
    vocab = 1000
    per_token = 4 * vocab
    assert choose(mode.AUTO, 5000, vocab, 5000 * per_token) == (mode.LOGITS, 5000)
    # 4096 tokens fit: two chunks of 2500, rounded up to 2560
    assert choose(mode.AUTO, 5000, vocab, 4096 * per_token) == (mode.CHUNKED, 2560)
    # bf16 logits (2 bytes): the same budget holds twice the tokens
    assert choose(mode.AUTO, 5000, vocab, 2048 * per_token, itemsize=2) == (mode.CHUNKED, 2560)
    least = policy.MIN_CHUNK_TOKENS
    assert choose(mode.AUTO, 5000, vocab, least * per_token)[0] is mode.CHUNKED
    assert choose(mode.AUTO, 5000, vocab, (least - 1) * per_token) == (mode.RECOMPUTE, None)
    assert choose(mode.AUTO, 300, vocab, 300 * per_token) == (mode.LOGITS, 300)  # N < least
    assert choose(mode.CHUNKED, 5000, vocab, 1) == (mode.CHUNKED, 128)
    assert choose(mode.LOGITS, 5000, vocab, 1) == (mode.LOGITS, 5000)
    assert choose(mode.RECOMPUTE, 5000, vocab, None) == (mode.RECOMPUTE, None)
    free = policy.free_device_bytes()  # CPU: no memory stats, the documented default
    assert free > 0 and (jax.default_backend() != "cpu" or free == policy.DEFAULT_FREE_BYTES)


def test_auto_budget_counts_all_a_chunk_holds(monkeypatch):
    """Without max_logits_bytes, BUDGET_SHARE of the free memory bounds the chunk's held bytes
    (2 x the stored bytes + 4 a logit), not its stored logits alone: the chip's sizes (16 GB
    free, bf16) keep 2 chunks at N = 16,384 (V = 128,256) and 8,192 (V = 256,000), all logits at
    once in the training step (N = V = 32,768), and take 7 chunks of 9,472 at N = 65,536, where a
    budget of the stored logits took 13,184 (12.5 GB held)."""
    choose, mode = policy.choose, kernels.LossHeadMode
    free = 15 << 30
    monkeypatch.setattr(policy, "free_device_bytes", lambda: free)
    assert policy.held_bytes(2) == 8 and policy.held_bytes(4) == 12
    assert choose(mode.AUTO, 16384, 128256, None, 2) == (mode.CHUNKED, 8192)
    assert choose(mode.AUTO, 8192, 256000, None, 2) == (mode.CHUNKED, 4096)
    assert choose(mode.AUTO, 32768, 32768, None, 2) == (mode.LOGITS, 32768)
    got, chunk = choose(mode.AUTO, 65536, 128256, None, 2)
    assert got is mode.CHUNKED and chunk == 9472
    assert chunk * 128256 * policy.held_bytes(2) <= policy.BUDGET_SHARE * free
    # float32 logits: 12 bytes a logit, fewer tokens a chunk
    assert choose(mode.AUTO, 65536, 128256, None, 4)[1] < chunk
    # a budget given counts the stored logits alone, as before
    assert choose(mode.AUTO, 65536, 128256, 2 * 128256 * 4096, 2) == (mode.CHUNKED, 4096)


def test_option_checks():
    hidden, weight, targets, offsets, lengths, _, w = _args(np.random.default_rng(47),
                                                           *case("mixed"))
    f = kernels.segment_linear_cross_entropy
    with pytest.raises(ValueError, match="mode="):
        f(hidden, weight, targets, offsets, lengths, mode="fast")
    with pytest.raises(ValueError, match="max_logits_bytes"):
        f(hidden, weight, targets, offsets, lengths, max_logits_bytes=0)
    with pytest.raises(ValueError, match="segment_weights.shape"):
        f(hidden, weight, targets, offsets, lengths, segment_weights=w[:, :-1])


@pytest.mark.parametrize("mode", ["chunked", "recompute", pytest.param("logits", marks=SLOW)])
def test_float32_master_weight(mode):
    """A float32 weight beside bf16 hidden (a master weight) is read in bf16: the values and d
    hidden of the call on the weight cast first, d weight float32; where the forward forms d
    weight (summed in float32) it comes back unrounded, else through the cast's transpose."""
    hidden, weight, *rest = _args(np.random.default_rng(48), *case("mixed"), jnp.bfloat16)
    master = np.asarray(weight, np.float32)
    f = _fn("tokens", True, impl=MODES[mode])  # loss and per-segment cotangents both
    narrow, wide = run(f, hidden, weight, *rest), run(f, hidden, master, *rest)
    for name, a, b in zip(("loss", "per_segment_loss", "tokens", "dhidden"), wide, narrow):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=1e-6, atol=1e-6, err_msg=name)
    dw, dw_narrow = wide[4], np.asarray(narrow[4], np.float32)
    assert dw.dtype == np.float32
    np.testing.assert_allclose(dw, dw_narrow, rtol=0, atol=2**-8 * np.abs(dw).max())
    rounded = np.asarray(jnp.asarray(dw).astype(jnp.bfloat16), np.float32) == dw
    assert rounded.mean() < 0.5 if mode in IN_FORWARD else rounded.all()


def test_only_a_float32_weight_may_differ_from_hidden():
    hidden, weight, targets, offsets, lengths, _, _ = _args(np.random.default_rng(49),
                                                           *case("mixed"))
    with pytest.raises(ValueError, match="or be float32"):
        kernels.segment_linear_cross_entropy(hidden, weight.astype(jnp.bfloat16), targets,
                                             offsets, lengths)


# -- memory: XLA's temporary bytes of value_and_grad, compiled (never run) on CPU ---------------

N_MEM, H_MEM, V_MEM = 8192, 256, 8192  # materialized f32 logits: 256 MiB
MIB = 1 << 20


def temp_bytes(**kw) -> int:
    batch = 2
    spec = (jax.ShapeDtypeStruct((batch, N_MEM // batch, H_MEM), jnp.float32),
            jax.ShapeDtypeStruct((H_MEM, V_MEM), jnp.float32),
            jax.ShapeDtypeStruct((batch, N_MEM // batch), jnp.int32),
            jax.ShapeDtypeStruct((batch, 8), jnp.int32),
            jax.ShapeDtypeStruct((batch, 8), jnp.int32))

    def f(h, w, t, o, n):
        if not kw:
            return kernels.segment_cross_entropy(h @ w, t, o, n, impl="reference")[0]
        return kernels.segment_linear_cross_entropy(h, w, t, o, n, normalize="segments",
                                                    z_loss=1e-4, **kw)[0]

    compiled = jax.jit(jax.value_and_grad(f, (0, 1))).lower(*spec).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_budget_is_honoured():
    """Chunked temp <= 2 x budget (the chunk's f32 logits and their gradient) + allowance (f32
    and final d weight, d hidden, metadata: 3 H V + 2 N H floats), far below N x V; the logits
    mode holds about two N x V f32 arrays, the materialized path three."""
    logits = 4 * N_MEM * V_MEM
    allowance = 4 * (3 * H_MEM * V_MEM + 2 * N_MEM * H_MEM)
    for share in (4, 16):
        budget = logits // share
        temp = temp_bytes(mode="chunked", max_logits_bytes=budget)
        assert temp <= 2 * budget + allowance, (share, temp / MIB)
    assert temp_bytes(max_logits_bytes=logits // 16) < logits / 4  # auto: chunked
    assert temp_bytes(mode="logits") <= 2 * logits + allowance
    assert temp_bytes(mode="recompute", impl="reference") < logits / 4
    assert temp_bytes() > 2.5 * logits


@pytest.mark.parametrize("mode,n", [*((m, 1024) for m in IN_FORWARD), ("chunked", 1000)])
def test_six_nhv_and_no_logits_sized_value(mode, n):
    """value_and_grad of the loss: the matmuls are materialized logits' 6NHV, with no token
    padded where N is no multiple of the chunk (1000: a first chunk of 104, then 7 of 128);
    chunked with a budget of an eighth of the logits holds no value of N V / 4 elements (scan
    bodies included)."""
    dim, vocab = 32, 2048
    spec = (jax.ShapeDtypeStruct((2, n // 2, dim), jnp.float32),
            jax.ShapeDtypeStruct((dim, vocab), jnp.float32),
            jax.ShapeDtypeStruct((2, n // 2), jnp.int32),
            jax.ShapeDtypeStruct((2, 4), jnp.int32), jax.ShapeDtypeStruct((2, 4), jnp.int32))

    def f(h, w, t, o, m):
        return kernels.segment_linear_cross_entropy(
            h, w, t, o, m, normalize="segments", z_loss=1e-4, logit_softcap=30.0, mode=mode,
            max_logits_bytes=n * vocab * 4 // 8)[0]

    jaxpr = jax.jit(jax.value_and_grad(f, (0, 1))).trace(*spec).jaxpr
    assert matmul_flops(jaxpr) == 6 * n * dim * vocab
    largest = max(int(np.prod(shape)) for shape, _ in jaxpr_values(jaxpr))
    assert largest == (n * vocab if mode == "logits" else -(-n // 8 // 128) * 128 * vocab)
