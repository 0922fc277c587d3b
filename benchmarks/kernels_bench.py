"""Benchmark the Pallas segment kernels against the XLA reference: time and bytes read per call.

    python -m benchmarks.kernels_bench                       # small sizes, any backend
    python -m benchmarks.kernels_bench --batch 8 --seq-len 8192 --dim 4096 --vocab 128256

On a TPU the Pallas kernels run compiled. Anywhere else they run in interpret mode (a Python
simulation of the TPU on the CPU): those timings measure the simulator, not the kernels, and the
table says so. The reference timings are real for the backend present.

Bytes read, Pallas: a model of the kernel's DMA schedule, replayed on the host with the same block
sizes and index maps (a block is fetched when its index differs from the previous grid step's;
blocks past a row's used length are clamped, so not fetched). Reference: XLA's own cost estimate
("bytes accessed", all ops, reads and writes). Minimum: every input array read once. Ratios below
1 mean the kernel skipped padding blocks (rows are filled to `--fill` of L on average).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from seqpack import kernels
from seqpack.kernels import CrossEntropyBlockSizes, GatherBlockSizes, SegmentBlockSizes, reference
from seqpack.kernels.common import ACCUMULATOR_BUDGET_BYTES, LANES, feature_block, token_block


@dataclasses.dataclass(frozen=True)
class Sizes:
    batch: int
    seq_len: int
    segments: int
    dim: int
    vocab: int
    dtype: jnp.dtype


def packed_metadata(rng: np.random.Generator, sizes: Sizes, fill: float):
    """Random packed rows: up to S segments per row, about `fill` of L used, padding at the end."""
    b, s, length = sizes.batch, sizes.segments, sizes.seq_len
    offsets = np.zeros((b, s), np.int32)
    lengths = np.zeros((b, s), np.int32)
    for r in range(b):
        used = int(rng.uniform(0.8, 1.0) * fill * length)
        n = int(rng.integers(1, s + 1))
        cuts = np.sort(rng.choice(np.arange(1, max(used, 2)), size=min(n - 1, max(used - 1, 0)),
                                  replace=False))
        bounds = np.concatenate([[0], cuts, [used]]).astype(np.int32)
        k = len(bounds) - 1
        offsets[r, :k], lengths[r, :k] = bounds[:-1], np.diff(bounds)
        offsets[r, k:] = used
    return offsets, lengths


def _row_last_block(offsets, lengths, block):
    ends = offsets[:, -1] + lengths[:, -1]
    return np.maximum(-(-ends // block) - 1, 0)


def _fetched(indices: list) -> list:
    """The block indices actually DMA'd when visited in grid order (repeats are not refetched)."""
    return [index for k, index in enumerate(indices) if k == 0 or indices[k - 1] != index]


def _span(i, block, size):
    return min(block, size - i * block)


