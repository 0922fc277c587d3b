"""The loss head, forward + backward in one process: materialized logits, MaxText-style vocab
tiling and segment_linear_cross_entropy's modes; time, XLA temporary memory, matmul FLOPs.

    python -m benchmarks.loss_head --preset all        # the issue's three sizes, bf16 (a chip)
    python -m benchmarks.loss_head --preset 16k        # N=16384 H=4096 V=128256
    python -m benchmarks.loss_head --preset gpu        # 16k and gemma (N=8192 H=2304 V=256000)
    python -m benchmarks.loss_head --smoke             # tiny sizes, seconds on a CPU
    python -m benchmarks.loss_head --tokens 8192 --dim 2048 --vocab 256000 --chunks 1024 2048
    python -m benchmarks.kernels_bench --loss-head     # the same table from kernels_bench

Paths, each `value_and_grad` in (hidden, weight) of the token-normalized loss:
- materialized: `hidden @ weight` (input dtype) then an f32 log-softmax, jax autodiff; skipped
  where its logits alone exceed the device's free memory.
- vocab tiling: MaxText's way, token chunks of 4096 (`--tiling-chunk`), each chunk's loss in a
  `lax.scan`, the backward recomputing each chunk through `jax.vjp` (8NHV).
- seqpack auto: segment_linear_cross_entropy with no budget (the mode auto picks is printed);
  seqpack 1/4 budget: max_logits_bytes = a quarter of the materialized logits' bytes (N V x the
  dtype's size); seqpack recompute: mode="recompute" (the kernels of the backend: impl="auto");
  seqpack C=...: mode="chunked" at the chunk sizes of `--chunks`; `--logits-dtypes float32`:
  the same rows again with logits_dtype="float32" (seqpack's default stores the input dtype's);
  `--bf16-carry`: "seqpack auto dw bf16" and "C=... dw bf16", d weight carried in bf16.
Columns: mode (what seqpack runs: auto's choice and its chunk C), temp MiB (compiled
memory_analysis()), / 6NHV (matmul FLOPs of the jaxpr's dot_generals, scan bodies times their
length, over materialized logits' 6NHV; "-" where the matmuls are in Pallas kernels, which
the jaxpr does not show), ms (median of `--repeats` after a warm-up call),
ratios of ms to materialized and to vocab tiling, err (the largest difference of the loss, 512
rows of d hidden and 512 columns of d weight from the first path's, over its largest value),
need MiB (`--need`, where the backend reports its free memory): the least free memory the row
runs in (its outputs and temporaries), within 64 MiB: a bisection on a ballast allocated beside
it (on a TPU, peak_bytes_in_use leaves a program's temporaries out).
`--profile`: after the table, each timed path's device time by XLA op (benchmarks/profile.py).
`--weight-dtype float32`: a float32 (master) weight beside bf16 hidden, read cast to bf16 by
every path; its gradient is float32.
On a CPU the times are the CPU's (the smoke run checks that every path runs).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks.common import LOSS_HEAD_PRESETS as PRESETS
from benchmarks.common import print_table
from benchmarks.kernels_bench import MIB, Sizes, make_inputs, time_call
from benchmarks.profile import profile_ops
from seqpack import kernels
from seqpack.kernels import reference
from seqpack.kernels.fused import free_device_bytes, reported_free_bytes

GPU = ("16k", "gemma")  # --preset gpu: issue 65's sizes on the GPU
SMOKE = (512, 64, 1000)
TILING_CHUNK = 4096  # MaxText's vocab tiling: tokens per chunk


def sub_jaxprs(jaxpr, times: int = 1) -> Iterator[tuple[Any, int]]:
    """(jaxpr, times run) of a closed jaxpr's own jaxpr and all its sub-jaxprs (scan bodies run
    `length` times)."""
    jx = getattr(jaxpr, "jaxpr", jaxpr)
    yield jx, times
    for eqn in jx.eqns:
        inner = times * (eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from sub_jaxprs(sub, inner)


def jaxpr_values(jaxpr) -> list[tuple[tuple[int, ...], int]]:
    """(shape, times run) of every value in a closed jaxpr and all its sub-jaxprs (scan bodies
    count `length` times), inputs and outputs included."""
    out = []
    for jx, times in sub_jaxprs(jaxpr):
        out.extend((tuple(v.aval.shape), times) for v in (*jx.invars, *jx.outvars)
                   if hasattr(v, "aval") and hasattr(v.aval, "shape"))
        out.extend((tuple(v.aval.shape), times) for eqn in jx.eqns for v in eqn.outvars)
    return out


def matmul_flops(jaxpr) -> float:
    """2 * M * N * K of every dot_general, scan bodies times their length (XLA's cost_analysis
    counts a loop body once)."""
    total = 0.0
    for jx, times in sub_jaxprs(jaxpr):
        for eqn in jx.eqns:
            if eqn.primitive.name == "dot_general":
                (contract, _), _ = eqn.params["dimension_numbers"]  # lhs contracting dims
                lhs = eqn.invars[0].aval.shape
                k = int(np.prod([lhs[d] for d in contract]))
                total += times * 2.0 * k * int(np.prod(eqn.outvars[0].aval.shape))
    return total


# -- MaxText-style vocab tiling ---------------------------------------------------------------

def _chunk_loss(w, x, t, m):
    """Sum of one token chunk's losses: logits in the input dtype (a wider weight read in it, as
    MaxText's layers cast their f32 parameters), an f32 log-softmax."""
    logits = jnp.dot(x, w.astype(x.dtype)).astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, jnp.maximum(t, 0)[:, None], axis=-1)[:, 0]
    return jnp.sum(jnp.where(m, lse - target, 0.0))


