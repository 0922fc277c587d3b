"""segment_attention: both Pallas families (interpret mode) vs the dense reference, the kernels'
own count of the block pairs they computed, lowering for TPU and CUDA, and input checks.

The batch holds the edge cases as rows (many short segments, one segment filling the row, an empty
row, gaps and a segment ending exactly at L) with L = 200, not a multiple of any block size, and
grouped-query heads (H = 2 query heads on K = 1 key/value head). Every token outside a segment
holds NaN in q, k and v: it must reach no output and no gradient.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack import kernels
from seqpack.kernels import attention, reference
from seqpack.kernels import attention_schedule as sched
from tests.helpers.kernels import (
    INTERPRET,
    TRITON_CALL,
    key_block_pairs,
    lower_cuda,
    lower_tpu,
    metadata,
    random_array,
    zero_padded,
)
from tests.test_kernels_attention_schedule import ROWS, L, S

H, K, D = 2, 1, 32
TPU = dict(impl="pallas_tpu", interpret=INTERPRET,
           block_sizes=kernels.AttentionBlockSizes(128, 128, 128, 128))
GPU = dict(impl="pallas_gpu", interpret=True,
           block_sizes=kernels.GpuAttentionBlockSizes(32, 32, 32, 32))
# (dtype) -> (rtol, atol) of values; gradients: atol times max |reference gradient|. The kernels
# cast probabilities to the input dtype for the p @ v products (as every flash kernel does).
TOL = {"float32": (2e-5, 2e-5), "bfloat16": (3e-2, 3e-2)}
F32 = jnp.float32
BF16_SLOW = pytest.param(jnp.bfloat16, marks=pytest.mark.slow, id="bfloat16")


def _inputs(dtype, *, heads=H, kv_heads=K, dim=D, rows=ROWS, seed=0, seq_len=L):
    rng = np.random.default_rng(seed)
    offsets, lengths = metadata(rows, S)
    ids = np.asarray(reference.segment_index(offsets, lengths, seq_len))
    outside = (ids == S)[:, :, None, None]

    def tensor(n):
        x = random_array(rng, (len(rows), seq_len, n, dim), F32)
        return np.where(outside, np.nan, x).astype(jnp.dtype(dtype))

    q, k, v = tensor(heads), tensor(kv_heads), tensor(kv_heads)
    g = random_array(rng, q.shape, dtype)
    return (q, k, v, offsets, lengths, g), ids == S


def _value_and_grads(q, k, v, offsets, lengths, g, *, causal, **kw):
    def f(q, k, v):
        if kw.get("impl") == "reference":
            return reference.segment_attention(q, k, v, offsets, lengths, causal=causal)
        return kernels.segment_attention(q, k, v, offsets, lengths, causal=causal, **kw)

    o, vjp = jax.vjp(f, q, k, v)
    return (o, *vjp(g))


@functools.cache
def _fn(family: str, causal: bool):
    kw = {"tpu": TPU, "gpu": GPU, "reference": dict(impl="reference")}[family]
    return jax.jit(functools.partial(_value_and_grads, causal=causal, **kw))


def _assert_matches(got, want, dtype, outside):
    rtol, atol = TOL[jnp.dtype(dtype).name]
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert a.shape == b.shape and np.isfinite(a).all(), name
        scale = 1.0 if name == "o" else float(np.abs(b).max(initial=1e-30))
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol * scale, err_msg=name)
        assert np.all(a[outside] == 0.0), name  # tokens outside every segment: 0, no gradient


def _check_family(family, dtype, causal, **shape):
    args, outside = _inputs(dtype, **shape)
    got = jax.block_until_ready(_fn(family, causal)(*args))
    want = _fn("reference", causal)(*args)
    assert got[0].dtype == dtype and got[1].dtype == dtype
    _assert_matches(got, want, dtype, outside)


@jax.jit
def _tpu_counted(q, k, v, offsets, lengths, g):
    return attention.visited_block_pairs(q, k, v, offsets, lengths, g, **TPU)


# The TPU interpreter costs ~30 ms a grid step: the fast case takes the two rows where blocks
# are skipped (short segments; gaps and a segment ending at L); the slow cases take all four.
TPU_ROWS = [ROWS[0], ROWS[3]]


def _expected_visits(out, groups, *, gpu: bool = False):
    """The counts the schedule implies: per query block hi - lo; per key block, the query blocks
    whose range holds it (times the query heads of its group); on the GPU family every query
    block from the first to the last of them (key_block_pairs), and those it adds are blocks of
    no segment (lo = hi), whose pairs are masked out whole."""
    lo, hi = np.asarray(out["lo"]), np.asarray(out["hi"])
    lo_b, hi_b = np.asarray(out["lo_bwd"]), np.asarray(out["hi_bwd"])
    nk = out["visits_dkv"].shape[2]
    per_key = key_block_pairs(lo_b, hi_b, nk, spanned=gpu)
    if gpu:
        empty = (lo_b == hi_b).sum(axis=1)[:, None]  # per row: query blocks of no segment
        assert (per_key - key_block_pairs(lo_b, hi_b, nk, spanned=False) <= empty).all()
    return hi - lo, hi_b - lo_b, groups * per_key


def test_tpu_kernels_match_reference_and_compute_only_scheduled_pairs():
    """TPU family: values and gradients, and the proof of the skipping: each kernel counts (in
    the kernel, +1 per computed step) exactly the schedule's pairs, which are exactly the pairs
    some query may attend from (test_kernels_attention_schedule.py) and within the bound."""
    args, outside = _inputs(F32, rows=TPU_ROWS)
    out = jax.tree.map(np.asarray, jax.block_until_ready(_tpu_counted(*args)))
    want = _fn("reference", True)(*args)
    _assert_matches([out[n] for n in ("o", "dq", "dk", "dv")], want, F32, outside)
    fwd, dq, dkv = _expected_visits(out, H // K)
    for head in range(H):
        np.testing.assert_array_equal(out["visits_fwd"][:, head], fwd)
        np.testing.assert_array_equal(out["visits_dq"][:, head], dq)
    np.testing.assert_array_equal(out["visits_dkv"][:, 0], dkv)
    per_row = out["visits_fwd"][:, 0].sum(axis=1)
    offsets, lengths = args[3], args[4]
    need = sched.needed_pairs(offsets, lengths, seq_len=L, block=128, causal=True)
    np.testing.assert_array_equal(per_row, need.sum(axis=(1, 2)))
    assert np.all(per_row <= sched.pair_bound(offsets, lengths, block=128, causal=True))
    # Short segments: pair (1, 0) of the 3-pair triangle is skipped.
    assert per_row.tolist() == [2, 3]


@pytest.mark.slow  # over 7 s on 2 cores (the TPU family stays in the fast set): .ci/run runs it
def test_gpu_kernels_match_reference():
    _check_family("gpu", F32, True)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [F32, jnp.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("family", ["tpu", "gpu"])
def test_families_match_reference(family, causal, dtype):
    _check_family(family, dtype, causal)


@pytest.mark.slow
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(3, 3, 16), (4, 1, 128), (4, 2, 64)])
@pytest.mark.parametrize("family", ["tpu", "gpu"])
def test_head_layouts(family, heads, kv_heads, dim):
    """Multi-head, multi-query and D = 128."""
    _fn.cache_clear()
    _check_family(family, F32, True, heads=heads, kv_heads=kv_heads, dim=dim)


@pytest.mark.slow
@pytest.mark.parametrize("blocks", [
    kernels.GpuAttentionBlockSizes(16, 64, 64, 16),
    kernels.GpuAttentionBlockSizes(64, 16, 16, 32),
    kernels.AttentionBlockSizes(128, 256, 256, 128),
    kernels.AttentionBlockSizes(256, 128, 128, 256),
])
def test_unequal_block_sizes(blocks):
    """bq != bk: ranges may hold key blocks of padding only, and the dk/dv kernel's query ranges
    may hold empty query blocks (skipped by its check)."""
    gpu = isinstance(blocks, kernels.GpuAttentionBlockSizes)
    kw = dict(GPU if gpu else TPU, block_sizes=blocks)
    args, outside = _inputs(F32)
    got = jax.jit(functools.partial(_value_and_grads, causal=True, **kw))(*args)
    _assert_matches(got, _fn("reference", True)(*args), F32, outside)
    counted = attention.visited_block_pairs(*args, **kw)
    fwd, dq, dkv = _expected_visits(counted, H // K, gpu=gpu)
    np.testing.assert_array_equal(np.asarray(counted["visits_fwd"])[:, 0], fwd)
    np.testing.assert_array_equal(np.asarray(counted["visits_dq"])[:, 0], dq)
    np.testing.assert_array_equal(np.asarray(counted["visits_dkv"])[:, 0], dkv)


@pytest.mark.slow
def test_tpu_narrow_grid():
    """narrow_steps = 1: row 0's ranges all hold one block (the narrow grid runs); with row 3 (a
    range of two) the full grid runs. Same values and counts either way."""
    blocks = kernels.AttentionBlockSizes(128, 128, 128, 128, narrow_steps=1)
    for rows in ([ROWS[0]], TPU_ROWS):
        args, outside = _inputs(F32, rows=rows)
        counted = jax.tree.map(np.asarray, attention.visited_block_pairs(
            *args, **dict(TPU, block_sizes=blocks)))
        _assert_matches([counted[n] for n in ("o", "dq", "dk", "dv")],
                        _fn("reference", True)(*args), F32, outside)
        fwd, dq, dkv = _expected_visits(counted, H // K)
        np.testing.assert_array_equal(counted["visits_fwd"][:, 0], fwd)
        np.testing.assert_array_equal(counted["visits_dq"][:, 0], dq)
        np.testing.assert_array_equal(counted["visits_dkv"][:, 0], dkv)


@pytest.mark.parametrize("causal,dim,heads,kv_heads,narrow", [
    (True, 32, H, K, 8),  # grouped heads: dq block (G, L, D)
    pytest.param(False, 32, H, K, 8, marks=pytest.mark.slow),
    pytest.param(True, 128, 4, 2, 8, marks=pytest.mark.slow),
    pytest.param(True, 32, H, K, 1, marks=pytest.mark.slow),  # narrow and full grids
])
def test_tpu_fused_backward(causal, dim, heads, kv_heads, narrow):
    """fused_bwd (the default): dq formed in the dk/dv kernel (resident over the row) gives the
    reference's values and gradients, zeros outside every segment, with NaN there in q, k, v
    and in uninitialized memory. (The dq kernel apart: the visit-counting tests above.)"""
    blocks = kernels.AttentionBlockSizes(128, 128, 128, 128, fused_bwd=True,
                                         narrow_steps=narrow)
    # narrow = 1: row 0's ranges fit one step (the narrow grid runs), row 3's do not (the full)
    for rows in ([[ROWS[0]], TPU_ROWS] if narrow == 1 else [TPU_ROWS]):
        args, outside = _inputs(F32, rows=rows, dim=dim, heads=heads, kv_heads=kv_heads)
        got = jax.jit(functools.partial(_value_and_grads, causal=causal,
                                        **dict(TPU, block_sizes=blocks)))(*args)
        want = jax.jit(functools.partial(_value_and_grads, causal=causal,
                                         impl="reference"))(*args)
        _assert_matches(got, want, F32, outside)


def test_fused_backward_falls_back_where_dq_does_not_fit():
    """The fused backward runs where the group's resident dq fits its share of the core's VMEM
    (a TPU v5e's 128 MiB, a TPU v4's 16 MiB), and never when counting visits (the counter
    reports the two kernels')."""
    from seqpack.kernels.tpu import attention_bwd

    def cfg(seq_len, groups, **kw):
        return sched.AttentionConfig(seq_len, groups * 2, 2, 128, True, 1.0, 512, 512, 512, 512,
                                     False, fused_bwd=True, **kw)

    v5e, v4 = 128 << 20, 16 << 20
    assert attention_bwd.fuses(cfg(8192, 4), jnp.bfloat16, v5e)  # 4 x 128 x 8192 x (4 + 4) B
    assert attention_bwd.fuses(cfg(32768, 1), jnp.bfloat16, v5e)
    assert not attention_bwd.fuses(cfg(8192, 8), jnp.bfloat16, v5e)
    assert not attention_bwd.fuses(cfg(8192, 1), jnp.bfloat16, v4)
    assert attention_bwd.fuses(cfg(4096, 1), jnp.bfloat16, v4)
    assert not attention_bwd.fuses(cfg(1000, 1, count_visits=True), jnp.bfloat16, v5e)
    assert not attention_bwd.fuses(dataclasses.replace(cfg(1000, 1), fused_bwd=False),
                                   jnp.bfloat16, v5e)


@pytest.mark.slow
def test_gpu_counts_and_zero_offset_padding():
    """GPU family: counted pairs equal the schedule's; unused slots at offset 0 change nothing."""
    args, outside = _inputs(F32)
    offsets, lengths = zero_padded(args[3], args[4])
    counted = jax.tree.map(np.asarray, attention.visited_block_pairs(
        args[0], args[1], args[2], offsets, lengths, args[5], **GPU))
    want = _fn("reference", True)(*args)
    _assert_matches([counted[n] for n in ("o", "dq", "dk", "dv")], want, F32, outside)
    fwd, dq, dkv = _expected_visits(counted, H // K, gpu=True)
    np.testing.assert_array_equal(counted["visits_fwd"][:, 1], fwd)
    np.testing.assert_array_equal(counted["visits_dq"][:, 1], dq)
    np.testing.assert_array_equal(counted["visits_dkv"][:, 0], dkv)
    assert counted["visits_fwd"][0, 0].sum() < sched.causal_triangle(L, 32)


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), causal=st.booleans())
def test_random_rows_gpu(seed, causal):
    from tests.helpers.kernels import random_rows

    offsets, lengths = random_rows(np.random.default_rng(seed), len(ROWS), L, S, alignment=1)
    rows = [[(int(o), int(n)) for o, n in zip(offs, lens) if n > 0]
            for offs, lens in zip(offsets, lengths)]
    args, outside = _inputs(F32, rows=rows, seed=seed)
    _assert_matches(_fn("gpu", causal)(*args), _fn("reference", causal)(*args), F32, outside)


