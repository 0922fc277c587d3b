"""Benchmark the Pallas segment kernels against the XLA reference and optax: time, GB/s, memory.

    python -m benchmarks.kernels_bench                 # small sizes, any backend
    python -m benchmarks.kernels_bench --gpu-sizes     # B=8 L=4096 S=16 D=4096 V=32768 bf16
    python -m benchmarks.kernels_bench --batch 8 --seq-len 8192 --dim 4096 --vocab 128256

The kernel family follows the backend: compiled `pallas_tpu` on a TPU, compiled `pallas_gpu`
(Triton) on a GPU. On a CPU the kernels run in interpret mode (`--family gpu`, the default there,
or `tpu`): a simulation whose times are NOT performance figures, and the table says so. The
reference (XLA) and optax rows are real for the backend present.

Columns, per kernel and implementation:
- ms: median wall time of one call (after a compile / warm-up call).
- GB/s: the op's minimal traffic over that time: every input read once and every output written
  once (cross-entropy forward + backward: the logits read twice, dlogits written once). The same
  byte count for every implementation of a kernel, so the rates compare like with like.
- % copy: that rate against the device's copy bandwidth, measured in the same run (`x + 1` over a
  `--copy-mib` buffer: one read and one write).
- temp MiB: XLA's temporary allocation for the compiled call (`memory_analysis()`), any backend.
- peak MiB: `device.memory_stats()["peak_bytes_in_use"]` minus the bytes in use before the first
  call (inputs excluded). On a TPU v5e it leaves a program's temporaries out: read temp MiB
  there, which matched the memory a call ran in (benchmarks/loss_head.py --need). The
  peak never decreases in a process, so on a GPU or TPU each row runs in a fresh subprocess
  (`--row`); "-" where the backend keeps no statistics (CPU).
- err: max |output - reference output| over max |reference output|, after the timing (so it
  checks the compiled kernels on the hardware at hand, at the benchmark's sizes).
- DMA model (TPU family only): bytes the TPU kernels' DMA schedule fetches (replayed on the host
  with the same block sizes and index maps) over the minimum; below 1 where padding blocks are
  skipped (rows are filled to `--fill` of L on average).
optax (`softmax_cross_entropy_with_integer_labels`, masked mean over segment tokens) is measured
when importable; it is not a dependency of seqpack.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from seqpack import kernels
from seqpack.kernels import CrossEntropyBlockSizes, GatherBlockSizes, SegmentBlockSizes, reference
from seqpack.kernels.common import ACCUMULATOR_BUDGET_BYTES, LANES, feature_block, token_block

try:
    import optax
except ImportError:  # optional: only for the comparison row
    optax = None

GPU_SIZES = dict(batch=8, seq_len=4096, segments=16, dim=4096, vocab=32768, dtype="bfloat16")
MIB = 1024 * 1024


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
    ends = np.where(lengths > 0, offsets + lengths, 0).max(axis=1)  # kernels' common.row_ends
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


def copy_bandwidth(mib: int, repeats: int) -> float:
    """Bytes/s of `x + 1` over a mib-MiB f32 buffer (one read, one write per element)."""
    x = jnp.zeros((mib * MIB // 4,), jnp.float32)
    ms = time_call(jax.jit(lambda a: a + 1.0), x, repeats=repeats)
    return 2 * x.nbytes / (ms * 1e-3)


def temp_bytes(f: Callable, *args) -> float:
    analysis = jax.jit(f).lower(*args).compile().memory_analysis()
    return float(getattr(analysis, "temp_size_in_bytes", float("nan")))


def in_use() -> tuple[int, int] | None:
    stats = jax.devices()[0].memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return stats["bytes_in_use"], stats["peak_bytes_in_use"]


@dataclasses.dataclass
class Inputs:
    sz: Sizes
    offsets: np.ndarray
    lengths: np.ndarray
    x: jax.Array
    logits: jax.Array
    targets: jax.Array
    meta: tuple[jax.Array, jax.Array]


def make_inputs(sz: Sizes, fill: float) -> Inputs:
    rng = np.random.default_rng(0)
    offsets, lengths = packed_metadata(rng, sz, fill)
    kernels.validate_segments(offsets, lengths, seq_len=sz.seq_len)
    key_x, key_l = jax.random.split(jax.random.key(0))
    x = jax.random.normal(key_x, (sz.batch, sz.seq_len, sz.dim), sz.dtype)
    logits = jax.random.normal(key_l, (sz.batch, sz.seq_len, sz.vocab), sz.dtype)
    targets = jnp.asarray(rng.integers(0, sz.vocab, size=(sz.batch, sz.seq_len)), jnp.int32)
    return Inputs(sz, offsets, lengths, x, logits, targets,
                  (jnp.asarray(offsets), jnp.asarray(lengths)))


def _optax_loss(lg, t, o, n):
    """optax's token cross-entropy, mean over the tokens of segments (normalize='tokens')."""
    counted = reference.segment_index(o, n, lg.shape[1]) < o.shape[1]
    token_loss = optax.softmax_cross_entropy_with_integer_labels(lg, t)
    return jnp.sum(jnp.where(counted, token_loss, 0.0)) / jnp.maximum(counted.sum(), 1)