@jax.custom_vjp
def _tiled_sum(w, xs):
    return lax.scan(lambda acc, c: (acc + _chunk_loss(w, *c), None), jnp.float32(0.0), xs)[0]


def _tiled_fwd(w, xs):
    return _tiled_sum(w, xs), (w, xs)


def _tiled_bwd(residuals, g):
    w, xs = residuals

    def step(dw, c):
        x, t, m = c
        _, vjp = jax.vjp(lambda w, x: _chunk_loss(w, x, t, m), w, x)
        dw_c, dx = vjp(g)
        return dw + dw_c.astype(jnp.float32), dx

    dw, dx = lax.scan(step, jnp.zeros(w.shape, jnp.float32), xs)
    return dw.astype(w.dtype), (dx, None, None)


_tiled_sum.defvjp(_tiled_fwd, _tiled_bwd)


def vocab_tiling(chunk: int) -> Callable:
    """(hidden, weight, targets, offsets, lengths) -> token-normalized loss, in token chunks."""

    def loss(h, w, t, o, n):
        batch, seq_len, dim = h.shape
        counted = reference.segment_index(o, n, seq_len) < o.shape[1]
        x, tt, m = h.reshape(-1, dim), t.reshape(-1), counted.reshape(-1)
        c = min(chunk, x.shape[0])
        pad = -x.shape[0] % c
        if pad:
            x, tt, m = jnp.pad(x, ((0, pad), (0, 0))), jnp.pad(tt, (0, pad)), jnp.pad(m, (0, pad))
        xs = (x.reshape(-1, c, dim), tt.reshape(-1, c), m.reshape(-1, c))
        return _tiled_sum(w, xs) / jnp.maximum(counted.sum(), 1).astype(jnp.float32)

    return loss


# -- the table ---------------------------------------------------------------------------------

class TraceNote:
    """The mode a fused row runs, recorded when its function is traced."""

    def __init__(self) -> None:
        self.text = "?"

    def __format__(self, spec: str) -> str:
        return format(self.text, spec)


