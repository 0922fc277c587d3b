"""Input checks of the kernels: validate_segments (values), static shape/dtype/SMEM checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqpack import kernels
from seqpack.kernels import CrossEntropyBlockSizes, GatherBlockSizes, SegmentBlockSizes
from tests.helpers.kernels import CASES, L, case


@pytest.mark.parametrize("name", list(CASES))
def test_valid_cases_pass(name):
    kernels.validate_segments(*case(name), seq_len=L)


def test_rows_for_a_ring_of_c_ranks_need_offsets_of_multiples_of_2c():
    offsets, lengths = np.array([[0, 4, 12, 16]]), np.array([[3, 8, 2, 0]])  # unused at 16
    kernels.validate_segments(offsets, lengths, seq_len=16, context_parallel=2)
    with pytest.raises(ValueError, match=r"segment_offsets\[0, 1\]=4 is not a multiple of "
                                         r"2 x context_parallel = 8"):
        kernels.validate_segments(offsets, lengths, seq_len=16, context_parallel=4)


def test_one_row_and_jax_arrays_pass():
    kernels.validate_segments(np.array([0, 5, 9, 9]), np.array([5, 4, 0, 0]), seq_len=12)
    kernels.validate_segments(jnp.array([[0, 5]]), jnp.array([[5, 7]]), seq_len=12)


@pytest.mark.parametrize(
    "offsets, lengths, match",
    [
        ([0, 5, 9], [5, -1, 0], r"segment_lengths\[0, 1\]=-1 must be >= 0"),
        ([0, 5, 13], [5, 4, 0], r"segment_offsets\[0, 2\]=13 must be in \[0, seq_len=12\]"),
        ([-1, 5, 9], [5, 4, 0], r"segment_offsets\[0, 0\]=-1"),
        ([0, 5, 9], [5, 4, 4], r"segment end \(offset \+ length\)\[0, 2\]=13 must be <= seq_len"),
        ([0, 4, 9], [5, 4, 0], r"row 0: slot 0 \[0, 5\) then slot 1 at offset 4: .*not overlap"),
        ([0, 9, 5], [5, 0, 0], r"row 0: slot 1 .* non-decreasing"),
    ],
)
def test_bad_values_name_the_slot(offsets, lengths, match):
    with pytest.raises(ValueError, match=match):
        kernels.validate_segments(np.array([offsets]), np.array([lengths]), seq_len=12)


def test_validate_rejects_traced_and_mismatched():
    with pytest.raises(ValueError, match="before jax.jit"):
        jax.jit(lambda o, n: kernels.validate_segments(o, n, seq_len=12))(
            jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2), jnp.int32))
    with pytest.raises(ValueError, match="must both be"):
        kernels.validate_segments(np.zeros((1, 2), int), np.zeros((1, 3), int), seq_len=12)
    with pytest.raises(ValueError, match="integer"):
        kernels.validate_segments(np.zeros((1, 2)), np.zeros((1, 2)), seq_len=12)


@pytest.mark.parametrize("impl", ["reference", "pallas_tpu", "pallas_gpu"])
def test_static_shape_and_dtype_errors(impl):
    x = np.zeros((2, L, 8), np.float32)
    offsets, lengths = case("mixed")
    with pytest.raises(ValueError, match=r"segment_offsets.shape=\(3, 4\) must be \[B, S\]"):
        kernels.segment_sum(x, np.zeros((3, 4), np.int32), lengths, impl=impl)
    with pytest.raises(ValueError, match="segment_lengths.shape"):
        kernels.segment_mean(x, offsets, lengths[:, :2], impl=impl)
    with pytest.raises(ValueError, match="segment_offsets.dtype"):
        kernels.segment_max(x, offsets.astype(np.float32), lengths, impl=impl)
    with pytest.raises(ValueError, match=r"x.dtype=int32 must be one of"):
        kernels.segment_gather(x.astype(np.int32), offsets, lengths, impl=impl)
    with pytest.raises(ValueError, match=r"x.shape=\(2, 100, 8, 1\) must be"):
        kernels.segment_sum(x[..., None], offsets, lengths, impl=impl)
    with pytest.raises(ValueError, match="impl='fast' is not known"):
        kernels.segment_sum(x, offsets, lengths, impl="fast")
    with pytest.raises(ValueError, match="values.shape"):
        kernels.segment_broadcast(x[:, :3], offsets, lengths, seq_len=L, impl=impl)


def test_smem_budget_says_how_to_chunk():
    x = jax.ShapeDtypeStruct((4096, 64), jnp.float32)
    meta = jax.ShapeDtypeStruct((4096, 64), jnp.int32)
    with pytest.raises(ValueError, match=r"call the kernel on chunks of at most 508 rows"):
        jax.eval_shape(lambda x, o, n: kernels.segment_sum(x, o, n, impl="pallas_tpu"),
                       x, meta, meta)
    # The reference has no SMEM limit.
    out = jax.eval_shape(lambda x, o, n: kernels.segment_sum(x, o, n, impl="reference"),
                         x, meta, meta)
    assert out.shape == (4096, 64)


def test_block_size_checks():
    with pytest.raises(ValueError, match="chunk"):
        SegmentBlockSizes(chunk=8)
    with pytest.raises(ValueError, match="block_tokens"):
        SegmentBlockSizes(block_tokens=48, chunk=32)
    with pytest.raises(ValueError, match="block_features"):
        SegmentBlockSizes(block_features=100)
    with pytest.raises(ValueError, match="block_features"):
        GatherBlockSizes(block_features=0)
    with pytest.raises(ValueError, match="block_tokens"):
        CrossEntropyBlockSizes(block_tokens=24)
    with pytest.raises(ValueError, match="block_vocab"):
        CrossEntropyBlockSizes(block_vocab=1000)
