"""The precision of d weight summed over token chunks: a float32 carry rounded once to bf16, a
bf16 carry (each chunk's f32 product added, the sum rounded), and each chunk's gradient rounded
to bf16 and summed in bf16 (vocab tiling through autodiff with bf16 parameters). Relative RMS
error against a float64 sum of the same bf16 inputs: what carrying d weight in bf16 would cost.

    python -m benchmarks.grad_accumulation                  # N=65536 H=128 V=2048, any backend
    python -m benchmarks.grad_accumulation --smoke          # tiny, seconds

Inputs: x ~ N(0, 1) and d = (softmax(z) - onehot(t)) / N for z ~ N(0, 2), both in bf16 (a
loss head's d logits); d weight = x^T d.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import print_table


def inputs(n: int, dim: int, vocab: int, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    """x bf16[n, dim], d bf16[n, vocab]."""
    kx, kz, kt = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (n, dim), jnp.float32).astype(jnp.bfloat16)
    z = jax.random.normal(kz, (n, vocab), jnp.float32) * 2.0
    t = jax.random.randint(kt, (n,), 0, vocab)
    return x, ((jax.nn.softmax(z, axis=-1) - jax.nn.one_hot(t, vocab)) / n).astype(jnp.bfloat16)


def sums(x: jax.Array, d: jax.Array, chunk: int) -> dict[str, jax.Array]:
    """x^T d over chunks of `chunk` tokens (n a multiple of it), each way; all rounded to bf16."""
    parts = [jnp.dot(x[i:i + chunk].T, d[i:i + chunk], preferred_element_type=jnp.float32)
             for i in range(0, x.shape[0], chunk)]
    f32 = bf16 = rounded = None
    for p in parts:
        f32 = p if f32 is None else f32 + p
        bf16 = (p if bf16 is None else bf16.astype(jnp.float32) + p).astype(jnp.bfloat16)
        r = p.astype(jnp.bfloat16)
        rounded = r if rounded is None else rounded + r
    assert f32 is not None
    return {"f32 carry": f32.astype(jnp.bfloat16), "bf16 carry": bf16,
            "bf16 chunk gradients": rounded}


def table(n: int, dim: int, vocab: int, chunks: list[int]) -> list[dict]:
    """Print and return one row per chunk size: its chunk count and each way's error."""
    x, d = inputs(n, dim, vocab)
    exact = np.asarray(x, np.float64).T @ np.asarray(d, np.float64)
    scale = np.sqrt(np.mean(exact**2))

    def error(a) -> float:
        return float(np.sqrt(np.mean((np.asarray(a, np.float64) - exact) ** 2)) / scale)

    rows = []
    for c in chunks:
        row = {"chunk": c, "chunks": n // c, **{k: error(v) for k, v in sums(x, d, c).items()}}
        rows.append(row)
    print_table(f"d weight = x^T d: N={n} H={dim} V={vocab}, relative RMS error against float64 "
                f"(backend {jax.default_backend()})",
                ["C", "chunks", "f32 carry", "bf16 carry", "bf16 chunk gradients",
                 "bf16 carry / f32"],
                [[r["chunk"], r["chunks"], f"{r['f32 carry']:.2e}", f"{r['bf16 carry']:.2e}",
                  f"{r['bf16 chunk gradients']:.2e}", f"{r['bf16 carry'] / r['f32 carry']:.1f}"]
                 for r in rows])
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--chunks", type=int, nargs="*", default=[32768, 8192, 4096, 2048, 1024])
    parser.add_argument("--smoke", action="store_true", help="N=4096 H=32 V=256")
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokens, args.dim, args.vocab, args.chunks = 4096, 32, 256, [2048, 256]
    bad = [c for c in args.chunks if args.tokens % c]
    if bad:
        raise SystemExit(f"Error: --chunks {bad} do not divide --tokens {args.tokens}")
    return table(args.tokens, args.dim, args.vocab, args.chunks)


if __name__ == "__main__":
    main()