def loss_head_fns(n: int, vocab: int, dtype, chunks=(), tiling_chunk: int = TILING_CHUNK,
                  logits_dtypes=(), bf16_carry: bool = False, **seqpack_kw
                  ) -> dict[str, tuple[Callable, str | TraceNote]]:
    """name -> (loss function (hidden, weight, targets, offsets, lengths) -> loss, the mode).
    logits_dtypes: more rows of auto, the 1/4 budget and `chunks` with logits stored so;
    bf16_carry: more rows of auto and `chunks` with d weight carried in bf16."""

    def fused(mode="auto", max_logits_bytes=None, logits_dtype=None, weight_grad_dtype=None):
        note = TraceNote()

        def f(h, w, t, o, n):
            # the call's plan, taken as the call takes it: at trace time, from the free memory
            plan = kernels.loss_head_plan(h.shape[0] * h.shape[1], w.shape[1], mode=mode,
                                          max_logits_bytes=max_logits_bytes,
                                          logits_dtype=logits_dtype or h.dtype)
            note.text = (f"chunked C={plan.chunk_tokens}"
                         if plan.mode is kernels.LossHeadMode.CHUNKED else plan.mode.value)
            return kernels.segment_linear_cross_entropy(
                h, w, t, o, n, mode=mode, max_logits_bytes=max_logits_bytes,
                logits_dtype=logits_dtype, weight_grad_dtype=weight_grad_dtype, **seqpack_kw)[0]
        return f, note

    def materialized(h, w, t, o, n):  # the logits in the input dtype, their lse in f32
        logits = h @ w.astype(h.dtype)
        counted = reference.segment_index(o, n, logits.shape[1]) < o.shape[1]
        lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
        target = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
        token_loss = jnp.where(counted, lse - target.astype(jnp.float32), 0.0)
        return token_loss.sum() / jnp.maximum(counted.sum(), 1)

    quarter = n * vocab * jnp.dtype(dtype).itemsize // 4
    fns = {"materialized": (materialized, ""),
           "vocab tiling": (vocab_tiling(tiling_chunk), f"C={min(tiling_chunk, n)}"),
           "seqpack auto": fused(), "seqpack 1/4 budget": fused(max_logits_bytes=quarter),
           "seqpack recompute": fused("recompute")}
    for c in chunks:
        fns[f"seqpack C={c}"] = fused("chunked", jnp.dtype(dtype).itemsize * vocab * c)
    for name in logits_dtypes:
        size = jnp.dtype(name).itemsize
        fns[f"seqpack auto {name}"] = fused(logits_dtype=name)
        fns[f"seqpack 1/4 {name}"] = fused(max_logits_bytes=quarter, logits_dtype=name)
        for c in chunks:
            fns[f"seqpack C={c} {name}"] = fused("chunked", size * vocab * c, name)
    if bf16_carry:
        fns["seqpack auto dw bf16"] = fused(weight_grad_dtype="bfloat16")
        for c in chunks:
            fns[f"seqpack C={c} dw bf16"] = fused("chunked", jnp.dtype(dtype).itemsize * vocab * c,
                                                  weight_grad_dtype="bfloat16")
    return fns


def _sample(out) -> tuple[np.ndarray, ...]:
    """(loss, 512 rows of d hidden, 512 columns of d weight) in f32: what `err` compares."""
    loss, (dh, dw) = out
    return tuple(np.asarray(a, np.float32) for a in (loss, dh.reshape(-1, dh.shape[-1])[:512],
                                                     dw[:, :512]))


def _exhausted(error: Exception) -> bool:
    return "RESOURCE_EXHAUSTED" in str(error)


