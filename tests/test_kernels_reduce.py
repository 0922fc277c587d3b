"""segment_sum / segment_mean / segment_max / segment_broadcast: Pallas (interpret) vs reference."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack import kernels
from seqpack.kernels import SegmentBlockSizes, reference
from tests.helpers.kernels import (
    BF16_SLOW,
    CASES,
    INTERPRET,
    SEG_BLOCKS,
    B,
    D,
    L,
    S,
    assert_close,
    case,
    check_vjp_pair,
    lower_tpu,
    metadata,
    random_array,
    random_rows,
    run,
    value_and_vjp,
)

OPS = ("segment_sum", "segment_mean", "segment_max")
PALLAS = dict(impl="pallas", interpret=INTERPRET, block_sizes=SEG_BLOCKS)


@functools.cache
def _fn(op: str, pallas: bool, grad: bool = True):
    """Jitted op(x, offsets, lengths) (with its vjp when grad: extra last arg g), built once."""
    if pallas:
        f = lambda x, o, n: getattr(kernels, op)(x, o, n, **PALLAS)
    else:
        f = getattr(reference, op)
    return value_and_vjp(f) if grad else jax.jit(f)


def _check(op, x, offsets, lengths, g, dtype):
    check_vjp_pair(_fn(op, True), _fn(op, False), x, offsets, lengths, g, dtype)


def _mean_off_mixed_slow(names):
    """(op, name) cases: segment_mean (segment_sum over the counts) runs fast on "mixed" alone,
    its other rows with -m slow."""
    return [pytest.param(op, name, marks=pytest.mark.slow)
            if op == "segment_mean" and name != "mixed" else (op, name)
            for op in OPS for name in names]


@pytest.mark.parametrize("dtype", [jnp.float32, BF16_SLOW])
@pytest.mark.parametrize("op,name", _mean_off_mixed_slow(list(CASES)))
def test_matches_reference_3d(name, op, dtype):
    rng = np.random.default_rng(0)
    offsets, lengths = case(name)
    x = random_array(rng, (B, L, D), dtype)
    _check(op, x, offsets, lengths, random_array(rng, (B, S, D), dtype), dtype)


@pytest.mark.parametrize("op,name", _mean_off_mixed_slow(["mixed", "aligned_16", "empty_row"]))
def test_matches_reference_2d(name, op):
    rng = np.random.default_rng(1)
    offsets, lengths = case(name)
    x = random_array(rng, (B, L), jnp.float32)
    _check(op, x, offsets, lengths, random_array(rng, (B, S), jnp.float32), jnp.float32)


@jax.jit
def _max_fill(x, offsets, lengths):
    return kernels.segment_max(x, offsets, lengths, fill_value=-1.0, **PALLAS)


@jax.jit
def _broadcast(values, offsets, lengths):
    return kernels.segment_broadcast(values, offsets, lengths, seq_len=L, **PALLAS)


@jax.jit
def _broadcast_ref(values, offsets, lengths):
    return reference.segment_broadcast(values, offsets, lengths, seq_len=L)


def test_empty_slots_give_zero_and_fill():
    offsets, lengths = case("empty_row")
    x = np.full((B, L, D), -5.0, np.float32)
    total = run(_fn("segment_sum", True, False), x, offsets, lengths)
    mean = run(_fn("segment_mean", True, False), x, offsets, lengths)
    top = run(_max_fill, x, offsets, lengths)
    assert np.all(total[0] == 0.0) and np.all(mean[0] == 0.0)
    assert np.all(top[0] == -1.0)
    assert np.all(top[1, 3] == -1.0)  # row 1 uses 3 of 4 slots
    assert np.all(top[1, :3] == -5.0)


def test_padding_never_leaks():
    """NaN on every padding token (alignment gaps, row tail) must not reach any output or grad."""
    offsets, lengths = case("aligned_16")
    ids = np.asarray(reference.segment_index(offsets, lengths, L))
    x = np.where((ids < S)[..., None], 1.0, np.nan).astype(np.float32) * np.ones((B, L, D), "f4")
    g = np.ones((B, S, D), np.float32)
    for op in OPS:
        out, dx = run(_fn(op, True), x, offsets, lengths, g)
        assert np.isfinite(out).all(), op
        assert np.isfinite(dx).all() and np.all(dx[ids == S] == 0.0), op


def test_max_gradient_splits_ties():
    rng = np.random.default_rng(2)
    offsets, lengths = case("mixed")
    x = rng.integers(0, 3, size=(B, L, D)).astype(np.float32)  # many ties
    g = random_array(rng, (B, S, D), jnp.float32)
    _check("segment_max", x, offsets, lengths, g, jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, BF16_SLOW])
def test_broadcast_matches_reference(dtype):
    rng = np.random.default_rng(3)
    offsets, lengths = case("aligned_16")
    values = random_array(rng, (B, S, D), dtype)
    g = random_array(rng, (B, L, D), dtype)
    out, dv = run(value_and_vjp(_broadcast), values, offsets, lengths, g)
    ref, dv_ref = run(value_and_vjp(_broadcast_ref), values, offsets, lengths, g)
    assert out.shape == (B, L, D) and out.dtype == dtype
    assert_close(out, ref, dtype)
    assert_close(dv, dv_ref, dtype, "grad")
    out2 = run(_broadcast, values[..., 0], offsets, lengths)
    assert out2.shape == (B, L)
    assert_close(out2, ref[..., 0], dtype)


@pytest.mark.slow
def test_one_slot_and_odd_feature_width():
    """S = 1, D = 200 (partial lane block of 128), default token block larger than L."""
    rng = np.random.default_rng(4)
    offsets, lengths = metadata([[(3, 60)], [(0, 100)]], 1)
    x = random_array(rng, (B, L, 200), jnp.float32)
    blocks = SegmentBlockSizes(block_features=128)
    for op in OPS:
        f = jax.jit(lambda x, o, n, op=op: getattr(kernels, op)(
            x, o, n, impl="pallas", interpret=INTERPRET, block_sizes=blocks))
        out = run(f, x, offsets, lengths)
        assert out.shape == (B, 1, 200)
        assert_close(out, run(_fn(op, False, False), x, offsets, lengths), jnp.float32)


def test_jittable_and_auto_uses_reference_on_cpu():
    offsets, lengths = case("mixed")
    x = random_array(np.random.default_rng(5), (B, L, D), jnp.float32)
    out = run(lambda x, o, n: kernels.segment_mean(x, o, n, **PALLAS).sum(), x, offsets, lengths)
    assert_close(out, run(lambda *a: reference.segment_mean(*a).sum(), x, offsets, lengths),
                 jnp.float32)
    if jax.default_backend() != "tpu":
        jaxpr = str(jax.make_jaxpr(lambda x: kernels.segment_sum(x, offsets, lengths))(x))
        assert "pallas_call" not in jaxpr
        jaxpr = str(jax.make_jaxpr(_fn("segment_sum", True, False))(x, offsets, lengths))
        assert "pallas_call" in jaxpr


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), alignment=st.sampled_from([1, 4, 16]))
def test_random_packed_rows(seed, alignment):
    rng = np.random.default_rng(seed)
    offsets, lengths = random_rows(rng, B, L, S, alignment=alignment)
    kernels.validate_segments(offsets, lengths, seq_len=L)
    x = random_array(rng, (B, L, D), jnp.float32)
    for op in OPS:
        assert_close(run(_fn(op, True, False), x, offsets, lengths),
                     run(_fn(op, False, False), x, offsets, lengths), jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(4, 1000, 384), (4, 1000)])
def test_lowers_for_tpu(shape, dtype):
    x = jnp.zeros(shape, dtype)
    meta = jnp.zeros((4, 16), jnp.int32)
    for op in OPS:
        f = lambda x, o, n, op=op: getattr(kernels, op)(x, o, n, impl="pallas_tpu")
        lower_tpu(f, x, meta, meta)
        lower_tpu(jax.grad(lambda x, o, n, f=f: f(x, o, n).astype(jnp.float32).sum()),
                  x, meta, meta)
    values = jnp.zeros((4, 16, *shape[2:]), dtype)
    f = lambda v, o, n: kernels.segment_broadcast(v, o, n, seq_len=1000, impl="pallas_tpu")
    lower_tpu(f, values, meta, meta)
    lower_tpu(jax.grad(lambda v, o, n: f(v, o, n).astype(jnp.float32).sum()), values, meta, meta)


@pytest.mark.slow
def test_row_shorter_than_one_chunk():
    """L = 5 < chunk and D = 3 < 128: one token block larger than the row, one narrow lane block."""
    rng = np.random.default_rng(6)
    offsets, lengths = metadata([[(0, 2), (2, 3)], [(1, 3)]], 2)
    x = random_array(rng, (B, 5, 3), jnp.float32)
    for op in OPS:
        f = jax.jit(lambda x, o, n, op=op: getattr(kernels, op)(x, o, n, impl="pallas",
                                                               interpret=INTERPRET))
        assert_close(run(f, x, offsets, lengths), run(_fn(op, False, False), x, offsets, lengths),
                     jnp.float32)