def _loss(q, k, v, offsets, lengths, **kw):
    return kernels.segment_attention(q, k, v, offsets, lengths, **kw).astype(F32).sum()


@pytest.mark.parametrize("dim,blocks,layout", [
    (128, kernels.AttentionBlockSizes(), "blhd"),  # defaults: 512, lane tiles, fused
    pytest.param(128, kernels.AttentionBlockSizes(), "bhld", marks=pytest.mark.slow),
    (64, kernels.AttentionBlockSizes(256, 256, 256, 256), "blhd"),
    pytest.param(192, kernels.AttentionBlockSizes(256, 256, 256, 256), "blhd",
                 marks=pytest.mark.slow),
    (128, kernels.AttentionBlockSizes(fused_bwd=False), "blhd"),  # forward, dq, dk/dv
])
def test_lowers_for_tpu(dim, blocks, layout):
    """Mosaic block-shape rules, forward and backward, for each operand / kernel layout.

    L = 1000: one grid per kernel; L = 8192: a narrow and a full grid per kernel wherever
    L / b > narrow_steps = 8 blocks."""
    for seq_len in (1000, 8192):
        kernels_run = (blocks.block_kv, blocks.block_kv_bwd) + (  # forward, (dq), dk/dv
            () if blocks.fused_bwd else (blocks.block_kv_bwd,))
        want = sum(2 if seq_len > 8 * b else 1 for b in kernels_run)
        q = jnp.zeros((2, seq_len, 8, dim), jnp.bfloat16)
        kv = jnp.zeros((2, seq_len, 2, dim), jnp.bfloat16)
        if layout == "bhld":
            q, kv = q.transpose(0, 2, 1, 3), kv.transpose(0, 2, 1, 3)
        meta = jnp.zeros((2, 16), jnp.int32)
        for causal in (True, False):
            grad = jax.grad(functools.partial(_loss, impl="pallas_tpu", causal=causal,
                                              block_sizes=blocks, layout=layout), (0, 1, 2))
            text = lower_tpu(grad, q, kv, kv, meta, meta).as_text()
            assert text.count("tpu_custom_call") == want