def least_free_bytes(call: Callable[[], Any], step: int = 64 * MIB,
                     free: Callable[[], int | None] = reported_free_bytes,
                     allocate: Callable[[int], Any] = lambda size: jnp.zeros(size // 4, jnp.int32)
                     ) -> int | None:
    """The least free device memory `call` runs in, within `step`: a bisection on the size of a
    ballast allocated beside it, read as the free memory beside the largest ballast with which
    it ran (call must run with none); None where the backend reports no free memory."""
    start = free()
    if start is None:
        return None
    fits, low, high = start, 0, start  # ran beside a ballast of low bytes; not of high
    while high - low > step:
        size = (low + high) // 2
        ballast = None
        try:
            ballast = jax.block_until_ready(allocate(size))
            left = free()
            jax.block_until_ready(call())
            low, fits = size, left if left is not None else start - size
        except Exception as e:  # noqa: BLE001 (the backend's out-of-memory error, re-raised if not)
            if not _exhausted(e):
                raise
            high = size
        del ballast
    return fits


def loss_head_table(args, impl: str = "auto", interpret: bool = False, repeats: int = 5
                    ) -> dict[str, dict]:
    """Print one table (args: tokens, dim, vocab, dtype, segments, fill, chunks, tiling_chunk,
    paths: the rows to run, all when empty; need: measure each row's least free memory);
    -> name -> {"temp": bytes, "flops": matmul FLOPs, "ms": time (nan: not timed), "need":
    bytes or None}."""
    n, dim, vocab = args.tokens, args.dim, args.vocab
    dtype = jnp.dtype(args.dtype)
    weight_dtype = jnp.dtype(getattr(args, "weight_dtype", None) or dtype)
    batch, seq_len = (1, n) if n <= 32768 else (n // 32768, 32768)
    spec = (jax.ShapeDtypeStruct((batch, seq_len, dim), dtype),
            jax.ShapeDtypeStruct((dim, vocab), weight_dtype),
            jax.ShapeDtypeStruct((batch, seq_len), jnp.int32),
            jax.ShapeDtypeStruct((batch, args.segments), jnp.int32),
            jax.ShapeDtypeStruct((batch, args.segments), jnp.int32))
    free = free_device_bytes()
    weight_note = "" if weight_dtype == dtype else f" (weight {weight_dtype.name})"
    print(f"\nloss head: N={n} H={dim} V={vocab} {dtype.name}{weight_note}  "
          f"backend={jax.default_backend()}  "
          f"free {free / MIB:,.0f} MiB  (value_and_grad in hidden and weight; 6NHV = "
          f"{6 * n * dim * vocab / 1e12:.2f} TFLOP)")
    header = (f"{'path':20} {'mode':>16} {'temp MiB':>10} {'/ 6NHV':>7} {'ms':>9} "
              f"{'vs mat':>7} {'vs tiling':>9} {'err':>8} {'need MiB':>9}")
    print(header)
    print("-" * len(header))
    inputs = None
    if repeats > 0:
        meta = make_inputs(Sizes(batch, seq_len, args.segments, dim, 8, dtype), args.fill)
        key_h, key_w = jax.random.split(jax.random.key(1))
        inputs = (jax.random.normal(key_h, spec[0].shape, dtype),
                  (jax.random.normal(key_w, spec[1].shape, dtype) * dim**-0.5).astype(
                      weight_dtype),
                  jax.random.randint(key_w, spec[2].shape, 0, vocab), *meta.meta)
    kw = {} if impl == "auto" else dict(impl=impl, interpret=interpret)
    fns = loss_head_fns(n, vocab, dtype, getattr(args, "chunks", ()),
                        getattr(args, "tiling_chunk", TILING_CHUNK),
                        getattr(args, "logits_dtypes", ()), getattr(args, "bf16_carry", False),
                        **kw)
    paths = getattr(args, "paths", None) or list(fns)
    unknown = [p for p in paths if p not in fns]
    if unknown:
        raise SystemExit(f"Error: unknown --paths {unknown}; the paths: {list(fns)}")
    rows: dict[str, dict] = {}
    profiles = []
    for name, (loss, note) in ((p, fns[p]) for p in paths):
        if name == "materialized" and n * vocab * dtype.itemsize > free:
            print(f"{name:20} skipped: its {n * vocab * dtype.itemsize / MIB:,.0f} MiB of logits "
                  f"exceed the {free / MIB:,.0f} MiB free")
            continue
        try:
            traced = jax.jit(jax.value_and_grad(loss, (0, 1))).trace(*spec)
            compiled = traced.lower().compile()
        except Exception as e:  # noqa: BLE001 (XLA reports a program that cannot fit this way)
            print(f"{name:20} failed to compile: {str(e).splitlines()[0][:120]}")
            continue
        row = {"temp": compiled.memory_analysis().temp_size_in_bytes,
               "flops": matmul_flops(traced.jaxpr), "ms": float("nan"), "need": None}
        if inputs is not None:
            row["ms"] = time_call(compiled, *inputs, repeats=repeats)
            out = compiled(*inputs)
            row["sample"], row["dw_dtype"] = _sample(out), out[1][1].dtype
            del out
            base = next(iter(rows.values()), row)["sample"]  # the first path measured
            row["err"] = max(float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))
                             for a, b in zip(row["sample"], base))
            if getattr(args, "need", False):
                row["need"] = least_free_bytes(lambda c=compiled: c(*inputs))
            if getattr(args, "profile", False):
                profiles.append((name, profile_ops(lambda _, b, c=compiled: c(*b), None,
                                                   [inputs] * 3, args.top)))
        rows[name] = row
        ratio = {base: row["ms"] / rows[base]["ms"] if base in rows else float("nan")
                 for base in ("materialized", "vocab tiling")}
        flops = f"{row['flops'] / (6 * n * dim * vocab):.3f}" if row["flops"] else "-"
        print(f"{name:20} {note:>16} {row['temp'] / MIB:10.1f} "
              f"{flops:>7} {row['ms']:9.1f} "
              f"{ratio['materialized']:7.3f} {ratio['vocab tiling']:9.3f} "
              f"{row.get('err', float('nan')):8.1e} "
              f"{'-' if row['need'] is None else format(row['need'] / MIB, ',.0f'):>9}",
              flush=True)
    for name, (by_cat, table) in profiles:
        print_table(f"profile: {name} (device ms a call, exclusive)", ["category", "ms", "share"],
                    by_cat)
        print_table(f"profile: {name}: top ops", ["op", "ms", "share"], table)
    return rows


