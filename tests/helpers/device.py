"""The device suite's shared parts (tests/test_device*.py, `pytest -m device`): the compiled
kernels on the attached accelerator (TPU or GPU) against the pure-jnp references, at realistic
sizes. Skipped when `jax.default_backend()` is the
CPU; `SEQPACK_DEVICE_TESTS_ON_CPU=1` runs the same cases there instead, the TPU kernels in Pallas
interpret mode at reduced sizes (a check of the suite's logic, not of a chip).

Imports jax, numpy, pytest and seqpack.kernels only: the chip's machine has no grain or pyarrow.
One process holds the chip: no subprocesses. Cases share shapes (compiles dominate the run).

Rows: two metadata sets of three rows each, packed segments of varied lengths with gaps, empty
slots (one between used slots) and padding; "wide" holds a segment over more key blocks than the
TPU attention's narrow grid (so its full grid runs), a segment ending at L and an empty row;
"narrow" only segments whose block ranges fit the narrow grid (the `lax.cond`'s other branch),
most longer than a block. Padding holds NaN in every input the kernels read: it must reach
nothing (outputs and gradients finite, equal to the run with finite padding, 0 on padding).

Tolerances (rtol, atol; atol for gradients is a fraction of max |reference gradient|), against
references computed in f32 at `jax.default_matmul_precision("highest")`. Inputs (f32 too) hold
bf16-representable values, so the first matmul (q k^T, hidden @ weight) is exact at any MXU
precision; what is left is bf16 rounding (2^-9 relative) of the second matmuls' operands (f32 at
the MXU's default precision; in bf16 the probabilities and score gradients cast before `p @ v`,
`ds @ k`, as in every flash kernel) and of bf16 outputs:
- attention values and gradients, the loss head's gradients: ~2e-3 relative per element,
  averaged over many products; f32 2e-2, bf16 3e-2 leave a margin of several times the worst
  case over 10^7 elements, while a masking or schedule error (a block missed, a neighbour
  attended) is of the order of the values in short segments.
- the loss head's values: exact logits, f32 math in another order: 1e-3 relative, below the
  ~3e-3 of a dropped partial vocabulary block (V = 10,007).
- no matmul (segment cross-entropy, sum / mean / max / gather / broadcast): the same f32 math in
  another order: f32 1e-4 relative (1e-5 of the largest value absolute), bf16 one ulp (2^-8) of
  the final cast: 1e-2 relative, 1e-3 of the largest absolute.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from seqpack import kernels
from seqpack.kernels import reference

BACKEND = jax.default_backend()
ON_ACCELERATOR = BACKEND in ("tpu", "gpu")
ON_CPU = not ON_ACCELERATOR and os.environ.get("SEQPACK_DEVICE_TESTS_ON_CPU") == "1"

DEVICE = [  # each module's pytestmark
    pytest.mark.device,
    pytest.mark.skipif(
        not (ON_ACCELERATOR or ON_CPU),
        reason=f"no accelerator: jax.default_backend() is {BACKEND!r} (the device suite runs the "
               "compiled kernels on a TPU or GPU; SEQPACK_DEVICE_TESTS_ON_CPU=1 runs it on the CPU "
               "in Pallas interpret mode)"),
]


@dataclasses.dataclass(frozen=True)
class Sizes:
    seq_len: int  # L
    block: int  # the TPU attention's block (the rows are laid out in its units)
    narrow: int  # its narrow grid's steps (even; L = 2 * narrow * block)
    gqa: tuple[int, int]  # (H, K)
    mha: tuple[int, int]
    dim: int  # attention head dim
    hidden: int  # the loss head's hidden size
    vocab: int  # odd: not a multiple of 128
    features: int  # segment ops' D


ROWS = 3
SLOTS = 8
if ON_CPU:
    SIZES = Sizes(seq_len=512, block=128, narrow=2, gqa=(4, 1), mha=(2, 2), dim=128, hidden=128,
                  vocab=300, features=128)
else:  # the default blocks (512, AttentionBlockSizes), narrow grids of 4 steps: 8 blocks a row
    SIZES = Sizes(seq_len=4096, block=512, narrow=4, gqa=(8, 2), mha=(8, 8), dim=128,
                  hidden=1024, vocab=10_007, features=512)

# TPU semantics on CPU: uninitialized memory is NaN, out-of-bounds reads raise, "parallel" grid
# axes run in a shuffled order.
INTERPRET = pltpu.InterpretParams(random_seed=7, uninitialized_memory="nan",
                                  out_of_bounds_reads="raise")
F32, BF16 = "float32", "bfloat16"
HIGHEST = functools.partial(jax.default_matmul_precision, "highest")
# (rtol, atol) per the module docstring; atol of gradients times max |reference gradient|.
MATMUL = {F32: (2e-2, 2e-2), BF16: (3e-2, 3e-2)}
HEAD_VALUES = (1e-3, 1e-3)
ELEMENTWISE = {F32: (1e-4, 1e-5), BF16: (1e-2, 1e-3)}


def options(tpu_blocks=None, **cpu_only):
    """Keyword options of a kernel call: the backend's compiled kernels (default block sizes
    unless `tpu_blocks` on a TPU), or on the CPU the TPU kernels interpreted at `cpu_only`."""
    if ON_CPU:
        return dict(impl="pallas_tpu", interpret=INTERPRET, **cpu_only)
    blocks = {} if BACKEND != "tpu" or tpu_blocks is None else {"block_sizes": tpu_blocks}
    return dict(impl="pallas", **blocks)


# --- rows ------------------------------------------------------------------------------------


def _metadata(rows):
    """Per row [(gap before, length)] (length None: to L) -> offsets, lengths i32[ROWS, SLOTS];
    unused slots at the row's used length (the packer's contract)."""
    offsets = np.zeros((len(rows), SLOTS), np.int32)
    lengths = np.zeros((len(rows), SLOTS), np.int32)
    for r, row in enumerate(rows):
        pos = 0
        for j, (gap, n) in enumerate(row):
            pos += gap
            n = SIZES.seq_len - pos if n is None else n
            offsets[r, j], lengths[r, j] = pos, n
            pos += n
        offsets[r, len(row):] = pos
    kernels.validate_segments(offsets, lengths, seq_len=SIZES.seq_len)
    return offsets, lengths


@functools.cache
def metadata_sets():
    b, n = SIZES.block, SIZES.narrow
    long = n * b + 37  # over n + 1 key blocks: its last query blocks' ranges need the full grid
    wide = [[(0, long), (5, 1), (0, b // 2 + 3), (11, b + 1)],
            [(0, 1), (0, 17), (3, b + 40), (0, 0), (0, 2 * b - 5), (7, 3), (0, None)],
            []]
    # No segment crosses a multiple of w = n / 2 blocks, so every query block's range (causal
    # or not) lies in one window of n / 2 blocks: the narrow grid holds them all.
    w = n // 2 * b
    assert SIZES.seq_len == 4 * w
    narrow = [[(0, w - 1), (3, 2), (1, w - 9), (w + 4, 7), (0, None)],
              [(3, w - 3), (0, 0), (1, 1), (w - 2, w)],
              [(0, w), (0, w), (0, w // 2)]]
    return {"wide": _metadata(wide), "narrow": _metadata(narrow)}


def padding_of(offsets, lengths):  # bool[B, L]: tokens outside every segment
    return np.asarray(reference.segment_index(offsets, lengths, SIZES.seq_len)) == SLOTS


def normal(rng, shape, dtype, scale=1.0):
    """N(0, scale^2) values that bf16 holds exactly, in `dtype`: a first matmul (scores, logits)
    is then exact at any MXU precision, on the chip as in the reference."""
    x = rng.standard_normal(shape, np.float32) * scale
    return x.astype(jnp.bfloat16).astype(jnp.dtype(dtype))


def with_nan(x, where):  # x with NaN at `where` (broadcast over trailing axes)
    where = where.reshape(where.shape + (1,) * (x.ndim - where.ndim))
    return np.where(where, np.nan, x).astype(x.dtype)


def fetch(f, *args):
    """f(*args), waited for, as numpy (f32 for comparisons)."""
    return jax.tree.map(np.asarray, jax.block_until_ready(f(*args)))


def assert_close(name, got, want, rtol, atol):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert np.isfinite(got).all(), f"{name}: not finite"
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=name)


def assert_grad_close(name, got, want, rtol, atol):
    scale = float(np.abs(np.asarray(want, np.float32)).max(initial=0.0))
    assert_close(name, got, want, rtol, atol * scale)


def assert_same(name, got, want):
    """Exactly the run with finite padding (NaN in padding reaches nothing)."""
    for a, b, what in zip(got, want, name.split(",")):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                      err_msg=f"{what}: NaN in padding changed it")


