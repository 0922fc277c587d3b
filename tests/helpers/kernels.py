"""Kernel test helpers: packed-row metadata builders, tolerances, TPU and CUDA lowering."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from seqpack.kernels import (
    CrossEntropyBlockSizes,
    GatherBlockSizes,
    GpuBlockSizes,
    SegmentBlockSizes,
)

# Pallas interpret mode runs the kernel body in io_callbacks that themselves dispatch jax ops. With
# async CPU dispatch, a computation queued behind a running interpreted kernel (e.g. a cast of its
# output) can hold the CPU client's worker threads while the callback waits for one: a deadlock
# seen on 2-core machines. Running CPU computations inline avoids it. This only takes effect if the
# CPU client is not created yet, so the tests also run each check as one jitted computation and
# block on its result before dispatching the next (see `run`).
jax.config.update("jax_cpu_enable_async_dispatch", False)

# TPU semantics on CPU: uninitialized memory is NaN, out-of-bounds reads raise, and the "parallel"
# grid axes are visited in a shuffled order (seeded).
INTERPRET = pltpu.InterpretParams(
    random_seed=7, uninitialized_memory="nan", out_of_bounds_reads="raise"
)
# Small blocks so that L = 100 spans several token blocks, the last one partial.
SEG_BLOCKS = SegmentBlockSizes(block_tokens=32, block_features=128, chunk=16)
GATHER_BLOCKS = GatherBlockSizes(block_features=128)
CE_BLOCKS = CrossEntropyBlockSizes(block_tokens=32, block_vocab=128)

# (dtype, what) -> (rtol, atol); for gradients atol is a fraction of the largest |gradient|.
# Kernels and references both accumulate in f32 and cast at the end; only the summation order
# differs, so f32 agrees to rounding and bf16 to about one ulp (2^-8 relative) of the final cast.
TOLERANCES = {
    ("float32", "value"): (1e-5, 1e-5),
    ("float32", "grad"): (1e-5, 1e-6),
    ("bfloat16", "value"): (1e-2, 1e-2),
    ("bfloat16", "grad"): (1e-2, 1e-2),
}

B, L, S, D = 2, 100, 4, 128


def run(f, *args):
    """f(*args) as one jitted computation, waited for, returned as numpy (no further dispatch).

    Pass a function built once (module level or `functools.cache`): jit caches by identity, and
    recompiling an interpreted kernel costs about a second.
    """
    f = f if hasattr(f, "lower") else jax.jit(f)
    return jax.tree.map(np.asarray, jax.block_until_ready(f(*args)))


def value_and_vjp(f):
    """(x, *rest, g) -> (f(x, *rest), g^T df/dx), jitted."""

    def both(x, *rest):
        *rest, g = rest
        out, vjp = jax.vjp(lambda x: f(x, *rest), x)
        return out, vjp(g)[0]

    return jax.jit(both)


def check_vjp_pair(kernel, ref, x, offsets, lengths, g, dtype):
    """Runs two `value_and_vjp` functions (a kernel, its reference) on the same arguments:
    equal shapes, `dtype` values and gradients within tolerance; returns the kernel's value."""
    out, dx = run(kernel, x, offsets, lengths, g)
    want, dx_want = run(ref, x, offsets, lengths, g)
    assert out.shape == want.shape and out.dtype == dtype and dx.dtype == dtype
    assert_close(out, want, dtype)
    assert_close(dx, dx_want, dtype, "grad")
    return out


def assert_close(actual, expected, dtype, what: str = "value") -> None:
    """allclose with the TOLERANCES entry; for "grad" atol is relative to max |expected|."""
    rtol, atol = TOLERANCES[(jnp.dtype(dtype).name, what)]
    if what == "grad":
        atol *= float(np.abs(np.asarray(expected, np.float32)).max(initial=0.0))
    np.testing.assert_allclose(
        np.asarray(actual).astype(np.float32),
        np.asarray(expected).astype(np.float32),
        rtol=rtol,
        atol=atol,
    )


def metadata(rows: list[list[tuple[int, int]]], num_segments: int):
    """Per-row lists of (offset, length) -> offsets, lengths i32[B, S] (unused: used length, 0)."""
    offsets = np.zeros((len(rows), num_segments), np.int32)
    lengths = np.zeros((len(rows), num_segments), np.int32)
    for r, segments in enumerate(rows):
        used = segments[-1][0] + segments[-1][1] if segments else 0
        offsets[r] = used
        for j, (offset, length) in enumerate(segments):
            offsets[r, j], lengths[r, j] = offset, length
    return offsets, lengths