def main(argv: list[str] | None = None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=[*PRESETS, "all", "gpu"], default=None)
    parser.add_argument("--smoke", action="store_true", help=f"N, H, V = {SMOKE}, float32")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--weight-dtype", choices=["float32"], default=None,
                        help="a float32 master weight beside --dtype hidden (MaxText's "
                        "parameters): every path reads it cast to --dtype")
    parser.add_argument("--segments", type=int, default=16)
    parser.add_argument("--fill", type=float, default=0.95, help="mean used fraction of a row")
    parser.add_argument("--chunks", type=int, nargs="*", default=[],
                        help="extra rows: mode='chunked' at these chunk sizes (tokens)")
    parser.add_argument("--tiling-chunk", type=int, default=TILING_CHUNK)
    parser.add_argument("--logits-dtypes", nargs="*", default=[],
                        choices=["float32", "bfloat16"],
                        help="extra rows: auto, 1/4 budget and --chunks with the fused head's "
                        "logits_dtype (default: the input dtype)")
    parser.add_argument("--bf16-carry", action="store_true",
                        help="extra rows: auto and --chunks with d weight carried in bf16 "
                        "(weight_grad_dtype='bfloat16')")
    parser.add_argument("--repeats", type=int, default=5, help="0: memory and FLOPs only")
    parser.add_argument("--profile", action="store_true",
                        help="after the table: each path's device time by XLA op")
    parser.add_argument("--top", type=int, default=12, help="ops listed by --profile")
    parser.add_argument("--paths", nargs="*", default=[],
                        help="only these rows, by name ('vocab tiling', 'seqpack auto', "
                        "'seqpack C=2048', ...)")
    parser.add_argument("--need", action="store_true",
                        help="the need MiB column: each row's least free memory (runs it about "
                        "8 times more)")
    args = parser.parse_args(argv)
    sizes = [(args.tokens, args.dim, args.vocab)]
    if args.smoke:
        sizes, args.dtype = [SMOKE], "float32"
    elif args.preset:
        names = {"all": ("16k", "8k", "64k"), "gpu": GPU}.get(args.preset, (args.preset,))
        sizes = [PRESETS[name] for name in names]
    rows = {}
    for args.tokens, args.dim, args.vocab in sizes:
        rows = loss_head_table(args, repeats=args.repeats)
    return rows


if __name__ == "__main__":
    main()
