"""Device suite: segment attention, compiled, against the f32 reference (the rows, sizes and
tolerances: tests/helpers/device.py)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqpack import kernels
from seqpack.kernels import reference
from tests.helpers.device import (
    BACKEND,
    BF16,
    DEVICE,
    F32,
    HIGHEST,
    MATMUL,
    ROWS,
    SIZES,
    assert_close,
    assert_grad_close,
    assert_same,
    fetch,
    metadata_sets,
    normal,
    options,
    padding_of,
    with_nan,
)

pytestmark = DEVICE


# --- attention -------------------------------------------------------------------------------


@functools.cache
def _attention(causal: bool, layout: str, extra: tuple = ()):
    """On a TPU the default block sizes, with the rows' narrow grid (so both grids run);
    `extra`: more (name, value) pairs of AttentionBlockSizes."""
    cpu_blocks = kernels.AttentionBlockSizes(128, 128, 128, 128, narrow_steps=SIZES.narrow,
                                             **dict(extra))
    tpu_blocks = kernels.AttentionBlockSizes(narrow_steps=SIZES.narrow, **dict(extra))
    kw = options(tpu_blocks, block_sizes=cpu_blocks)

    def f(q, k, v, offsets, lengths, g):
        o, vjp = jax.vjp(lambda q, k, v: kernels.segment_attention(
            q, k, v, offsets, lengths, causal=causal, layout=layout, **kw), q, k, v)
        return (o, *vjp(g))

    return jax.jit(f)


@functools.cache
def _attention_reference(causal: bool):
    def f(q, k, v, offsets, lengths, g):
        o, vjp = jax.vjp(lambda q, k, v: reference.segment_attention(
            q, k, v, offsets, lengths, causal=causal), q, k, v)
        return (o, *vjp(g))

    return jax.jit(f)


def _attention_want(q, k, v, offsets, lengths, g, causal):
    """The f32 reference at the highest precision, a row at a time (its [B, H, L, L] scores)."""
    f = _attention_reference(causal)
    rows = []
    with HIGHEST():
        for r in range(q.shape[0]):
            one = (x[r : r + 1].astype(np.float32) for x in (q, k, v))
            rows.append(fetch(f, *one, offsets[r : r + 1], lengths[r : r + 1],
                              g[r : r + 1].astype(np.float32)))
    return [np.concatenate(parts) for parts in zip(*rows)]


def _heads_second(x):
    return np.swapaxes(x, 1, 2)


ATTENTION_CASES = [  # (heads, causal, dtype, layout); "unfused": blhd with the dq kernel apart
    ("gqa", True, F32, "blhd"),
    ("gqa", True, BF16, "blhd"),
    ("gqa", False, F32, "blhd"),
    ("gqa", False, BF16, "blhd"),
    ("mha", True, BF16, "blhd"),
    ("mha", False, F32, "blhd"),
    ("gqa", True, BF16, "bhld"),
    ("gqa", False, F32, "bhld"),
    ("gqa", True, BF16, "unfused"),  # AttentionBlockSizes(fused_bwd=False): dq's own kernel
    ("mha", False, F32, "unfused"),
]
OPTIONS = {"unfused": (("fused_bwd", False),)}


def _id(case):
    heads, causal, dtype, layout = case
    return f"{heads}-{'causal' if causal else 'full'}-{dtype[0]}{dtype[-2:]}-{layout}"


@pytest.mark.parametrize("heads,causal,dtype,layout", ATTENTION_CASES,
                         ids=[_id(c) for c in ATTENTION_CASES])
def test_segment_attention(heads, causal, dtype, layout):
    """Values and dq / dk / dv vs the f32 reference on both metadata sets; padding output and
    gradients exactly 0; NaN in the padding of q, k and v changes nothing."""
    if layout in OPTIONS and BACKEND == "gpu":
        pytest.skip("fused_bwd: an option of the TPU kernels (AttentionBlockSizes)")
    f = _attention(causal, "bhld" if layout == "bhld" else "blhd", OPTIONS.get(layout, ()))
    _check_attention(f, heads, causal, dtype, SIZES.dim, layout == "bhld")


GPU_CASES = [(heads, causal, dim) for heads in ("gqa", "mha") for causal in (True, False)
             for dim in (64, 128)]


@functools.cache
def _gpu_attention(causal: bool, impl: str):
    def f(q, k, v, offsets, lengths, g):
        o, vjp = jax.vjp(lambda q, k, v: kernels.segment_attention(
            q, k, v, offsets, lengths, causal=causal, impl=impl), q, k, v)
        return (o, *vjp(g))

    return jax.jit(f)


@pytest.mark.skipif(BACKEND != "gpu", reason="the GPU's families: Triton and cuDNN")
@pytest.mark.parametrize("impl", ["pallas_gpu", "cudnn"])
@pytest.mark.parametrize("heads,causal,dim", GPU_CASES,
                         ids=[f"{h}-{'causal' if c else 'full'}-d{d}" for h, c, d in GPU_CASES])
def test_gpu_attention_families(impl, heads, causal, dim):
    """Each GPU family at head dims 64 and 128, bf16, as test_segment_attention checks it. cuDNN
    under GQA runs only where jax's key offsets follow the key's heads (kernels/gpu/cudnn.py);
    elsewhere it must be refused, never run."""
    from seqpack.kernels.gpu import cudnn

    if impl == "cudnn" and cudnn.requires():
        pytest.fail(f"cuDNN's packed attention cannot run on this GPU: {cudnn.requires()}")
    if impl == "cudnn" and heads == "gqa" and not cudnn.kv_offsets_follow_key_heads():
        h, kv = SIZES.gqa
        q = jnp.zeros((1, SIZES.seq_len, h, dim), jnp.bfloat16)
        k = jnp.zeros((1, SIZES.seq_len, kv, dim), jnp.bfloat16)
        offsets, lengths = (x[:1] for x in metadata_sets()["wide"])
        with pytest.raises(ValueError, match="wrong tokens under grouped-query attention"):
            kernels.segment_attention(q, k, k, offsets, lengths, impl="cudnn")
        return
    _check_attention(_gpu_attention(causal, impl), heads, causal, BF16, dim, False)


def _check_attention(f, heads, causal, dtype, dim, heads_second: bool):
    h, kv = getattr(SIZES, heads)
    rng = np.random.default_rng(len(ATTENTION_CASES) * h + kv + causal)
    shape = (ROWS, SIZES.seq_len)
    q = normal(rng, (*shape, h, dim), dtype)
    k, v = (normal(rng, (*shape, kv, dim), dtype) for _ in range(2))
    g = normal(rng, q.shape, dtype)
    swap = _heads_second if heads_second else (lambda x: x)
    rtol, atol = MATMUL[dtype]
    names = ("o", "dq", "dk", "dv")
    for which, (offsets, lengths) in metadata_sets().items():
        pad = padding_of(offsets, lengths)
        got = [swap(x) for x in fetch(f, *map(swap, (q, k, v)), offsets, lengths, swap(g))]
        want = _attention_want(q, k, v, offsets, lengths, g, causal)
        for i, (name, a, b) in enumerate(zip(names, got, want)):
            name = f"{which} {name}"
            assert a.dtype == jnp.dtype(dtype), name
            (assert_grad_close if i else assert_close)(name, a, b, rtol, atol)
            assert not np.asarray(a, np.float32)[pad].any(), f"{name}: nonzero on padding"
        nan = [swap(x) for x in fetch(f, *(swap(with_nan(x, pad)) for x in (q, k, v)), offsets,
                                      lengths, swap(g))]
        assert_same(",".join(f"{which} {n}" for n in names), nan, got)