def bytes_reduce(sz: Sizes, offsets, lengths, blocks: SegmentBlockSizes) -> int:
    bl = token_block(sz.seq_len, blocks.block_tokens, blocks.chunk)
    acc = ACCUMULATOR_BUDGET_BYTES // (2 * sz.segments * 8 * 4) // LANES * LANES
    bd = feature_block(sz.dim, min(blocks.block_features, max(LANES, acc)))
    last = _row_last_block(offsets, lengths, bl)
    total = 0
    for b in range(sz.batch):
        for d in range(-(-sz.dim // bd)):
            idx = [min(t, last[b]) for t in range(-(-sz.seq_len // bl))]
            total += sum(_span(t, bl, sz.seq_len) * _span(d, bd, sz.dim) for t in _fetched(idx))
    return total * sz.dtype.itemsize + offsets.nbytes + lengths.nbytes


def bytes_gather(sz: Sizes, offsets, lengths, blocks: GatherBlockSizes) -> int:
    rows = 8 * 4 // sz.dtype.itemsize
    rows = sz.seq_len if sz.seq_len < rows else rows
    bd = feature_block(sz.dim, blocks.block_features)
    pos = np.clip(offsets + lengths - 1, 0, sz.seq_len - 1)
    total = 0
    for b in range(sz.batch):
        for d in range(-(-sz.dim // bd)):
            tiles = _fetched([pos[b, j] // rows for j in range(sz.segments)])
            total += len(tiles) * rows * _span(d, bd, sz.dim)
    return total * sz.dtype.itemsize + offsets.nbytes + lengths.nbytes


def bytes_cross_entropy(sz: Sizes, offsets, lengths, blocks: CrossEntropyBlockSizes,
                        backward: bool) -> int:
    bl = token_block(sz.seq_len, blocks.block_tokens, 16)
    bv = sz.vocab if sz.vocab <= blocks.block_vocab else blocks.block_vocab
    nt, nv = -(-sz.seq_len // bl), -(-sz.vocab // bv)
    last = _row_last_block(offsets, lengths, bl)
    logits = columns = 0
    for b in range(sz.batch):
        idx = [(t, v) if t <= last[b] else (last[b], nv - 1) for t in range(nt) for v in range(nv)]
        logits += sum(_span(t, bl, sz.seq_len) * _span(v, bv, sz.vocab) for t, v in _fetched(idx))
        columns += sum(_span(t, bl, sz.seq_len) for t in range(int(last[b]) + 1))
    # forward: targets + mask columns, offsets/lengths in SMEM and as [B, 1, S] starts/ends;
    # backward: targets + lse + weights columns, plus the broadcast kernel that makes the weights
    # (it reads the [B, S] cotangent and the metadata once more).
    per_column = 4 * (3 if backward else 2)
    meta = 2 * (offsets.nbytes + lengths.nbytes) + (offsets.nbytes if backward else 0)
    return logits * sz.dtype.itemsize + columns * per_column + meta


def time_call(f: Callable, *args, repeats: int) -> float:
    """Median wall time of f(*args) in ms, after one warm-up (compile) call."""
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def xla_bytes(f: Callable, *args) -> float:
    cost = f.lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost.get("bytes accessed", float("nan")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--segments", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--fill", type=float, default=0.85, help="mean used fraction of a row")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    # Interpret-mode callbacks dispatch jax ops themselves; inline CPU dispatch avoids a deadlock
    # between them and queued computations on small machines.
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    on_tpu = jax.default_backend() == "tpu"
    interpret = False if on_tpu else pltpu.InterpretParams()
    sz = Sizes(args.batch, args.seq_len, args.segments, args.dim, args.vocab,
               jnp.dtype(args.dtype))
    rng = np.random.default_rng(0)
    offsets, lengths = packed_metadata(rng, sz, args.fill)
    kernels.validate_segments(offsets, lengths, seq_len=sz.seq_len)
    x = jnp.asarray(rng.normal(size=(sz.batch, sz.seq_len, sz.dim)), sz.dtype)
    logits = jnp.asarray(rng.normal(size=(sz.batch, sz.seq_len, sz.vocab)), sz.dtype)
    targets = jnp.asarray(rng.integers(0, sz.vocab, size=(sz.batch, sz.seq_len)), jnp.int32)
    meta = (jnp.asarray(offsets), jnp.asarray(lengths))
    seg_blocks, gather_blocks, ce_blocks = (SegmentBlockSizes(), GatherBlockSizes(),
                                            CrossEntropyBlockSizes())
    pallas = dict(impl="pallas", interpret=interpret)

    def ce_loss(impl_kw):
        return lambda lg, t, o, n: kernels.segment_cross_entropy(lg, t, o, n, **impl_kw)[0]

    x_min = x.nbytes + offsets.nbytes + lengths.nbytes
    ce_min = logits.nbytes + targets.nbytes + offsets.nbytes + lengths.nbytes
    rows = [
        ("segment_sum", kernels.segment_sum, reference.segment_sum, (x, *meta), x_min,
         bytes_reduce(sz, offsets, lengths, seg_blocks)),
        ("segment_mean", kernels.segment_mean, reference.segment_mean, (x, *meta), x_min,
         bytes_reduce(sz, offsets, lengths, seg_blocks)),
        ("segment_max", kernels.segment_max, reference.segment_max, (x, *meta), x_min,
         bytes_reduce(sz, offsets, lengths, seg_blocks)),
        ("segment_gather(last)", kernels.segment_gather, reference.segment_gather, (x, *meta),
         x_min, bytes_gather(sz, offsets, lengths, gather_blocks)),
        ("cross_entropy fwd", ce_loss(pallas), ce_loss(dict(impl="reference")),
         (logits, targets, *meta), ce_min, bytes_cross_entropy(sz, offsets, lengths, ce_blocks,
                                                               backward=False)),
        ("cross_entropy fwd+bwd", jax.grad(ce_loss(pallas)),
         jax.grad(ce_loss(dict(impl="reference"))), (logits, targets, *meta), ce_min,
         bytes_cross_entropy(sz, offsets, lengths, ce_blocks, backward=False)
         + bytes_cross_entropy(sz, offsets, lengths, ce_blocks, backward=True)),
    ]

    mode = "compiled (TPU)" if on_tpu else "INTERPRET MODE on " + jax.default_backend()
    print(f"backend={jax.default_backend()}  pallas={mode}  B={sz.batch} L={sz.seq_len} "
          f"S={sz.segments} D={sz.dim} V={sz.vocab} dtype={sz.dtype.name} "
          f"used={float((lengths.sum()) / (sz.batch * sz.seq_len)):.0%}")
    print(f"blocks: {seg_blocks}, {gather_blocks}, {ce_blocks}")
    header = f"{'kernel':24} {'impl':10} {'ms/call':>10} {'bytes read':>12} {'minimum':>12} ratio"
    print(header)
    print("-" * len(header))
    for name, kernel_fn, ref_fn, call_args, minimum, modeled in rows:
        if name.startswith("cross_entropy"):
            pallas_fn, reference_fn = jax.jit(kernel_fn), jax.jit(ref_fn)
        else:
            pallas_fn = jax.jit(functools.partial(kernel_fn, **pallas))
            reference_fn = jax.jit(ref_fn)
        for impl, fn, nbytes, label in (
            ("pallas", pallas_fn, modeled, "DMA model"),
            ("reference", reference_fn, xla_bytes(reference_fn, *call_args), "XLA est."),
        ):
            ms = time_call(fn, *call_args, repeats=args.repeats)
            print(f"{name:24} {impl:10} {ms:10.2f} {nbytes:12.0f} {minimum:12d} "
                  f"{nbytes / minimum:5.2f}  ({label})")
    if not on_tpu:
        print("\nNOTE: no TPU here: the pallas rows ran in interpret mode (a CPU simulation of "
              "the TPU);\ntheir times are NOT a performance figure. Pallas bytes: the kernels' DMA "
              "schedule;\nreference bytes: XLA's estimate (reads + writes of all ops).")


if __name__ == "__main__":
    main()
