"""segment_linear_cross_entropy: against segment_cross_entropy(hidden @ weight), every option and
implementation (XLA blockwise; the Pallas families in interpret mode), its jaxpr holding no
logits-sized value, and the Pallas kernels lowered for TPU and CUDA at real sizes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.loss_head import jaxpr_values, matmul_flops
from seqpack import kernels
from seqpack.kernels import reference
from seqpack.kernels.fused import families
from tests.helpers.kernels import (
    BF16_SLOW,
    CASES,
    INTERPRET,
    TRITON_CALL,
    B,
    L,
    S,
    assert_close,
    case,
    host_device_cases,
    lower_cuda,
    lower_tpu,
    metadata,
    random_array,
    random_rows,
    run,
    zero_padded,
)

H, V = 32, 300  # V not a multiple of the 128-column test block: the last block is partial
BLOCKS = kernels.LinearCrossEntropyBlockSizes(block_tokens=32, block_vocab=128)
NORMALIZE = ("tokens", "segments", "none")
RECOMPUTE = (("mode", "recompute"),)
XLA = (("impl", "reference"), ("block_sizes", BLOCKS)) + RECOMPUTE  # keyword options, hashable
TPU = (("impl", "pallas_tpu"), ("interpret", INTERPRET), ("block_sizes", BLOCKS)) + RECOMPUTE
GPU = RECOMPUTE + (("impl", "pallas_gpu"), ("interpret", True),
       ("block_sizes", kernels.GpuBlockSizes(head_block_tokens=16, head_block_vocab=128,
                                             head_block_hidden=16, head_block_hidden_bwd=16)))
BIG = (4, 8192, 4096, 128256)  # B, L, H, V of the lowering checks: B * L = 32768, bf16


def _counted(targets, offsets, lengths, mask):
    ids = reference.segment_index(offsets, lengths, targets.shape[1])
    return (ids < offsets.shape[1]) & (targets >= 0) & (mask != 0)


def materialized(hidden, weight, targets, offsets, lengths, *, mask, normalize, z_loss,
                 softcap):
    """The definition: segment_cross_entropy on f32 logits; -100 labels and (NaN) hidden rows of
    uncounted tokens are taken out first, as a user of the materialized path would."""
    counted = _counted(targets, offsets, lengths, mask)
    h = jnp.where(counted[:, :, None], hidden, 0).astype(jnp.float32)
    logits = jnp.einsum("blh,hv->blv", h, weight.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    return reference.segment_cross_entropy(
        logits, jnp.maximum(targets, 0), offsets, lengths, normalize=normalize,
        loss_mask=counted, z_loss=z_loss)


@functools.cache
def _fn(normalize: str, fused: bool, z_loss: float = 1e-3, softcap: float | None = None,
        impl: tuple = XLA, weighted: bool = False, loss_only: bool = False):
    """Jitted (hidden, weight, targets, offsets, lengths, mask, w) -> (loss, seg_loss, tokens,
    dhidden, dweight) of loss + sum(w * per_segment_loss): both outputs' cotangents count (only
    the loss's with `loss_only`). `weighted`: segment_weights = 1 + w in the loss."""

    def f(hidden, weight, targets, offsets, lengths, mask, w):
        def objective(hidden, weight):
            kw = dict(normalize=normalize, z_loss=z_loss)
            if fused:
                out = kernels.segment_linear_cross_entropy(
                    hidden, weight, targets, offsets, lengths, loss_mask=mask,
                    logit_softcap=softcap, segment_weights=1.0 + w if weighted else None,
                    **kw, **dict(impl))
            else:
                out = materialized(hidden, weight, targets, offsets, lengths, mask=mask,
                                   softcap=softcap, **kw)
                if weighted:
                    out = (reference.normalize_loss((1.0 + w) * out[1], out[2], normalize),
                           *out[1:])
            return out[0] + (0.0 if loss_only else jnp.sum(w * out[1])), out

        grads, out = jax.grad(objective, (0, 1), has_aux=True)(hidden, weight)
        return (*out, *grads)

    return jax.jit(f)


