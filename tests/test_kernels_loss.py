"""segment_cross_entropy: Pallas (interpret) vs reference, normalizations, gradients, edge cases."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack import kernels
from seqpack.kernels import reference
from tests.helpers.kernels import (
    BF16_SLOW,
    CASES,
    CE_BLOCKS,
    GPU_BLOCKS,
    INTERPRET,
    B,
    L,
    S,
    assert_close,
    case,
    lower_tpu,
    metadata,
    random_array,
    random_rows,
    run,
)

V = 300  # not a multiple of the 128-wide test vocab block: the last vocab tile is partial
NORMALIZE = ("tokens", "segments", "none")


@functools.cache
def _fn(normalize: str, pallas: bool, z_loss: float = 1e-3, masked: bool = True,
        blocks: kernels.CrossEntropyBlockSizes | None = CE_BLOCKS):
    """Jitted (logits, targets, offsets, lengths, mask, w) -> (loss, seg_loss, tokens, dlogits).

    The gradient is of loss + sum(w * per_segment_loss), so both outputs' cotangents are checked.
    """
    if pallas:
        ce = functools.partial(kernels.segment_cross_entropy, impl="pallas",
                               interpret=INTERPRET, block_sizes=blocks)
    else:
        ce = reference.segment_cross_entropy

    def f(logits, targets, offsets, lengths, mask, w):
        def objective(logits):
            loss, seg_loss, tokens = ce(logits, targets, offsets, lengths, normalize=normalize,
                                        loss_mask=mask if masked else None, z_loss=z_loss)
            return loss + jnp.sum(w * seg_loss), (loss, seg_loss, tokens)

        dlogits, aux = jax.grad(objective, has_aux=True)(logits)
        return (*aux, dlogits)

    return jax.jit(f)


def _inputs(rng, offsets, dtype=jnp.float32, scale=3.0):
    logits = random_array(rng, (B, L, V), dtype, scale)
    targets = rng.integers(0, V, size=(B, L)).astype(np.int32)
    mask = rng.random((B, L)) > 0.25
    w = random_array(rng, offsets.shape, jnp.float32, 0.1)
    return logits, targets, mask, w


def _check(normalize, logits, targets, offsets, lengths, mask, w, dtype, **kw):
    args = (logits, targets, offsets, lengths, mask, w)
    loss, seg_loss, tokens, dlogits = run(_fn(normalize, True, **kw), *args)
    r_loss, r_seg_loss, r_tokens, r_dlogits = run(_fn(normalize, False, **kw), *args)
    assert loss.shape == () and seg_loss.shape == offsets.shape and tokens.dtype == np.int32
    np.testing.assert_array_equal(tokens, r_tokens)
    assert_close(loss, r_loss, jnp.float32)
    assert_close(seg_loss, r_seg_loss, jnp.float32)
    assert dlogits.dtype == dtype
    assert_close(dlogits, r_dlogits, dtype, "grad")
    return loss, seg_loss, tokens, dlogits


@pytest.mark.parametrize("dtype", [jnp.float32, BF16_SLOW])
@pytest.mark.parametrize("normalize", ["tokens",  # "none" runs fast below
                                       pytest.param("segments", marks=pytest.mark.slow),
                                       pytest.param("none", marks=pytest.mark.slow)])
def test_matches_reference(normalize, dtype):
    rng = np.random.default_rng(0)
    offsets, lengths = case("mixed")
    logits, targets, mask, w = _inputs(rng, offsets, dtype)
    _check(normalize, logits, targets, offsets, lengths, mask, w, dtype)


@pytest.mark.parametrize("name", list(CASES))
def test_edge_cases(name):
    rng = np.random.default_rng(1)
    offsets, lengths = case(name)
    logits, targets, mask, w = _inputs(rng, offsets)
    _check("segments", logits, targets, offsets, lengths, mask, w, jnp.float32)


@pytest.mark.slow
def test_no_mask_no_z_loss_default_blocks():
    rng = np.random.default_rng(2)
    offsets, lengths = case("aligned_16")
    logits, targets, mask, w = _inputs(rng, offsets)
    _, _, tokens, _ = _check("tokens", logits, targets, offsets, lengths, mask, w, jnp.float32,
                             z_loss=0.0, masked=False, blocks=None)
    np.testing.assert_array_equal(tokens, lengths)


@pytest.mark.slow
def test_normalizations_by_hand():
    """Per-segment sums from the kernel reproduce the three normalizations; padding is excluded."""
    rng = np.random.default_rng(3)
    offsets, lengths = case("empty_row")
    logits, targets, mask, w = _inputs(rng, offsets)
    ids = np.asarray(reference.segment_index(offsets, lengths, L))
    logits[ids == S] = np.nan  # padding logits must never reach the loss or its gradient
    out = {n: _check(n, logits, targets, offsets, lengths, mask, w, jnp.float32)
           for n in NORMALIZE}
    _, seg_loss, tokens, dlogits = out["none"]
    assert np.isfinite(dlogits).all() and np.all(dlogits[ids == S] == 0.0)
    np.testing.assert_array_equal(tokens, [[0] * S, [
        int(mask[1, o:o + n].sum()) for o, n in zip(offsets[1], lengths[1])]])
    np.testing.assert_allclose(out["none"][0], seg_loss.sum(), rtol=1e-6)
    np.testing.assert_allclose(out["tokens"][0], seg_loss.sum() / tokens.sum(), rtol=1e-6)
    nonempty = tokens > 0
    means = seg_loss[nonempty] / tokens[nonempty]
    np.testing.assert_allclose(out["segments"][0], means.mean(), rtol=1e-6)


@pytest.mark.parametrize("normalize", NORMALIZE)
def test_empty_batch_gives_zero(normalize):
    rng = np.random.default_rng(4)
    offsets, lengths = metadata([[], []], S)
    logits, targets, mask, w = _inputs(rng, offsets)
    loss, seg_loss, tokens, dlogits = _check(normalize, logits, targets, offsets, lengths, mask, w,
                                             jnp.float32)
    assert loss == 0.0 and not seg_loss.any() and not tokens.any() and not dlogits.any()


@pytest.mark.slow
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), alignment=st.sampled_from([1, 16]))
def test_random_packed_rows(seed, alignment):
    rng = np.random.default_rng(seed)
    offsets, lengths = random_rows(rng, B, L, S, alignment=alignment)
    logits, targets, mask, w = _inputs(rng, offsets)
    _check("segments", logits, targets, offsets, lengths, mask, w, jnp.float32)


def test_static_checks():
    logits = np.zeros((B, L, V), np.float32)
    targets = np.zeros((B, L), np.int32)
    offsets, lengths = case("mixed")
    with pytest.raises(ValueError, match="normalize"):
        kernels.segment_cross_entropy(logits, targets, offsets, lengths, normalize="mean")
    with pytest.raises(ValueError, match="targets.shape"):
        kernels.segment_cross_entropy(logits, targets[:, :-1], offsets, lengths)
    with pytest.raises(ValueError, match="loss_mask.shape"):
        kernels.segment_cross_entropy(logits, targets, offsets, lengths, loss_mask=targets[:1])
    with pytest.raises(ValueError, match="z_loss"):
        kernels.segment_cross_entropy(logits, targets, offsets, lengths, z_loss=-1.0)
    with pytest.raises(ValueError, match="logits.shape"):
        kernels.segment_cross_entropy(logits[..., 0], targets, offsets, lengths)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_for_tpu(dtype):
    logits = jnp.zeros((4, 1000, 5000), dtype)
    targets = jnp.zeros((4, 1000), jnp.int32)
    meta = jnp.zeros((4, 16), jnp.int32)
    for normalize in NORMALIZE:
        f = lambda lg, t, o, n, m=normalize: kernels.segment_cross_entropy(
            lg, t, o, n, normalize=m, z_loss=1e-4, loss_mask=t > 0, impl="pallas_tpu")
        lower_tpu(f, logits, targets, meta, meta)
        lower_tpu(jax.grad(lambda lg, t, o, n, f=f: f(lg, t, o, n)[0]), logits, targets, meta,
                  meta)


@pytest.mark.slow
def test_one_slot_filling_the_row():
    rng = np.random.default_rng(5)
    offsets, lengths = metadata([[(0, L)], [(20, L - 20)]], 1)
    logits, targets, mask, w = _inputs(rng, offsets)
    _, _, tokens, _ = _check("segments", logits, targets, offsets, lengths, mask, w, jnp.float32)
    np.testing.assert_array_equal(tokens[:, 0], [mask[0].sum(), mask[1, 20:].sum()])


IGNORE_CASES = {  # impl name -> keyword arguments of segment_cross_entropy
    "reference": dict(impl="reference"),
    "pallas_tpu": dict(impl="pallas_tpu", interpret=INTERPRET, block_sizes=CE_BLOCKS),
    "pallas_gpu": dict(impl="pallas_gpu", interpret=True, block_sizes=GPU_BLOCKS),
}


@pytest.mark.parametrize("name", list(IGNORE_CASES))
def test_negative_targets_are_ignored_and_out_of_vocab_ones_poison_their_segment(name):
    """-100 (PyTorch's ignore_index) is not counted, as under a zero loss_mask, by every impl
    and the fused head; a target >= V makes its own segment's loss and the loss NaN, never a
    made-up value, leaving the other segments' losses as they were."""
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(1, 16, 5)), jnp.float32)
    targets = rng.integers(0, 5, (1, 16))
    off, ln = jnp.asarray([[0, 8]], jnp.int32), jnp.asarray([[8, 8]], jnp.int32)
    ignored = np.zeros((1, 16), bool)
    ignored[0, [2, 5, 11]] = True
    ce = functools.partial(kernels.segment_cross_entropy, **IGNORE_CASES[name])
    want = reference.segment_cross_entropy(logits, jnp.asarray(targets), off, ln,
                                           loss_mask=jnp.asarray(~ignored))
    got = ce(logits, jnp.asarray(np.where(ignored, -100, targets)), off, ln)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    assert int(got[2].sum()) == 13
    bad = targets.copy()
    bad[0, 12] = 7  # in the second segment
    loss, per_seg, _ = ce(logits, jnp.asarray(bad), off, ln)
    assert np.isnan(float(loss)) and np.isnan(float(per_seg[0, 1]))
    clean = reference.segment_cross_entropy(logits, jnp.asarray(targets), off, ln)[1]
    np.testing.assert_allclose(float(per_seg[0, 0]), float(clean[0, 0]), rtol=1e-5)
    if name == "reference":  # the fused head, every mode, agrees
        eye = jnp.eye(5, dtype=jnp.float32)
        for mode in ("logits", "chunked", "recompute"):
            head = functools.partial(kernels.segment_linear_cross_entropy, mode=mode,
                                     max_logits_bytes=8 * 5 * 4 if mode == "chunked" else None)
            got = head(logits, eye, jnp.asarray(np.where(ignored, -100, targets)), off, ln)
            for g, w in zip(got, want):
                np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
            loss, per_seg, _ = head(logits, eye, jnp.asarray(bad), off, ln)
            assert np.isnan(float(loss)) and np.isnan(float(per_seg[0, 1])), mode
            assert np.isfinite(float(per_seg[0, 0])), mode