def random_rows(rng, batch, seq_len, num_segments, *, alignment=1):
    """Random valid packed rows: 0..S segments of >= 1 token, each start a multiple of alignment."""
    rows = []
    for _ in range(batch):
        segments, pos = [], 0
        for _ in range(int(rng.integers(0, num_segments + 1))):
            start = -(-pos // alignment) * alignment
            if start >= seq_len:
                break
            length = int(rng.integers(1, seq_len - start + 1))
            length = min(length, int(rng.integers(1, 2 * seq_len // num_segments + 2)))
            segments.append((start, length))
            pos = start + length
        rows.append(segments)
    return metadata(rows, num_segments)


# Named metadata cases for B=2, L=100, S=4 (L is not a multiple of the 32-token test block).
CASES = {
    "mixed": [[(0, 10), (10, 25), (40, 50), (90, 10)], [(0, 60), (64, 36)]],
    "empty_row": [[], [(0, 7), (7, 1), (8, 33)]],
    "ends_at_L": [[(0, 30), (30, 70)], [(5, 95)]],
    "fills_row": [[(0, 100)], [(0, 100)]],
    "aligned_16": [[(0, 10), (16, 20), (48, 5), (64, 36)], [(0, 17), (32, 1), (48, 40)]],
    "single_tokens": [[(0, 1), (1, 1), (2, 1), (99, 1)], [(31, 1), (32, 1), (63, 2)]],
}


def case(name: str):
    return metadata(CASES[name], S)


def random_array(rng, shape, dtype, scale: float = 1.0) -> np.ndarray:
    return (rng.normal(size=shape) * scale).astype(np.float32).astype(jnp.dtype(dtype))


def lower_tpu(f, *args):
    """Lowers f for TPU (Pallas -> Mosaic, block-shape rules checked) without a TPU attached."""
    return jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",))

# bfloat16 repeats every float32 case at several seconds each: run with the slow cases.
BF16_SLOW = pytest.param(jnp.bfloat16, marks=pytest.mark.slow, id="bfloat16")


# GPU (Triton) kernels: small power-of-two tiles so that L = 100 spans several blocks, D = 128 two
# lane blocks and V = 300 three vocabulary tiles, the last of each partial; three programs per
# segment in the reduce kernel (tiles 0, 3, ... / 1, 4, ... / 2, 5, ...; some get none).
GPU_BLOCKS = GpuBlockSizes(block_tokens=16, block_features=64, ce_block_tokens=16, block_vocab=128,
                           token_splits=3)
TRITON_CALL = "xla.gpu.triton"  # the custom call a Pallas GPU kernel lowers to for CUDA


def lower_cuda(f, *args, on_module=None) -> str:
    """StableHLO text of f lowered for CUDA (Pallas -> Triton) without a GPU attached. Every
    Triton module the lowering emits must verify (benchmarks.triton_sm90.triton_modules):
    interpret mode never builds them. `on_module(name, op)` also sees each module."""
    from benchmarks.triton_sm90 import triton_modules

    def check(name, op):
        # jax 0.10's lowering of `jnp.where(scalar, n, m)` on Python numbers types n and m like
        # the predicate (i1): where that still verifies (a cast follows) the values are wrong.
        asm = op.get_asm(enable_debug_info=True, pretty_debug_info=True)
        suspect = [line.strip() for line in asm.splitlines()
                   if re.search(r"arith\.constant (true|false)\b.*select_n", line)]
        assert not suspect, f"select_n of Python numbers lowered as i1: {suspect[:3]}"
        if on_module is not None:
            on_module(name, op)

    with triton_modules(check):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def loads_under_conditionals(op, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The `tt.load`s of a Triton module that sit inside an `scf.if` inside an `scf.for` (each as
    its chain of enclosing ops): Triton's software pipeliner prefetches none of them."""
    found = []
    for region in op.regions:
        for block in region.blocks:
            for child in block.operations:
                name = child.operation.name
                loop = path.index("scf.for") if "scf.for" in path else None
                if name == "tt.load" and loop is not None and "scf.if" in path[loop:]:
                    found.append(path)
                found += loads_under_conditionals(child.operation, (*path, name))
    return found


def zero_padded(offsets, lengths):
    """The same segments with unused slots at offset 0 (cu_seqlens-style padding)."""
    return np.where(lengths > 0, offsets, 0).astype(np.int32), lengths


def host_device_cases(module: str, *names: str, timeout: int = 900) -> None:
    """`python -m <module> NAME ...` (a helper that gives jax 8 host devices before importing
    it) in a process of its own; every case must print "ok NAME"."""
    root = pathlib.Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [os.environ.get("PYTHONPATH", ""), str(root)]).strip(os.pathsep)}
    env.pop("XLA_FLAGS", None)
    done = subprocess.run([sys.executable, "-m", module, *names], cwd=root, env=env,
                          capture_output=True, text=True, timeout=timeout)
    ok = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("ok ")]
    assert done.returncode == 0 and ok == list(names), done.stdout + done.stderr[-6000:]


def key_block_pairs(lo: np.ndarray, hi: np.ndarray, num_kv_blocks: int, *, spanned: bool
                    ) -> np.ndarray:
    """Per key block kb: how many query blocks i have lo_i <= kb < hi_i (ranges [..., nq]
    -> counts [..., nk]); `spanned`: how many lie from the first such i to the last, the query
    blocks the GPU dk / dv kernel computes (those between that lack kb: masked out whole)."""
    kb = np.arange(num_kv_blocks)
    need = (lo[..., None] <= kb) & (kb < hi[..., None])  # [..., nq, nk]
    if spanned:
        idx = np.arange(need.shape[-2])[:, None]
        first = np.argmax(need, axis=-2)[..., None, :]
        last = need.shape[-2] - 1 - np.argmax(need[..., ::-1, :], axis=-2)[..., None, :]
        need = (idx >= first) & (idx <= last) & need.any(axis=-2)[..., None, :]
    return need.sum(axis=-2)
