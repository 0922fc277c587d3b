"""Device suite: what reduces per segment, compiled, against the references: the segment
cross-entropy, the fused loss head in each mode, segment sum / mean / max / broadcast / gather
(the rows, sizes and tolerances: tests/helpers/device.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqpack import kernels
from seqpack.kernels import reference
from tests.helpers.device import (
    BF16,
    DEVICE,
    ELEMENTWISE,
    F32,
    HEAD_VALUES,
    HIGHEST,
    MATMUL,
    ROWS,
    SIZES,
    SLOTS,
    assert_close,
    assert_grad_close,
    fetch,
    metadata_sets,
    normal,
    options,
    padding_of,
    with_nan,
)

pytestmark = DEVICE


# --- segment losses --------------------------------------------------------------------------


@functools.cache
def _cross_entropy(fused: bool, normalize: str, z_loss: float):
    kw = options(block_sizes=kernels.CrossEntropyBlockSizes(block_tokens=256, block_vocab=128))
    run = kernels.segment_cross_entropy if fused else reference.segment_cross_entropy

    def f(logits, targets, offsets, lengths, mask, w):
        def objective(logits):
            out = run(logits, targets, offsets, lengths, normalize=normalize, loss_mask=mask,
                      z_loss=z_loss, **(kw if fused else {}))
            return out[0] + jnp.sum(w * out[1]), out

        dlogits, out = jax.grad(objective, has_aux=True)(logits)
        return (*out, dlogits)

    return jax.jit(f)


@pytest.mark.parametrize("dtype,normalize,z_loss", [(F32, "tokens", 1e-3),
                                                    (BF16, "segments", 0.0)])
def test_segment_cross_entropy(dtype, normalize, z_loss):
    """(loss, per_segment_loss, per_segment_tokens) and d logits (of loss + w . per_segment_loss)
    vs the reference with an odd vocabulary, a loss mask and NaN logits on padding; then
    segment_dataset_loss of the result."""
    rng = np.random.default_rng(1)
    offsets, lengths = metadata_sets()["wide"]
    pad = padding_of(offsets, lengths)
    shape = (ROWS, SIZES.seq_len)
    logits = with_nan(normal(rng, (*shape, SIZES.vocab), dtype, 2.0), pad)
    targets = rng.integers(0, SIZES.vocab, shape).astype(np.int32)
    mask = rng.random(shape) > 0.2
    w = normal(rng, offsets.shape, F32, 0.1)
    args = (logits, targets, offsets, lengths, mask, w)
    loss, seg_loss, tokens, dlogits = fetch(_cross_entropy(True, normalize, z_loss), *args)
    with HIGHEST():
        want = fetch(_cross_entropy(False, normalize, z_loss), *args)
    rtol, atol = ELEMENTWISE[F32]  # the loss is f32 math on the logits' values
    assert_close("loss", loss, want[0], rtol, atol)
    assert_close("per_segment_loss", seg_loss, want[1], rtol, atol)
    np.testing.assert_array_equal(tokens, want[2])
    assert dlogits.dtype == jnp.dtype(dtype)
    assert_grad_close("dlogits", dlogits, want[3], *ELEMENTWISE[dtype])
    assert not np.asarray(dlogits, np.float32)[pad].any(), "dlogits nonzero on padding"

    dataset = np.where(lengths > 0, np.arange(SLOTS) % 3, -1).astype(np.int32)
    sums, counts = fetch(functools.partial(kernels.segment_dataset_loss, num_datasets=3),
                         seg_loss, tokens, dataset)
    for d in range(3):
        np.testing.assert_allclose(sums[d], seg_loss[dataset == d].sum(), rtol=1e-5)
        assert counts[d] == tokens[dataset == d].sum()


# --- the fused loss head ---------------------------------------------------------------------

SOFTCAP, Z_LOSS = 5.0, 1e-3


def _materialized(hidden, weight, targets, offsets, lengths, mask, normalize):
    """segment_cross_entropy(hidden @ weight) in f32: -100 labels and the hidden rows of
    uncounted tokens (NaN on padding) taken out first, as a user of the materialized path would."""
    ids = reference.segment_index(offsets, lengths, targets.shape[1])
    counted = (ids < offsets.shape[1]) & (targets >= 0) & mask
    h = jnp.where(counted[:, :, None], hidden, 0).astype(jnp.float32)
    logits = jnp.einsum("blh,hv->blv", h, weight.astype(jnp.float32))
    logits = SOFTCAP * jnp.tanh(logits / SOFTCAP)
    return reference.segment_cross_entropy(logits, jnp.maximum(targets, 0), offsets, lengths,
                                           normalize=normalize, loss_mask=counted,
                                           z_loss=Z_LOSS)


@functools.cache
def _loss_head(mode: str | None, normalize: str, per_segment: bool, carry: str | None = None):
    """mode None: the materialized reference. Gradients of loss (+ w . per_segment_loss);
    carry: weight_grad_dtype."""
    if mode == "chunked":  # chunks of L tokens: ROWS chunks
        kw = dict(mode=mode, max_logits_bytes=4 * SIZES.vocab * SIZES.seq_len,
                  weight_grad_dtype=carry)
    else:
        kw = dict(mode=mode)
    kw.update(options(block_sizes=kernels.LinearCrossEntropyBlockSizes(block_tokens=256,
                                                                        block_vocab=128)))

    def f(hidden, weight, targets, offsets, lengths, mask, w):
        def objective(hidden, weight):
            if mode is None:
                out = _materialized(hidden, weight, targets, offsets, lengths, mask, normalize)
            else:
                out = kernels.segment_linear_cross_entropy(
                    hidden, weight, targets, offsets, lengths, normalize=normalize,
                    loss_mask=mask, z_loss=Z_LOSS, logit_softcap=SOFTCAP, **kw)
            return out[0] + (jnp.sum(w * out[1]) if per_segment else 0.0), out

        grads, out = jax.grad(objective, (0, 1), has_aux=True)(hidden, weight)
        return (*out, *grads)

    return jax.jit(f)


LOSS_HEAD_CASES = [  # (mode, dtype, normalize, a cotangent on per_segment_loss too, carry)
    ("logits", BF16, "tokens", False, None),
    ("chunked", F32, "segments", True, None),
    ("chunked", BF16, "tokens", False, "bfloat16"),
    ("recompute", BF16, "segments", True, None),
    ("recompute", F32, "tokens", False, None),
]


@pytest.mark.parametrize("mode,dtype,normalize,per_segment,carry", LOSS_HEAD_CASES,
                         ids=[f"{m}-{d}-{n}{'-per_segment' if p else ''}{'-dw_' + c if c else ''}"
                              for m, d, n, p, c in LOSS_HEAD_CASES])
def test_segment_linear_cross_entropy(mode, dtype, normalize, per_segment, carry):
    """Each mode with z-loss, a soft-cap, an odd vocabulary, -100 labels, a loss mask and NaN
    hidden on padding: values, d hidden and d weight vs the materialized f32 logits (chunked
    also with d weight carried in bf16)."""
    rng = np.random.default_rng(2)
    offsets, lengths = metadata_sets()["wide"]
    pad = padding_of(offsets, lengths)
    shape = (ROWS, SIZES.seq_len)
    hidden = with_nan(normal(rng, (*shape, SIZES.hidden), dtype), pad)
    weight = normal(rng, (SIZES.hidden, SIZES.vocab), dtype, 3.0 / SIZES.hidden**0.5)
    targets = rng.integers(0, SIZES.vocab, shape).astype(np.int32)
    targets[rng.random(shape) < 0.1] = -100
    mask = rng.random(shape) > 0.2
    w = normal(rng, offsets.shape, F32, 0.1)
    args = (hidden, weight, targets, offsets, lengths, mask, w)
    loss, seg_loss, tokens, dh, dw = fetch(_loss_head(mode, normalize, per_segment, carry), *args)
    with HIGHEST():
        want = fetch(_loss_head(None, normalize, per_segment), *args)
    assert_close("loss", loss, want[0], *HEAD_VALUES)
    assert_close("per_segment_loss", seg_loss, want[1], *HEAD_VALUES)
    np.testing.assert_array_equal(tokens, want[2])
    for name, a, b in (("dhidden", dh, want[3]), ("dweight", dw, want[4])):
        assert a.dtype == jnp.dtype(dtype), name
        assert_grad_close(name, a, b, *MATMUL[dtype])
    assert not np.asarray(dh, np.float32)[pad].any(), "dhidden nonzero on padding"


# --- segment sum / mean / max / broadcast / gather -------------------------------------------


def _segment_op(op: str, impl):
    """(x [B, L, D] or values [B, S, D], offsets, lengths) -> out, by the kernels or reference."""
    seg = kernels.SegmentBlockSizes(block_tokens=256, block_features=128, chunk=32)
    if impl is reference:
        kw, gather_kw = {}, {}
    else:
        kw, gather_kw = options(block_sizes=seg), options(
            block_sizes=kernels.GatherBlockSizes(block_features=128))
    if op == "broadcast":
        return lambda x, o, n: impl.segment_broadcast(x, o, n, seq_len=SIZES.seq_len, **kw)
    if op.startswith("gather"):
        position = op.split("_")[1]
        position = int(position) if position.lstrip("-").isdigit() else position
        return lambda x, o, n: impl.segment_gather(x, o, n, position=position, **gather_kw)
    run = getattr(impl, f"segment_{op}")
    return lambda x, o, n: run(x, o, n, **kw)


@functools.cache
def _segment_vjp(op: str, fused: bool):
    run = _segment_op(op, kernels if fused else reference)

    def f(x, offsets, lengths, g):
        out, vjp = jax.vjp(lambda x: run(x, offsets, lengths), x)
        return out, vjp(g)[0]

    return jax.jit(f)


SEGMENT_CASES = [("sum", F32), ("sum", BF16), ("mean", F32), ("max", F32), ("max", BF16),
                 ("broadcast", BF16), ("gather_last", F32), ("gather_-3", BF16)]


@pytest.mark.parametrize("op,dtype", SEGMENT_CASES, ids=[f"{o}-{d}" for o, d in SEGMENT_CASES])
def test_segment_ops(op, dtype):
    """Values and gradients vs the reference; NaN where no segment reads (padding tokens, or the
    unused slots' values for broadcast) reaches nothing; 0 on padding and empty slots."""
    rng = np.random.default_rng(3)
    offsets, lengths = metadata_sets()["wide"]
    pad = padding_of(offsets, lengths)
    unused = lengths == 0
    tokens = (ROWS, SIZES.seq_len, SIZES.features)
    slots = (ROWS, SLOTS, SIZES.features)
    if op == "broadcast":
        x, g, x_pad, out_pad = with_nan(normal(rng, slots, dtype), unused), tokens, unused, pad
    else:
        x, g, x_pad, out_pad = with_nan(normal(rng, tokens, dtype), pad), slots, pad, unused
    g = normal(rng, g, dtype)
    got, dx = fetch(_segment_vjp(op, True), x, offsets, lengths, g)
    with HIGHEST():
        want, want_dx = fetch(_segment_vjp(op, False), x, offsets, lengths, g)
    rtol, atol = ELEMENTWISE[dtype]
    assert got.dtype == dx.dtype == jnp.dtype(dtype)
    assert_grad_close(op, got, want, rtol, atol)
    assert_grad_close(f"d {op}", dx, want_dx, rtol, atol)
    assert not np.asarray(got, np.float32)[out_pad].any(), f"{op}: nonzero on padding / empty"
    assert not np.asarray(dx, np.float32)[x_pad].any(), f"d {op}: nonzero where nothing reads"