def inputs(rng, offsets, lengths, dtype=jnp.float32, seq_len=L, ignore=True):
    """hidden (NaN on padding), weight, targets (some -100), mask, w."""
    batch = offsets.shape[0]
    hidden = random_array(rng, (batch, seq_len, H), dtype)
    ids = np.asarray(reference.segment_index(offsets, lengths, seq_len))
    hidden[ids == offsets.shape[1]] = np.nan
    weight = random_array(rng, (H, V), dtype, 0.5)
    targets = rng.integers(0, V, size=(batch, seq_len)).astype(np.int32)
    if ignore:
        targets[rng.random((batch, seq_len)) < 0.1] = -100
    mask = rng.random((batch, seq_len)) > 0.25
    w = random_array(rng, offsets.shape, jnp.float32, 0.1)
    return hidden, weight, targets, mask, w


def check(normalize, args, dtype=jnp.float32, impl=XLA, **kw):
    got = run(_fn(normalize, True, impl=impl, **kw), *args)
    want = run(_fn(normalize, False, **kw), *args)
    loss, seg_loss, tokens, dh, dw = got
    offsets = args[3]
    assert loss.shape == () and seg_loss.shape == offsets.shape and tokens.dtype == np.int32
    np.testing.assert_array_equal(tokens, want[2])
    value_tol = jnp.float32 if dtype == jnp.float32 else jnp.bfloat16
    assert_close(loss, want[0], value_tol)
    assert_close(seg_loss, want[1], value_tol)
    for name, g, r in (("dhidden", dh, want[3]), ("dweight", dw, want[4])):
        assert g.dtype == dtype and np.isfinite(g).all(), name
        assert_close(g, r, dtype, "grad")
    return got


@pytest.mark.parametrize("dtype", [jnp.float32, BF16_SLOW])
@pytest.mark.parametrize("normalize", NORMALIZE)
def test_matches_materialized(normalize, dtype):
    rng = np.random.default_rng(0)
    offsets, lengths = case("mixed")
    check(normalize, _args(rng, offsets, lengths, dtype), dtype)


def _args(rng, offsets, lengths, dtype=jnp.float32, **kw):
    hidden, weight, targets, mask, w = inputs(rng, offsets, lengths, dtype, **kw)
    return hidden, weight, targets, offsets, lengths, mask, w


@pytest.mark.parametrize("z_loss,softcap", [(0.0, None), (1e-3, 5.0), (0.0, 2.0)])
def test_z_loss_and_softcap(z_loss, softcap):
    rng = np.random.default_rng(1)
    offsets, lengths = case("aligned_16")
    check("tokens", _args(rng, offsets, lengths), z_loss=z_loss, softcap=softcap)


@pytest.mark.parametrize("padding", ["contract", "zero_offsets"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_row_layouts(name, padding):
    """Empty rows and slots, single tokens, rows filled to L; unused slots at either offset."""
    offsets, lengths = case(name)
    if padding == "zero_offsets":
        offsets, lengths = zero_padded(offsets, lengths)
    args = _args(np.random.default_rng(2), offsets, lengths)
    _, _, tokens, dh, _ = check("segments", args)
    ids = np.asarray(reference.segment_index(offsets, lengths, L))
    assert np.all(dh[ids == S] == 0.0)  # padding (NaN hidden) gets exactly zero
    counted = np.asarray(_counted(args[2], offsets, lengths, args[5]))
    assert np.all(dh[~counted] == 0.0) and tokens.sum() == counted.sum()


def test_empty_batch_gives_zero():
    offsets, lengths = zero_padded(*case("mixed"))
    lengths = np.zeros_like(lengths)
    loss, seg_loss, tokens, dh, dw = check("segments", _args(np.random.default_rng(3), offsets,
                                                             lengths))
    assert loss == 0.0 and not seg_loss.any() and not tokens.any()
    assert not dh.any() and not dw.any()


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), alignment=st.sampled_from([1, 16]),
       normalize=st.sampled_from(NORMALIZE))
