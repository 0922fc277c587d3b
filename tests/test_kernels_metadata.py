"""Metadata from any packer: segment_metadata (Grain / MaxText segment ids) and length-0 slots at
any offset, through the TPU kernels (the GPU kernels' cases are in test_kernels_gpu.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqpack import kernels
from seqpack.kernels import reference
from tests.helpers.kernels import (
    CASES,
    CE_BLOCKS,
    INTERPRET,
    SEG_BLOCKS,
    B,
    D,
    L,
    S,
    assert_close,
    case,
    random_array,
    run,
    zero_padded,
)


def test_segment_metadata_worked_example():
    ids = np.array([[1, 1, 1, 0, 2, 2, 0, 0], [0] * 8, [1] * 8])
    offsets, lengths = kernels.segment_metadata(ids, 3)
    np.testing.assert_array_equal(offsets, [[0, 4, 6], [0, 0, 0], [0, 8, 8]])
    np.testing.assert_array_equal(lengths, [[3, 2, 0], [0, 0, 0], [8, 0, 0]])
    assert offsets.dtype == lengths.dtype == jnp.int32


@pytest.mark.parametrize("name", list(CASES))
def test_segment_metadata_inverts_segment_ids(name):
    """ids from the row contract's metadata give that metadata back, under jit."""
    offsets, lengths = case(name)
    slot = np.asarray(reference.segment_index(offsets, lengths, L))
    ids = np.where(slot < S, slot + 1, 0)
    got = jax.jit(kernels.segment_metadata, static_argnums=1)(ids, S)
    np.testing.assert_array_equal(got[0], offsets)
    np.testing.assert_array_equal(got[1], lengths)
    kernels.validate_segments(*got, seq_len=L)


def test_segment_metadata_ignores_ids_past_the_cap():
    ids = np.array([[1, 1, 2, 3, 3, 0]])
    offsets, lengths = kernels.segment_metadata(ids, 2)
    np.testing.assert_array_equal(lengths, [[2, 1]])
    np.testing.assert_array_equal(offsets, [[0, 2]])
    with pytest.raises(ValueError, match="max_segments=0"):
        kernels.segment_metadata(ids, 0)
    with pytest.raises(ValueError, match="segment_ids.shape"):
        kernels.segment_metadata(ids[0], 2)


@jax.jit
def _tpu(x, logits, targets, offsets, lengths):
    seg = dict(impl="pallas_tpu", interpret=INTERPRET, block_sizes=SEG_BLOCKS)
    ce = kernels.segment_cross_entropy(logits, targets, offsets, lengths, impl="pallas_tpu",
                                       interpret=INTERPRET, block_sizes=CE_BLOCKS)
    return (kernels.segment_sum(x, offsets, lengths, **seg),
            kernels.segment_max(x, offsets, lengths, **seg), ce[1])


@jax.jit
def _ref(x, logits, targets, offsets, lengths):
    ce = reference.segment_cross_entropy(logits, targets, offsets, lengths)
    return (reference.segment_sum(x, offsets, lengths), reference.segment_max(x, offsets, lengths),
            ce[1])


@pytest.mark.parametrize("name", ["mixed", "empty_row"])
def test_tpu_kernels_ignore_empty_slots_at_offset_zero(name):
    """Unused slots at offset 0 (cu_seqlens-style) once hid the whole row from the TPU kernels."""
    offsets, lengths = zero_padded(*case(name))
    rng = np.random.default_rng(0)
    x = random_array(rng, (B, L, D), jnp.float32)
    logits = random_array(rng, (B, L, 300), jnp.float32, 3.0)
    targets = rng.integers(0, 300, size=(B, L)).astype(np.int32)
    got = run(_tpu, x, logits, targets, offsets, lengths)
    want = run(_ref, x, logits, targets, offsets, lengths)
    for g, w in zip(got, want):
        assert_close(g, w, jnp.float32)


def test_grain_style_rows_through_every_kernel():
    """Rows given as segment ids only: segment_metadata, then the kernels match the reference."""
    rng = np.random.default_rng(1)
    ids = np.zeros((B, L), np.int32)
    ids[0, :40], ids[0, 40:70], ids[0, 80:99] = 1, 2, 3
    ids[1, :100] = 1
    offsets, lengths = kernels.segment_metadata(ids, S)
    x = random_array(rng, (B, L, D), jnp.float32)
    logits = random_array(rng, (B, L, 300), jnp.float32, 3.0)
    targets = rng.integers(0, 300, size=(B, L)).astype(np.int32)
    for g, w in zip(run(_tpu, x, logits, targets, offsets, lengths),
                    run(_ref, x, logits, targets, offsets, lengths)):
        assert_close(g, w, jnp.float32)
    np.testing.assert_array_equal(np.asarray(lengths), [[40, 30, 19, 0], [100, 0, 0, 0]])