def rows(inp: Inputs, impl: str, interpret: bool) -> dict[str, dict]:
    """name -> {impl: fn, "args": ..., "bytes": minimal traffic, "model": DMA model or None}."""
    sz, o, n = inp.sz, inp.offsets, inp.lengths
    pallas = dict(impl=impl, interpret=interpret)
    x_min = inp.x.nbytes + o.nbytes + n.nbytes
    out_bytes = sz.batch * sz.segments * sz.dim * sz.dtype.itemsize
    ce_min = inp.logits.nbytes + inp.targets.nbytes + o.nbytes + n.nbytes
    tpu = impl == "pallas_tpu"

    def ce(**kw):
        return lambda lg, t, o, n: kernels.segment_cross_entropy(lg, t, o, n, **kw)[0]

    table = {}
    for name in ("segment_sum", "segment_mean", "segment_max", "segment_gather"):
        blocks = GatherBlockSizes() if name == "segment_gather" else SegmentBlockSizes()
        model = (bytes_gather if name == "segment_gather" else bytes_reduce)(sz, o, n, blocks)
        table[name] = {"pallas": functools.partial(getattr(kernels, name), **pallas),
                       "reference": getattr(reference, name), "args": (inp.x, *inp.meta),
                       "bytes": x_min + out_bytes, "model": model / x_min if tpu else None}
    ce_args = (inp.logits, inp.targets, *inp.meta)
    blocks = CrossEntropyBlockSizes()
    fwd_model = bytes_cross_entropy(sz, o, n, blocks, backward=False)
    bwd_model = bytes_cross_entropy(sz, o, n, blocks, backward=True)
    table["cross_entropy fwd"] = {
        "pallas": ce(**pallas), "reference": ce(impl="reference"), "args": ce_args,
        "bytes": ce_min, "model": fwd_model / ce_min if tpu else None}
    table["cross_entropy fwd+bwd"] = {
        "pallas": jax.grad(ce(**pallas)), "reference": jax.grad(ce(impl="reference")),
        "args": ce_args, "bytes": ce_min + 2 * inp.logits.nbytes,
        "model": (fwd_model + bwd_model) / ce_min if tpu else None}
    if optax is not None:
        table["cross_entropy fwd"]["optax"] = _optax_loss
        table["cross_entropy fwd+bwd"]["optax"] = jax.grad(_optax_loss)
    return table


def measure(inp: Inputs, impl: str, interpret: bool, name: str, which: str,
            repeats: int) -> dict:
    """ms, temp bytes, peak extra bytes (None without memory statistics) and error of one row."""
    row = rows(inp, impl, interpret)[name]
    fn, args = jax.jit(row[which]), row["args"]
    before = in_use()
    ms = time_call(fn, *args, repeats=repeats)
    after = in_use()
    peak = None if before is None or after is None else after[1] - before[0]
    err = None
    if which != "reference":  # after the peak was read: the reference's memory is not counted
        got = np.asarray(fn(*args), np.float32)
        want = np.asarray(jax.jit(row["reference"])(*args), np.float32)
        err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
    return {"ms": ms, "temp": temp_bytes(row[which], *args), "peak": peak, "err": err}


