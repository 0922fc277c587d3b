"""The fused loss head against materialized logits (`kernels_bench --loss-head`): compiled
temporary bytes, matmul FLOPs read from the jaxpr, the largest value, and time.

    python -m benchmarks.kernels_bench --loss-head              # N=16384 H=1024 V=32768 f32
    python -m benchmarks.kernels_bench --loss-head --gpu-sizes  # N=32768 H=4096 V=128256 bf16
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels_bench import MIB, Sizes, make_inputs, time_call
from seqpack import kernels


def jaxpr_values(jaxpr) -> list[tuple[tuple[int, ...], int]]:
    """(shape, times run) of every value in a closed jaxpr and all its sub-jaxprs (scan bodies
    count `length` times), inputs and outputs included."""
    out = []

    def walk(jx, times):
        out.extend((tuple(v.aval.shape), times) for v in (*jx.invars, *jx.outvars)
                   if hasattr(v, "aval") and hasattr(v.aval, "shape"))
        for eqn in jx.eqns:
            out.extend((tuple(v.aval.shape), times) for v in eqn.outvars)
            inner = times * (eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub, inner)

    walk(jaxpr.jaxpr, 1)
    return out


def matmul_flops(jaxpr) -> float:
    """2 * M * N * K of every dot_general, scan bodies times their length (XLA's cost_analysis
    counts a loop body once)."""
    total = 0.0

    def walk(jx, times):
        nonlocal total
        for eqn in jx.eqns:
            if eqn.primitive.name == "dot_general":
                (contract, _), _ = eqn.params["dimension_numbers"]  # lhs contracting dims
                lhs = eqn.invars[0].aval.shape
                k = int(np.prod([lhs[d] for d in contract]))
                total += times * 2.0 * k * int(np.prod(eqn.outvars[0].aval.shape))
            inner = times * (eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub, inner)

    walk(jaxpr.jaxpr, 1)
    return total


def loss_head_fns(impl: str, interpret: bool) -> dict[str, Callable]:
    """name -> value_and_grad in (hidden, weight) of the loss (normalize='tokens')."""

    def fused(**kw):
        def f(h, w, t, o, n):
            return kernels.segment_linear_cross_entropy(h, w, t, o, n, **kw)[0]
        return f

    def materialized(h, w, t, o, n):
        return kernels.segment_cross_entropy(h @ w, t, o, n, impl="reference")[0]

    fns = {"materialized": materialized, "fused xla": fused(impl="reference")}
    if impl != "reference":
        fns[f"fused {impl}"] = fused(impl=impl, interpret=interpret)
    return {k: jax.value_and_grad(f, (0, 1)) for k, f in fns.items()}


def loss_head_table(args, impl: str, interpret: bool, repeats: int) -> None:
    """Compiled temp bytes, matmul FLOPs (jaxpr), XLA's FLOPs, largest value and (with
    repeats > 0) time of forward + backward, fused against materialized logits."""
    n, dim, vocab = args.tokens, args.dim, args.vocab
    dtype = jnp.dtype(args.dtype)
    batch, seq_len = (1, n) if n <= 32768 else (n // 32768, 32768)
    spec = (jax.ShapeDtypeStruct((batch, seq_len, dim), dtype),
            jax.ShapeDtypeStruct((dim, vocab), dtype),
            jax.ShapeDtypeStruct((batch, seq_len), jnp.int32),
            jax.ShapeDtypeStruct((batch, args.segments), jnp.int32),
            jax.ShapeDtypeStruct((batch, args.segments), jnp.int32))
    print(f"loss head: N={n} H={dim} V={vocab} {dtype.name}  backend={jax.default_backend()}  "
          f"(value_and_grad in hidden and weight; 6NHV = {6 * n * dim * vocab / 1e12:.2f} TFLOP)")
    header = (f"{'path':24} {'temp MiB':>10} {'vs mat':>7} {'matmul TFLOP':>13} {'vs mat':>7} "
              f"{'XLA TFLOP':>10} {'largest array':>14} {'ms':>9} {'vs mat':>7}")
    print(header)
    print("-" * len(header))
    base = {}
    for name, fn in loss_head_fns(impl, interpret).items():
        traced = jax.jit(fn).trace(*spec)
        compiled = traced.lower().compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        row = {"temp": compiled.memory_analysis().temp_size_in_bytes,
               "flops": matmul_flops(traced.jaxpr),
               "largest": max(int(np.prod(s)) for s, _ in jaxpr_values(traced.jaxpr))}
        row["ms"] = float("nan")
        if repeats > 0:
            meta = make_inputs(Sizes(batch, seq_len, args.segments, dim, 8, dtype), args.fill)
            key_h, key_w = jax.random.split(jax.random.key(1))
            h = jax.random.normal(key_h, spec[0].shape, dtype)
            w = (jax.random.normal(key_w, spec[1].shape, dtype) * dim**-0.5).astype(dtype)
            t = jax.random.randint(key_w, spec[2].shape, 0, vocab)
            row["ms"] = time_call(compiled, h, w, t, *meta.meta, repeats=repeats)
        base = base or row
        ratio = {k: row[k] / base[k] for k in ("temp", "flops", "ms")}
        print(f"{name:24} {row['temp'] / MIB:10.1f} {ratio['temp']:7.3f} "
              f"{row['flops'] / 1e12:13.3f} {ratio['flops']:7.3f} "
              f"{cost.get('flops', float('nan')) / 1e12:10.3f} {row['largest']:14,d} "
              f"{row['ms']:9.1f} {ratio['ms']:7.3f}")
    print("XLA TFLOP is cost_analysis(): it counts a scan body once, so it undercounts the fused "
          "path; matmul TFLOP walks the jaxpr (scan bodies times their length).")
