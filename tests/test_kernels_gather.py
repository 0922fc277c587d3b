"""segment_gather: Pallas (interpret) vs reference, values and gradients, edge cases, lowering."""

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
    GATHER_BLOCKS,
    INTERPRET,
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

POSITIONS = ("first", "last", 2, -3)


@functools.cache
def _fn(position, pallas: bool, grad: bool = True):
    if pallas:
        f = lambda x, o, n: kernels.segment_gather(x, o, n, position=position, impl="pallas",
                                                   interpret=INTERPRET, block_sizes=GATHER_BLOCKS)
    else:
        f = lambda x, o, n: reference.segment_gather(x, o, n, position=position)
    return value_and_vjp(f) if grad else jax.jit(f)


def _check(position, x, offsets, lengths, g, dtype):
    return check_vjp_pair(_fn(position, True), _fn(position, False), x, offsets, lengths, g,
                          dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, BF16_SLOW])
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name, position, dtype):
    rng = np.random.default_rng(0)
    offsets, lengths = case(name)
    x = random_array(rng, (B, L, D), dtype)
    _check(position, x, offsets, lengths, random_array(rng, (B, S, D), dtype), dtype)


def test_picks_exact_tokens_and_zero_for_absent():
    """x[b, p, :] = p: the output is the picked position itself; absent picks are 0."""
    offsets, lengths = metadata([[(0, 5), (5, 7), (16, 2)], []], S)
    x = np.broadcast_to(np.arange(L, dtype=np.float32)[None, :, None], (B, L, D)).copy()
    g = np.ones((B, S, D), np.float32)
    last, _ = run(_fn("last", True), x, offsets, lengths, g)
    np.testing.assert_array_equal(last[0, :, 0], [4, 11, 17, 0])
    np.testing.assert_array_equal(last[1], 0)
    third, dx = run(_fn(2, True), x, offsets, lengths, g)
    np.testing.assert_array_equal(third[0, :, 0], [2, 7, 0, 0])  # slot 2 has only 2 tokens
    np.testing.assert_array_equal(np.nonzero(dx[0, :, 0])[0], [2, 7])
    np.testing.assert_array_equal(dx[1], 0)


@pytest.mark.slow
def test_2d_input_and_one_slot():
    rng = np.random.default_rng(1)
    x = random_array(rng, (B, L), jnp.float32)
    offsets, lengths = case("aligned_16")
    _check("last", x, offsets, lengths, random_array(rng, (B, S), jnp.float32), jnp.float32)
    offsets, lengths = metadata([[(0, 100)], [(40, 60)]], 1)
    out = _check("first", x, offsets, lengths, random_array(rng, (B, 1), jnp.float32),
                 jnp.float32)
    np.testing.assert_array_equal(out[:, 0], [x[0, 0], x[1, 40]])


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), alignment=st.sampled_from([1, 8]))
def test_random_packed_rows(seed, alignment):
    rng = np.random.default_rng(seed)
    offsets, lengths = random_rows(rng, B, L, S, alignment=alignment)
    x = random_array(rng, (B, L, D), jnp.float32)
    for position in ("first", "last"):
        assert_close(run(_fn(position, True, False), x, offsets, lengths),
                     run(_fn(position, False, False), x, offsets, lengths), jnp.float32)


def test_bad_position():
    x = np.zeros((B, L, D), np.float32)
    offsets, lengths = case("mixed")
    with pytest.raises(ValueError, match="position="):
        kernels.segment_gather(x, offsets, lengths, position="middle")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(4, 1000, 384), (4, 1000)])
def test_lowers_for_tpu(shape, dtype):
    x = jnp.zeros(shape, dtype)
    meta = jnp.zeros((4, 16), jnp.int32)
    for position in ("first", "last", 3):
        f = lambda x, o, n, p=position: kernels.segment_gather(x, o, n, position=p,
                                                               impl="pallas_tpu")
        lower_tpu(f, x, meta, meta)
        lower_tpu(jax.grad(lambda x, o, n, f=f: f(x, o, n).astype(jnp.float32).sum()),
                  x, meta, meta)
