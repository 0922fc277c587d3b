"""Device suite (`pytest -m device`): the compiled kernels on the attached accelerator (TPU or GPU)
against the pure-jnp references, at realistic sizes. Skipped when `jax.default_backend()` is the
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

pytestmark = [
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
else:  # the defaults' geometry: 256 blocks, narrow grids of 8 steps (AttentionBlockSizes)
    SIZES = Sizes(seq_len=4096, block=256, narrow=8, gqa=(8, 2), mha=(8, 8), dim=128,
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


def _options(tpu_blocks=None, **cpu_only):
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


# --- attention -------------------------------------------------------------------------------


@functools.cache
def _attention(causal: bool, layout: str, head_major: bool):
    cpu_blocks = kernels.AttentionBlockSizes(128, 128, 128, 128, narrow_steps=SIZES.narrow,
                                             head_major=head_major)
    kw = _options(kernels.AttentionBlockSizes(head_major=True) if head_major else None,
                  block_sizes=cpu_blocks)

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


ATTENTION_CASES = [  # (heads, causal, dtype, layout); layout "head_major": blhd operands read
    ("gqa", True, F32, "blhd"),  # as [B, H, L, D] (AttentionBlockSizes(head_major=True))
    ("gqa", True, BF16, "blhd"),
    ("gqa", False, F32, "blhd"),
    ("gqa", False, BF16, "blhd"),
    ("mha", True, BF16, "blhd"),
    ("mha", False, F32, "blhd"),
    ("gqa", True, BF16, "bhld"),
    ("gqa", False, F32, "bhld"),
    ("gqa", True, BF16, "head_major"),
]


def _id(case):
    heads, causal, dtype, layout = case
    return f"{heads}-{'causal' if causal else 'full'}-{dtype[0]}{dtype[-2:]}-{layout}"


@pytest.mark.parametrize("heads,causal,dtype,layout", ATTENTION_CASES,
                         ids=[_id(c) for c in ATTENTION_CASES])
def test_segment_attention(heads, causal, dtype, layout):
    """Values and dq / dk / dv vs the f32 reference on both metadata sets; padding output and
    gradients exactly 0; NaN in the padding of q, k and v changes nothing."""
    if layout == "head_major" and BACKEND == "gpu":
        pytest.skip("head_major is an option of the TPU kernels (AttentionBlockSizes)")
    h, kv = getattr(SIZES, heads)
    rng = np.random.default_rng(len(ATTENTION_CASES) * h + kv + causal)
    shape = (ROWS, SIZES.seq_len)
    q = normal(rng, (*shape, h, SIZES.dim), dtype)
    k, v = (normal(rng, (*shape, kv, SIZES.dim), dtype) for _ in range(2))
    g = normal(rng, q.shape, dtype)
    f = _attention(causal, "bhld" if layout == "bhld" else "blhd", layout == "head_major")
    swap = _heads_second if layout == "bhld" else (lambda x: x)
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


# --- segment losses --------------------------------------------------------------------------


@functools.cache
def _cross_entropy(fused: bool, normalize: str, z_loss: float):
    kw = _options(block_sizes=kernels.CrossEntropyBlockSizes(block_tokens=256, block_vocab=128))
    run = kernels.segment_cross_entropy if fused else reference.segment_cross_entropy

    def f(logits, targets, offsets, lengths, mask, w):
        def objective(logits):
            out = run(logits, targets, offsets, lengths, normalize=normalize, loss_mask=mask,
                      z_loss=z_loss, **(kw if fused else {}))
            return out[0] + jnp.sum(w * out[1]), out

        dlogits, out = jax.grad(objective, has_aux=True)(logits)
        return (*out, dlogits)

    return jax.jit(f)


@pytest.mark.parametrize("dtype,normalize,z_loss", [(F32, "tokens", 1e-3),
                                                    (BF16, "segments", 0.0)])
def test_segment_cross_entropy(dtype, normalize, z_loss):
    """(loss, per_segment_loss, per_segment_tokens) and d logits (of loss + w . per_segment_loss)
    vs the reference with an odd vocabulary, a loss mask and NaN logits on padding; then
    segment_dataset_loss of the result."""
    rng = np.random.default_rng(1)
    offsets, lengths = metadata_sets()["wide"]
    pad = padding_of(offsets, lengths)
    shape = (ROWS, SIZES.seq_len)
    logits = with_nan(normal(rng, (*shape, SIZES.vocab), dtype, 2.0), pad)
    targets = rng.integers(0, SIZES.vocab, shape).astype(np.int32)
    mask = rng.random(shape) > 0.2
    w = normal(rng, offsets.shape, F32, 0.1)
    args = (logits, targets, offsets, lengths, mask, w)
    loss, seg_loss, tokens, dlogits = fetch(_cross_entropy(True, normalize, z_loss), *args)
    with HIGHEST():
        want = fetch(_cross_entropy(False, normalize, z_loss), *args)
    rtol, atol = ELEMENTWISE[F32]  # the loss is f32 math on the logits' values
    assert_close("loss", loss, want[0], rtol, atol)
    assert_close("per_segment_loss", seg_loss, want[1], rtol, atol)
    np.testing.assert_array_equal(tokens, want[2])
    assert dlogits.dtype == jnp.dtype(dtype)
    assert_grad_close("dlogits", dlogits, want[3], *ELEMENTWISE[dtype])
    assert not np.asarray(dlogits, np.float32)[pad].any(), "dlogits nonzero on padding"

    dataset = np.where(lengths > 0, np.arange(SLOTS) % 3, -1).astype(np.int32)
    sums, counts = fetch(functools.partial(kernels.segment_dataset_loss, num_datasets=3),
                         seg_loss, tokens, dataset)
    for d in range(3):
        np.testing.assert_allclose(sums[d], seg_loss[dataset == d].sum(), rtol=1e-5)
        assert counts[d] == tokens[dataset == d].sum()


# --- the fused loss head ---------------------------------------------------------------------

SOFTCAP, Z_LOSS = 5.0, 1e-3


def _materialized(hidden, weight, targets, offsets, lengths, mask, normalize):
    """segment_cross_entropy(hidden @ weight) in f32: -100 labels and the hidden rows of
    uncounted tokens (NaN on padding) taken out first, as a user of the materialized path would."""
    ids = reference.segment_index(offsets, lengths, targets.shape[1])
    counted = (ids < offsets.shape[1]) & (targets >= 0) & mask
    h = jnp.where(counted[:, :, None], hidden, 0).astype(jnp.float32)
    logits = jnp.einsum("blh,hv->blv", h, weight.astype(jnp.float32))
    logits = SOFTCAP * jnp.tanh(logits / SOFTCAP)
    return reference.segment_cross_entropy(logits, jnp.maximum(targets, 0), offsets, lengths,
                                           normalize=normalize, loss_mask=counted,
                                           z_loss=Z_LOSS)


@functools.cache
def _loss_head(mode: str | None, normalize: str, per_segment: bool):
    """mode None: the materialized reference. Gradients of loss (+ w . per_segment_loss)."""
    if mode == "chunked":  # chunks of L tokens: ROWS chunks
        kw = dict(mode=mode, max_logits_bytes=4 * SIZES.vocab * SIZES.seq_len)
    else:
        kw = dict(mode=mode)
    kw.update(_options(block_sizes=kernels.LinearCrossEntropyBlockSizes(block_tokens=256,
                                                                        block_vocab=128)))

    def f(hidden, weight, targets, offsets, lengths, mask, w):
        def objective(hidden, weight):
            if mode is None:
                out = _materialized(hidden, weight, targets, offsets, lengths, mask, normalize)
            else:
                out = kernels.segment_linear_cross_entropy(
                    hidden, weight, targets, offsets, lengths, normalize=normalize,
                    loss_mask=mask, z_loss=Z_LOSS, logit_softcap=SOFTCAP, **kw)
            return out[0] + (jnp.sum(w * out[1]) if per_segment else 0.0), out

        grads, out = jax.grad(objective, (0, 1), has_aux=True)(hidden, weight)
        return (*out, *grads)

    return jax.jit(f)


LOSS_HEAD_CASES = [  # (mode, dtype, normalize, a cotangent on per_segment_loss too)
    ("logits", BF16, "tokens", False),
    ("chunked", F32, "segments", True),
    ("recompute", BF16, "segments", True),
    ("recompute", F32, "tokens", False),
]


@pytest.mark.parametrize("mode,dtype,normalize,per_segment", LOSS_HEAD_CASES,
                         ids=[f"{m}-{d}-{n}{'-per_segment' if p else ''}"
                              for m, d, n, p in LOSS_HEAD_CASES])
def test_segment_linear_cross_entropy(mode, dtype, normalize, per_segment):
    """Each mode with z-loss, a soft-cap, an odd vocabulary, -100 labels, a loss mask and NaN
    hidden on padding: values, d hidden and d weight vs the materialized f32 logits."""
    rng = np.random.default_rng(2)
    offsets, lengths = metadata_sets()["wide"]
    pad = padding_of(offsets, lengths)
    shape = (ROWS, SIZES.seq_len)
    hidden = with_nan(normal(rng, (*shape, SIZES.hidden), dtype), pad)
    weight = normal(rng, (SIZES.hidden, SIZES.vocab), dtype, 3.0 / SIZES.hidden**0.5)
    targets = rng.integers(0, SIZES.vocab, shape).astype(np.int32)
    targets[rng.random(shape) < 0.1] = -100
    mask = rng.random(shape) > 0.2
    w = normal(rng, offsets.shape, F32, 0.1)
    args = (hidden, weight, targets, offsets, lengths, mask, w)
    loss, seg_loss, tokens, dh, dw = fetch(_loss_head(mode, normalize, per_segment), *args)
    with HIGHEST():
        want = fetch(_loss_head(None, normalize, per_segment), *args)
    assert_close("loss", loss, want[0], *HEAD_VALUES)
    assert_close("per_segment_loss", seg_loss, want[1], *HEAD_VALUES)
    np.testing.assert_array_equal(tokens, want[2])
    for name, a, b in (("dhidden", dh, want[3]), ("dweight", dw, want[4])):
        assert a.dtype == jnp.dtype(dtype), name
        assert_grad_close(name, a, b, *MATMUL[dtype])
    assert not np.asarray(dh, np.float32)[pad].any(), "dhidden nonzero on padding"


# --- segment sum / mean / max / broadcast / gather -------------------------------------------


def _segment_op(op: str, impl):
    """(x [B, L, D] or values [B, S, D], offsets, lengths) -> out, by the kernels or reference."""
    seg = kernels.SegmentBlockSizes(block_tokens=256, block_features=128, chunk=32)
    if impl is reference:
        kw, gather_kw = {}, {}
    else:
        kw, gather_kw = _options(block_sizes=seg), _options(
            block_sizes=kernels.GatherBlockSizes(block_features=128))
    if op == "broadcast":
        return lambda x, o, n: impl.segment_broadcast(x, o, n, seq_len=SIZES.seq_len, **kw)
    if op.startswith("gather"):
        position = op.split("_")[1]
        position = int(position) if position.lstrip("-").isdigit() else position
        return lambda x, o, n: impl.segment_gather(x, o, n, position=position, **gather_kw)
    run = getattr(impl, f"segment_{op}")
    return lambda x, o, n: run(x, o, n, **kw)


@functools.cache
def _segment_vjp(op: str, fused: bool):
    run = _segment_op(op, kernels if fused else reference)

    def f(x, offsets, lengths, g):
        out, vjp = jax.vjp(lambda x: run(x, offsets, lengths), x)
        return out, vjp(g)[0]

    return jax.jit(f)


SEGMENT_CASES = [("sum", F32), ("sum", BF16), ("mean", F32), ("max", F32), ("max", BF16),
                 ("broadcast", BF16), ("gather_last", F32), ("gather_-3", BF16)]


@pytest.mark.parametrize("op,dtype", SEGMENT_CASES, ids=[f"{o}-{d}" for o, d in SEGMENT_CASES])
def test_segment_ops(op, dtype):
    """Values and gradients vs the reference; NaN where no segment reads (padding tokens, or the
    unused slots' values for broadcast) reaches nothing; 0 on padding and empty slots."""
    rng = np.random.default_rng(3)
    offsets, lengths = metadata_sets()["wide"]
    pad = padding_of(offsets, lengths)
    unused = lengths == 0
    tokens = (ROWS, SIZES.seq_len, SIZES.features)
    slots = (ROWS, SLOTS, SIZES.features)
    if op == "broadcast":
        x, g, x_pad, out_pad = with_nan(normal(rng, slots, dtype), unused), tokens, unused, pad
    else:
        x, g, x_pad, out_pad = with_nan(normal(rng, tokens, dtype), pad), slots, pad, unused
    g = normal(rng, g, dtype)
    got, dx = fetch(_segment_vjp(op, True), x, offsets, lengths, g)
    with HIGHEST():
        want, want_dx = fetch(_segment_vjp(op, False), x, offsets, lengths, g)
    rtol, atol = ELEMENTWISE[dtype]
    assert got.dtype == dx.dtype == jnp.dtype(dtype)
    assert_grad_close(op, got, want, rtol, atol)
    assert_grad_close(f"d {op}", dx, want_dx, rtol, atol)
    assert not np.asarray(got, np.float32)[out_pad].any(), f"{op}: nonzero on padding / empty"
    assert not np.asarray(dx, np.float32)[x_pad].any(), f"d {op}: nonzero where nothing reads"
