"""Context-parallel segment attention: the layout's jnp twin agrees with the packer's, each
ring step's key bounds are exactly the keys a query may see, and under shard_map (8 host
devices, in a process of their own: tests/helpers/cp_cases.py) the ring equals the unsharded
attention in values and gradients for C = 2, 4, 8, with the kernels computing exactly their
schedule and skipping the steps with no pair."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack import kernels, packer
from seqpack.kernels import context_parallel as cp
from seqpack.kernels import reference
from seqpack.kernels.attention_schedule import NO_SEGMENT
from tests.helpers.kernels import host_device_cases

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _rows(C: int, L: int, lengths: list[int], S: int = 6):
    config = packer.PackConfig(L, max_segments=S, overflow="split", context_parallel=C)
    rows = packer.pack([np.arange(n) for n in lengths], config)
    return rows["tokens_segment_offsets"], rows["tokens_segment_lengths"]


_order = jax.jit(cp.context_parallel_order,
                 static_argnames=("seq_len", "context_parallel", "layout"))


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(st.sampled_from([1, 2, 3, 4, 8]), st.lists(st.integers(1, 70), min_size=1, max_size=12),
       st.sampled_from(["te", "rotated"]))
def test_the_jnp_layout_is_the_packers(C, lengths, layout):
    offsets, lengths_ = _rows(C, 16 * C, lengths)
    pad = ((0, 64 - offsets.shape[0]), (0, 0))  # 64 rows: one compiled shape per C
    offsets, lengths_ = np.pad(offsets, pad), np.pad(lengths_, pad)
    want = packer.context_parallel_order(offsets, lengths_, seq_len=16 * C, context_parallel=C,
                                         layout=layout)
    got = _order(offsets, lengths_, seq_len=16 * C, context_parallel=C, layout=layout)
    np.testing.assert_array_equal(np.asarray(got), want)


def _rank_rows(offsets, lengths, rank, L, C, layout):
    pos = cp.rank_positions(offsets, lengths, rank, seq_len=L, context_parallel=C, layout=layout)
    return cp.rows_at(offsets, lengths, pos, seq_len=L)


@pytest.mark.parametrize("layout", ["te", "rotated"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("C", [2, 4])
def test_key_bounds_are_the_keys_a_query_may_see(C, causal, layout):
    L = 24 * C
    offsets, lengths = _rows(C, L, [1, 5, 2 * C, 3 * C + 1, 7, 2, 11, 30])
    ids = np.asarray(reference.segment_index(offsets, lengths, L))
    S = offsets.shape[1]
    for r in range(C):
        q = _rank_rows(offsets, lengths, r, L, C, layout)
        for rk in range(C):
            k = _rank_rows(offsets, lengths, rk, L, C, layout)
            a, b = (np.asarray(x) for x in cp.key_bounds(q, k.pos, causal=causal))
            qp, kp = np.asarray(q.pos), np.asarray(k.pos)
            for row in range(offsets.shape[0]):
                qid, kid = ids[row, qp[row]], ids[row, kp[row]]
                may = (qid[:, None] == kid[None, :]) & (qid[:, None] < S)
                if causal:
                    may &= kp[row][None, :] <= qp[row][:, None]
                c = np.arange(kp.shape[1])[None, :]
                inside = (c >= a[row][:, None]) & (c < b[row][:, None])
                np.testing.assert_array_equal(inside, may, err_msg=f"{r} {rk} {row}")
                assert ((a[row] == NO_SEGMENT) == ~may.any(axis=1)).all()


def _cases(*names: str, timeout: int = 900) -> None:
    host_device_cases("tests.helpers.cp_cases", *names, timeout=timeout)


@pytest.mark.slow
def test_ring_equals_the_unsharded_attention():
    """f32, C = 2: the jnp reference ring and the Triton kernels (interpret mode); rows of one
    segment over all ranks, many short ones, an empty row, padding inside spans, grouped
    query heads, NaN outside segments."""
    _cases("reference:2", "gpu:2")


@pytest.mark.slow
def test_ring_equals_the_unsharded_attention_in_other_layouts():
    """The rotated and balanced layouts (the latter's positions passed in, travelling round the
    ring with K / V)."""
    _cases("reference:2:rotated", "gpu:2:balanced")


@pytest.mark.slow
def test_tpu_ring_equals_the_unsharded_attention():
    _cases("tpu:2", "reference:2:bf16", "gpu:2:bf16", "tpu:2:bf16")


@pytest.mark.slow
@pytest.mark.parametrize("C", [4, 8])
def test_ring_equals_the_unsharded_attention_on_more_ranks(C):
    """The TPU interpreter runs at C <= 4 only: with 8 device threads on a 2-core machine its
    callbacks, which convert arrays while every device waits at its barrier, starve the CPU
    client's threads (a hang, not a failure of the kernels)."""
    tpu = [f"tpu:{C}"] if C <= 4 else []
    _cases(f"reference:{C}", f"gpu:{C}", *tpu, f"reference:{C}:bf16", f"gpu:{C}:bf16",
           f"gpu:{C}:rotated", f"reference:{C}:balanced", f"gpu:{C}:balanced")


@pytest.mark.slow
def test_the_ring_lowers_for_tpu_and_cuda():
    """The ring's kernels lower for TPU (Mosaic) and CUDA (Triton)."""
    _cases("lower:tpu", "lower:cuda")


@pytest.mark.slow
def test_kernels_compute_their_schedule_and_skip_empty_steps():
    """Each ring step's kernels count (inside the kernel) exactly the schedule's block pairs,
    which cover every pair a query may see; steps without any pair run no kernel."""
    _cases("visits:gpu:2", "visits:tpu:2", "visits:gpu:4")


@pytest.mark.slow
def test_tiny_lm_over_two_devices_equals_one_by_one():
    """examples/tiny_lm.py with context_parallel=2 (the reference ring on CPU; the TPU
    kernels interpreted): per-document losses, the loss and the gradients of the documents
    trained one by one, for both normalizations; and the training script's --context-parallel
    2 trains (SFT labels through the layout)."""
    _cases("tinylm:2:tokens", "tinylm:2:segments", "tinylm:2:tokens:tpu", "train:2")


def test_context_parallel_input_checks():
    q = jnp.zeros((1, 8, 2, 32))
    meta = jnp.zeros((1, 2), jnp.int32)
    with pytest.raises(ValueError, match="context_parallel_axis='cp' is not an axis here"):
        kernels.segment_attention(q, q, q, meta, meta, context_parallel_axis="cp")
    with pytest.raises(ValueError, match="context_parallel_layout='thd' must be one of"):
        kernels.segment_attention(q, q, q, meta, meta, context_parallel_axis="cp",
                                  context_parallel_layout="thd")
    with pytest.raises(ValueError, match="'balanced' is not computed on device: pass"):
        kernels.segment_attention(q, q, q, meta, meta, context_parallel_axis="cp",
                                  context_parallel_layout="balanced")
    with pytest.raises(ValueError, match=r"context_parallel_positions: int32\[1, 4\] must be"):
        kernels.segment_attention(q, q, q, meta, meta, context_parallel_axis="cp",
                                  context_parallel_positions=jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="context_parallel_positions is for a call with"):
        kernels.segment_attention(q, q, q, meta, meta,
                                  context_parallel_positions=jnp.zeros((1, 8), jnp.int32))