@pytest.mark.parametrize("dtype", [jnp.bfloat16, pytest.param(F32, marks=pytest.mark.slow)])
def test_lowers_for_cuda(dtype):
    q = jnp.zeros((2, 1000, 8, 128), dtype)
    kv = jnp.zeros((2, 1000, 2, 128), dtype)
    meta = jnp.zeros((2, 16), jnp.int32)
    grad = jax.grad(functools.partial(_loss, impl="pallas_gpu"), (0, 1, 2))
    text = lower_cuda(grad, q, kv, kv, meta, meta)
    assert text.count(TRITON_CALL) == 3
    for name in ("segment_attention_fwd_gpu", "segment_attention_dq_gpu",
                 "segment_attention_dkv_gpu"):
        assert f'name = "{name}"' in text, name


def test_input_checks():
    q = np.zeros((2, 8, 4, 16), np.float32)
    kv = np.zeros((2, 8, 2, 16), np.float32)
    meta = np.zeros((2, 3), np.int32)
    attend = kernels.segment_attention
    with pytest.raises(ValueError, match=r"k.shape=\(2, 8, 3, 16\) must be \[B, L, K, D\]"):
        attend(q, np.zeros((2, 8, 3, 16), np.float32), np.zeros((2, 8, 3, 16), np.float32),
               meta, meta)
    with pytest.raises(ValueError, match="in q's dtype float32"):
        attend(q, kv.astype(jnp.bfloat16), kv.astype(jnp.bfloat16), meta, meta)
    with pytest.raises(ValueError, match=r"q.shape=\(2, 8, 16\)"):
        attend(q[:, :, 0], kv, kv, meta, meta)
    with pytest.raises(ValueError, match="segment_offsets.shape"):
        attend(q, kv, kv, meta[:1], meta[:1])
    with pytest.raises(ValueError, match="pass a GpuAttentionBlockSizes"):
        attend(q, kv, kv, meta, meta, impl="pallas_gpu", interpret=True,
               block_sizes=kernels.AttentionBlockSizes())
    with pytest.raises(ValueError, match="block_kv=100 must be a positive multiple of 128"):
        kernels.AttentionBlockSizes(block_kv=100)
    with pytest.raises(ValueError, match="narrow_steps=0 must be >= 1"):
        kernels.AttentionBlockSizes(narrow_steps=0)
    with pytest.raises(ValueError, match="block_q=8 must be a power of two >= 16"):
        kernels.GpuAttentionBlockSizes(block_q=8)
    with pytest.raises(ValueError, match="counts the Pallas kernels"):
        attention.visited_block_pairs(q, kv, kv, meta, meta, impl="reference")
    out = attend(q, kv, kv, meta, meta)  # CPU, impl="auto": the reference; no segments -> 0
    assert out.shape == q.shape and not np.asarray(out).any()