def test_random_packed_rows(seed, alignment, normalize):
    rng = np.random.default_rng(seed)
    offsets, lengths = random_rows(rng, B, L, S, alignment=alignment)
    check(normalize, _args(rng, offsets, lengths))


def test_no_logits_sized_value_in_the_jaxpr():
    """value_and_grad of every path (XLA, the TPU and GPU kernels, traced only): no value of
    N * V / 8 or more elements anywhere (scan bodies and kernel bodies included), while the
    materialized path has N * V ones; the XLA path's matmuls are 8NHV."""
    n, dim, vocab = 512, 32, 4096  # weight-sized values (H * V) stay under N * V / 8 too
    spec = (jax.ShapeDtypeStruct((2, n // 2, dim), jnp.float32),
            jax.ShapeDtypeStruct((dim, vocab), jnp.float32),
            jax.ShapeDtypeStruct((2, n // 2), jnp.int32),
            jax.ShapeDtypeStruct((2, 4), jnp.int32), jax.ShapeDtypeStruct((2, 4), jnp.int32))
    paths = {"reference": kernels.LinearCrossEntropyBlockSizes(block_tokens=128, block_vocab=256),
             "pallas_tpu": kernels.LinearCrossEntropyBlockSizes(block_tokens=128, block_vocab=256),
             "pallas_gpu": None}

    def fused(impl):
        def f(h, w, t, o, n):
            return kernels.segment_linear_cross_entropy(
                h, w, t, o, n, normalize="segments", z_loss=1e-4, logit_softcap=30.0,
                loss_mask=t > 0, impl=impl, block_sizes=paths[impl], mode="recompute")[0]
        return f

    def dense(h, w, t, o, n):
        return kernels.segment_cross_entropy(h @ w, t, o, n, impl="reference")[0]

    def largest_and_flops(f):
        jaxpr = jax.jit(jax.value_and_grad(f, (0, 1))).trace(*spec).jaxpr
        return max(int(np.prod(shape)) for shape, _ in jaxpr_values(jaxpr)), matmul_flops(jaxpr)

    dense_largest, dense_flops = largest_and_flops(dense)
    assert dense_largest >= n * vocab
    for impl in paths:
        largest, flops = largest_and_flops(fused(impl))
        assert largest < n * vocab // 8, impl
        if impl == "reference":  # recomputing the logits: 8NHV against 6NHV
            assert flops == pytest.approx(8 * n * dim * vocab) and flops <= 1.4 * dense_flops


def test_static_checks():
    rng = np.random.default_rng(4)
    offsets, lengths = case("mixed")
    hidden, weight, targets, _, _ = inputs(rng, offsets, lengths)
    f = kernels.segment_linear_cross_entropy
    with pytest.raises(ValueError, match="weight.shape"):
        f(hidden, weight[:-1], targets, offsets, lengths)
    with pytest.raises(ValueError, match="weight.dtype"):
        f(hidden, weight.astype(jnp.bfloat16), targets, offsets, lengths)
    with pytest.raises(ValueError, match="hidden.shape"):
        f(hidden[0], weight, targets, offsets, lengths)
    with pytest.raises(ValueError, match="targets.shape"):
        f(hidden, weight, targets[:, :-1], offsets, lengths)
    with pytest.raises(ValueError, match="loss_mask.shape"):
        f(hidden, weight, targets, offsets, lengths, loss_mask=targets[:1])
    with pytest.raises(ValueError, match="logit_softcap"):
        f(hidden, weight, targets, offsets, lengths, logit_softcap=0.0)
    with pytest.raises(ValueError, match="z_loss"):
        f(hidden, weight, targets, offsets, lengths, z_loss=-1.0)
    with pytest.raises(ValueError, match="vocab_axis"):
        f(hidden, weight, targets, offsets, lengths, vocab_axis="vocab")
    with pytest.raises(ValueError, match="block_vocab"):
        kernels.LinearCrossEntropyBlockSizes(block_vocab=100)


def vocab_cases(*names: str) -> None:
    host_device_cases("tests.helpers.vocab_cases", *names, timeout=600)


@pytest.mark.slow
def test_vocab_parallel_equals_the_unsharded_loss():
    """The weight's columns over 4 devices (shard_map): loss, per-segment sums and the gradients
    of hidden and weight equal the materialized logits' (chunked, and recompute's XLA path; the
    "logits" mode, one chunk of the same code, with -m slow below); also under
    shard_map(check_vma=False), where the cotangents arrive divided by the shard count."""
    vocab_cases("chunked:4", "xla:4", "chunked:2:unchecked")


@pytest.mark.slow
def test_vocab_parallel_on_8_devices_and_the_kernels():
    vocab_cases("logits:4", "xla:8", "tpu:4", "gpu:4", "logits:4:unchecked", "xla:4:unchecked")


# -- the Pallas TPU kernels (interpret mode: NaN-filled memory, out-of-bounds reads raise) -------

def test_block_schedule():
    """live / src per token block, as in kernels/fused/families.py's example; past L padded."""
    counted = np.zeros((1, 5 * 4 - 2), bool)
    counted[0, [5, 17]] = True  # blocks 1 and 4 (the last one partial)
    used, live, src = families.block_schedule(jnp.asarray(counted), jnp.asarray([18]), 4)
    np.testing.assert_array_equal(live, [0, 1, 0, 0, 1])
    np.testing.assert_array_equal(src, [0, 1, 1, 1, 4])
    assert used.tolist() == [18]


SLOW = pytest.mark.slow


@pytest.mark.parametrize("dtype", [jnp.float32, BF16_SLOW])
@pytest.mark.parametrize("normalize", ["tokens", pytest.param("segments", marks=SLOW),
                                       pytest.param("none", marks=SLOW)])
def test_tpu_kernels_match(normalize, dtype):
    rng = np.random.default_rng(10)
    offsets, lengths = case("mixed")
    check(normalize, _args(rng, offsets, lengths, dtype), dtype, impl=TPU, softcap=4.0)


@pytest.mark.parametrize("name", [pytest.param("empty_row", marks=SLOW),
                                  pytest.param("single_tokens", marks=SLOW),
                                  pytest.param("fills_row", marks=SLOW)])
def test_tpu_kernels_row_layouts(name):
    offsets, lengths = zero_padded(*case(name))
    check("tokens", _args(np.random.default_rng(11), offsets, lengths), impl=TPU)


@pytest.mark.slow
def test_tpu_kernels_skip_prompt_blocks():
    """A loss mask off over whole token blocks (a prompt of 70 tokens: blocks 0 and 1 of 32) and
    -100 labels over the rest of the row's first segment: the kernels skip those blocks."""
    rng = np.random.default_rng(12)
    offsets, lengths = case("ends_at_L")
    args = list(_args(rng, offsets, lengths))
    args[5][:, :70] = False
    args[2][0, 70:100] = -100
    _, _, tokens, dh, _ = check("segments", tuple(args), impl=TPU, z_loss=0.0)
    assert tokens[0].sum() == 0 and not dh[:, :70].any()


# -- the Pallas GPU (Triton) kernels (interpret mode) -------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.float32, BF16_SLOW])
@pytest.mark.parametrize("normalize", ["segments", pytest.param("tokens", marks=SLOW),
                                       pytest.param("none", marks=SLOW)])
def test_gpu_kernels_match(normalize, dtype):
    rng = np.random.default_rng(20)
    offsets, lengths = zero_padded(*case("mixed"))
    check(normalize, _args(rng, offsets, lengths, dtype), dtype, impl=GPU, softcap=4.0)


@pytest.mark.parametrize("name", ["empty_row", pytest.param("single_tokens", marks=SLOW)])
def test_gpu_kernels_row_layouts(name):
    check("tokens", _args(np.random.default_rng(21), *case(name)), impl=GPU)


@pytest.mark.slow
def test_gpu_kernels_odd_shapes():
    """L = 37 (a partial 16-token block), H = 32 in two chunks of 16, prompt tokens masked."""
    offsets, lengths = metadata([[(0, 9), (9, 1), (20, 17)], [(3, 30)]], 3)
    args = list(_args(np.random.default_rng(22), offsets, lengths, seq_len=37))
    args[5][:, :16] = False
    check("segments", tuple(args), impl=GPU, z_loss=0.0)


@pytest.mark.slow
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), alignment=st.sampled_from([1, 16]),
       family=st.sampled_from(["tpu", "gpu"]))
def test_kernels_on_random_packed_rows(seed, alignment, family):
    rng = np.random.default_rng(seed)
    offsets, lengths = random_rows(rng, B, L, S, alignment=alignment)
    check("segments", _args(rng, offsets, lengths), impl=TPU if family == "tpu" else GPU,
          softcap=4.0)


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_kernels_lower_at_real_sizes(impl):
    """B * L = 32768 tokens, H = 4096, V = 128256, bf16: lowered (never run) with every option;
    no [B, L, V] value anywhere in the program."""
    batch, seq_len, dim, vocab = BIG
    spec = (jax.ShapeDtypeStruct((batch, seq_len, dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((dim, vocab), jnp.bfloat16),
            jax.ShapeDtypeStruct((batch, seq_len), jnp.int32),
            jax.ShapeDtypeStruct((batch, 16), jnp.int32), jax.ShapeDtypeStruct((batch, 16),
                                                                              jnp.int32))

    def f(h, w, t, o, n):
        return kernels.segment_linear_cross_entropy(
            h, w, t, o, n, normalize="segments", loss_mask=t > 0, z_loss=1e-4,
            logit_softcap=30.0, impl=impl, mode="recompute")[0]

    grad = jax.value_and_grad(f, (0, 1))
    if impl == "pallas_tpu":
        text, names = lower_tpu(grad, *spec).as_text(), ("fwd", "dhidden", "dweight")
    else:
        text, names = lower_cuda(grad, *spec), ("fwd_gpu", "bwd_gpu")
        assert text.count(TRITON_CALL) == 2 and "mosaic" not in text.lower()
    for name in names:
        assert f'segment_linear_cross_entropy_{name}"' in text, name
    assert f"{batch}x{seq_len}x{vocab}" not in text


# -- the tiny LM example's loss head ----------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("normalize", ["tokens", pytest.param("segments", marks=SLOW)])
def test_tiny_lm_fused_loss_matches_materialized_logits(normalize):
    """examples/tiny_lm.py with fused_loss=True (the tied embedding as the projection): loss,
    per-segment sums and the gradient of every parameter match the materialized logits'."""
    import dataclasses

    from examples.tiny_lm import ModelConfig, init_params, loss_fn
    from seqpack.packer import PackConfig, pack

    cfg = ModelConfig(vocab=200, dim=32, heads=2, layers=1, mlp=64, max_len=64)
    rng = np.random.default_rng(30)
    examples = [rng.integers(0, cfg.vocab, int(n)).astype(np.int32)
                for n in rng.integers(1, 40, 12)]
    batch = pack(examples, PackConfig(64, max_segments=6))
    params = init_params(jax.random.key(0), cfg)
    grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True),
                      static_argnames=("cfg", "normalize"))
    (loss, (seg, count)), grads = grad_fn(params, batch, cfg, normalize=normalize)
    fused = dataclasses.replace(cfg, fused_loss=True)
    (f_loss, (f_seg, f_count)), f_grads = grad_fn(params, batch, fused, normalize=normalize)
    np.testing.assert_array_equal(f_count, count)
    np.testing.assert_allclose(f_loss, loss, rtol=1e-5)
    np.testing.assert_allclose(f_seg, seg, rtol=1e-5, atol=1e-5)
    for k in grads:
        scale = float(np.abs(grads[k]).max())
        np.testing.assert_allclose(f_grads[k], grads[k], rtol=1e-4, atol=1e-5 * scale,
                                   err_msg=k)