# the fused loss head (--loss-head): benchmarks/loss_head.py
LOSS_HEAD_SIZES = dict(tokens=16384, dim=1024, vocab=32768, dtype="float32")  # the target
LOSS_HEAD_DEVICE_SIZES = dict(tokens=32768, dim=4096, vocab=128256, dtype="bfloat16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-sizes", action="store_true",
                        help=f"the sizes for real hardware: {GPU_SIZES}")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--segments", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--fill", type=float, default=0.85, help="mean used fraction of a row")
    parser.add_argument("--family", choices=["tpu", "gpu"], default=None,
                        help="kernel family to interpret on a CPU (default gpu)")
    parser.add_argument("--repeats", type=int, default=None, help="default: 20, CPU 3")
    parser.add_argument("--copy-mib", type=int, default=None, help="default: 1024, CPU 64")
    parser.add_argument("--row", default=None, help=argparse.SUPPRESS)  # "name|impl": JSON out
    parser.add_argument("--loss-head", action="store_true",
                        help="the fused loss head against materialized logits: memory, FLOPs, "
                        f"time (--tokens --dim --vocab --dtype; default {LOSS_HEAD_SIZES}, with "
                        f"--gpu-sizes {LOSS_HEAD_DEVICE_SIZES}; --repeats 0: no timing)")
    parser.add_argument("--tokens", type=int, default=None, help="--loss-head: N = B * L")
    args = parser.parse_args()
    if args.loss_head:
        sizes = LOSS_HEAD_DEVICE_SIZES if args.gpu_sizes else LOSS_HEAD_SIZES
        given = {a.split("=")[0] for a in sys.argv[1:]}
        for key, value in sizes.items():  # where not given on the command line
            if f"--{key.replace('_', '-')}" not in given:
                setattr(args, key, value)
    elif args.gpu_sizes:
        for key, value in GPU_SIZES.items():
            setattr(args, key, value)

    # Interpret-mode callbacks dispatch jax ops themselves; inline CPU dispatch avoids a deadlock
    # between them and queued computations on small machines.
    try:
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    except AttributeError:  # an option this jax (e.g. a device's newer one) does not have
        pass
    backend = jax.default_backend()
    on_cpu = backend not in ("tpu", "gpu")
    family = args.family or ("gpu" if on_cpu else backend)
    impl, interpret = f"pallas_{family}", on_cpu
    repeats = args.repeats or (3 if on_cpu else 20)
    sz = Sizes(args.batch, args.seq_len, args.segments, args.dim, args.vocab,
               jnp.dtype(args.dtype))
    if args.loss_head:
        from benchmarks.loss_head import loss_head_table  # it reads this module's helpers

        loss_head_table(args, "reference" if on_cpu else impl, interpret,
                        0 if args.repeats is None and on_cpu else repeats)
        return
    inp = make_inputs(sz, args.fill)
    if args.row:
        name, which = args.row.split("|")
        print(json.dumps(measure(inp, impl, interpret, name, which, repeats)))
        return

    copy = copy_bandwidth(args.copy_mib or (64 if on_cpu else 1024), repeats)
    isolate = not on_cpu and in_use() is not None
    mode = "INTERPRET MODE on " + backend if on_cpu else "compiled"
    print(f"backend={backend} device={jax.devices()[0].device_kind}  kernels={impl} ({mode})  "
          f"B={sz.batch} L={sz.seq_len} S={sz.segments} D={sz.dim} V={sz.vocab} "
          f"dtype={sz.dtype.name} used={float(inp.lengths.sum() / (sz.batch * sz.seq_len)):.0%}")
    print(f"copy bandwidth (x + 1, read + write): {copy / 1e9:.1f} GB/s")
    header = (f"{'kernel':22} {'impl':10} {'ms':>9} {'GB/s':>8} {'% copy':>7} {'temp MiB':>9} "
              f"{'peak MiB':>9} {'err':>8} {'DMA model':>9}")
    print(header)
    print("-" * len(header))
    for name, row in rows(inp, impl, interpret).items():
        for which in ("pallas", "reference", "optax"):
            if which not in row:
                continue
            if isolate:  # a fresh process: the device's peak counter starts from this row
                out = subprocess.run([sys.executable, "-m", "benchmarks.kernels_bench",
                                      *sys.argv[1:], "--row", f"{name}|{which}"],
                                     capture_output=True, text=True, check=True)
                result = json.loads(out.stdout.strip().splitlines()[-1])
            else:
                result = measure(inp, impl, interpret, name, which, repeats)
            rate = row["bytes"] / (result["ms"] * 1e-3)
            peak = "-" if result["peak"] is None else f"{result['peak'] / MIB:.1f}"
            model = row["model"] if which == "pallas" and row["model"] is not None else None
            print(f"{name:22} {which:10} {result['ms']:9.3f} {rate / 1e9:8.2f} "
                  f"{rate / copy:7.1%} {result['temp'] / MIB:9.1f} {peak:>9} "
                  f"{'-' if result['err'] is None else format(result['err'], '.1e'):>8} "
                  f"{'-' if model is None else f'{model:.2f}':>9}")
    if optax is None:
        print("\noptax is not installed: no optax rows (pip install optax to compare).")
    if on_cpu:
        print(f"\nNOTE: no accelerator: the pallas rows ran {impl} in interpret mode (a CPU "
              "simulation);\ntheir times are NOT performance figures. Hardware: --gpu-sizes on a "
              "GPU or TPU.")


if __name__ == "__main__":
    main()
