"""kernels.reference on its own: every function against a plain numpy loop over segments."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.loss_head import sub_jaxprs
from seqpack.kernels import reference
from tests.helpers.kernels import CASES, B, L, S, case, random_array

D = 8


def _segments(offsets, lengths):
    for b in range(offsets.shape[0]):
        for j in range(offsets.shape[1]):
            yield b, j, int(offsets[b, j]), int(lengths[b, j])


@pytest.mark.parametrize("name", list(CASES))
def test_reductions_and_gather(name):
    rng = np.random.default_rng(0)
    offsets, lengths = case(name)
    x = random_array(rng, (B, L, D), jnp.float32)
    want = {k: np.zeros((B, S, D), np.float32) for k in ("sum", "mean", "max", "first", "last")}
    want["max"][:] = -7.0
    for b, j, o, n in _segments(offsets, lengths):
        if n:
            seg = x[b, o:o + n]
            want["sum"][b, j], want["mean"][b, j], want["max"][b, j] = (
                seg.sum(0), seg.mean(0), seg.max(0))
            want["first"][b, j], want["last"][b, j] = seg[0], seg[-1]
    got = {
        "sum": reference.segment_sum(x, offsets, lengths),
        "mean": reference.segment_mean(x, offsets, lengths),
        "max": reference.segment_max(x, offsets, lengths, fill_value=-7.0),
        "first": reference.segment_gather(x, offsets, lengths, position="first"),
        "last": reference.segment_gather(x, offsets, lengths, position=-1),
    }
    for key in want:
        np.testing.assert_allclose(np.asarray(got[key]), want[key], rtol=1e-5, atol=1e-5,
                                   err_msg=key)


def test_segment_index_and_broadcast():
    offsets, lengths = case("aligned_16")
    ids = np.asarray(reference.segment_index(offsets, lengths, L))
    values = np.arange(1, B * S + 1, dtype=np.float32).reshape(B, S)
    out = np.asarray(reference.segment_broadcast(values, offsets, lengths, seq_len=L))
    for b in range(B):
        for p in range(L):
            hits = [j for _, j, o, n in _segments(offsets[b:b + 1], lengths[b:b + 1])
                    if o <= p < o + n]
            assert ids[b, p] == (hits[0] if hits else S)
            assert out[b, p] == (values[b, hits[0]] if hits else 0.0)


@pytest.mark.parametrize("normalize", ["tokens", "segments", "none"])
def test_cross_entropy(normalize):
    rng = np.random.default_rng(1)
    V = 11
    offsets, lengths = case("mixed")
    logits = random_array(rng, (B, L, V), jnp.float32, 2.0)
    targets = rng.integers(0, V, size=(B, L))
    mask = rng.random((B, L)) > 0.3
    z = 1e-2
    seg_loss = np.zeros((B, S))
    seg_tokens = np.zeros((B, S), int)
    for b, j, o, n in _segments(offsets, lengths):
        for p in range(o, o + n):
            if mask[b, p]:
                lse = np.log(np.exp(logits[b, p].astype(np.float64)).sum())
                seg_loss[b, j] += lse - logits[b, p, targets[b, p]] + z * lse**2
                seg_tokens[b, j] += 1
    if normalize == "tokens":
        want = seg_loss.sum() / seg_tokens.sum()
    elif normalize == "segments":
        want = (seg_loss[seg_tokens > 0] / seg_tokens[seg_tokens > 0]).mean()
    else:
        want = seg_loss.sum()
    loss, got_loss, got_tokens = reference.segment_cross_entropy(
        logits, targets, offsets, lengths, normalize=normalize, loss_mask=mask, z_loss=z)
    np.testing.assert_array_equal(np.asarray(got_tokens), seg_tokens)
    np.testing.assert_allclose(np.asarray(got_loss), seg_loss, rtol=1e-5)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)


def test_gradients_stay_inside_segments():
    offsets, lengths = case("aligned_16")
    ids = np.asarray(reference.segment_index(offsets, lengths, L))
    x = np.ones((B, L, D), np.float32)
    for f in (reference.segment_sum, reference.segment_mean, reference.segment_max):
        dx = np.asarray(jax.grad(lambda x, f=f: f(x, offsets, lengths).sum())(x))
        assert np.all(dx[ids == S] == 0.0) and np.all(dx[ids < S] > 0.0)


@pytest.mark.parametrize("name", list(CASES))
def test_per_token_sums_and_broadcasts_are_masked_reductions(name):
    """segment_sum of [B, L] and segment_broadcast of [B, S]: against a loop, NaN outside every
    segment reaches nothing, and neither they nor their gradients scatter or gather (a TPU
    serializes those)."""
    rng = np.random.default_rng(2)
    offsets, lengths = case(name)
    ids = np.asarray(reference.segment_index(offsets, lengths, L))
    x = np.where(ids < S, rng.standard_normal((B, L)), np.nan).astype(np.float32)
    values = rng.standard_normal((B, S)).astype(np.float32)
    want_sum, want_broadcast = np.zeros((B, S), np.float32), np.zeros((B, L), np.float32)
    for b, j, o, n in _segments(offsets, lengths):
        want_sum[b, j] = x[b, o:o + n].sum()
        want_broadcast[b, o:o + n] = values[b, j]
    np.testing.assert_allclose(np.asarray(reference.segment_sum(x, offsets, lengths)),
                               want_sum, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(
        np.asarray(reference.segment_broadcast(values, offsets, lengths, seq_len=L)),
        want_broadcast)

    def both(x, values):
        sums = reference.segment_sum(x, offsets, lengths)
        spread = reference.segment_broadcast(values, offsets, lengths, seq_len=L)
        return jnp.sum(sums * values) + jnp.sum(jnp.where(ids < S, spread * x, 0.0))

    dx, dvalues = jax.grad(both, (0, 1))(x, values)
    want_dx = np.where(ids < S, 2 * np.take_along_axis(
        np.concatenate([values, np.zeros((B, 1), np.float32)], 1), ids, 1), 0.0)
    np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dvalues), 2 * want_sum, rtol=1e-5, atol=1e-5)
    used = {eqn.primitive.name for jx, _ in sub_jaxprs(jax.make_jaxpr(jax.grad(both, (0, 1)))(
        x, values)) for eqn in jx.eqns}
    assert not {p for p in used if "scatter" in p or "gather" in p}, used
