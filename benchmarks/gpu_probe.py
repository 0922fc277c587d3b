"""Run each of seqpack's GPU kernels once, forward and backward, on packed rows: the program that
device_run.sh hands to compute-sanitizer (out-of-bounds and misaligned accesses of the Triton
kernels' masked loads and stores) and to Nsight Compute (where the attention kernels' time goes).

    python -m benchmarks.gpu_probe --data chat_dev.npz                  # every kernel, small sizes
    python -m benchmarks.gpu_probe --data chat_dev.npz --only attention --seq-len 8192 --batch 4
    python -m benchmarks.gpu_probe --smoke                              # any machine (interpret)

Rows come from the corpus packed at L (benchmarks.common.picked_rows: the same rows as the
attention benchmarks), or from a fixed synthetic packing without --data. Each kernel runs
`--runs` times (the profiler skips the first, compiled, launches) and prints "ok <name>" with a
finite checksum; an exception ends the program with its name.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import picked_rows
from seqpack import kernels


def synthetic_rows(seq_len: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, lengths) i32[B, 8]: segments of a few lengths, a short and a long one each row,
    and padding at the end (the row contract), when no corpus is given."""
    offsets, lengths = np.zeros((batch, 8), np.int32), np.zeros((batch, 8), np.int32)
    for r in range(batch):
        sizes = [seq_len // 2 - 3 - r, 1, seq_len // 4 + 5, 17]
        at = 0
        for s, n in enumerate(sizes):
            n = min(n, seq_len - at)
            offsets[r, s], lengths[r, s] = at, n
            at += n
        offsets[r, len(sizes):] = at
    return offsets, lengths


def probes(offsets, lengths, seq_len: int, *, heads: int, kv_heads: int, head_dim: int,
           dim: int, vocab: int, interpret: bool) -> dict:
    """{name: (jitted fn, a thunk making its inputs)}: value and gradients of each GPU kernel
    family; the inputs are made only for the probes that run."""
    batch = offsets.shape[0]
    key = jax.random.key(0)

    def normal(seed: int, *shape):
        return jax.random.normal(jax.random.fold_in(key, seed), shape, jnp.bfloat16)

    o, n = jnp.asarray(offsets), jnp.asarray(lengths)
    kw = dict(impl="pallas_gpu", interpret=interpret)
    grad = lambda f, argnums=0: jax.jit(jax.value_and_grad(  # noqa: E731
        lambda *a: f(*a).astype(jnp.float32).sum(), argnums=argnums))
    targets = jax.random.randint(jax.random.fold_in(key, 0), (batch, seq_len), 0, vocab)
    x = lambda: (normal(3, batch, seq_len, dim),)  # noqa: E731
    return {
        "attention": (grad(lambda q, k, v: kernels.segment_attention(q, k, v, o, n, **kw),
                           (0, 1, 2)),
                      lambda: (normal(1, batch, seq_len, heads, head_dim),
                               *[normal(2, batch, seq_len, kv_heads, head_dim)] * 2)),
        "segment_sum": (grad(lambda x: kernels.segment_sum(x, o, n, **kw)), x),
        "segment_max": (grad(lambda x: kernels.segment_max(x, o, n, **kw)), x),
        "segment_broadcast": (grad(lambda x: kernels.segment_broadcast(
            kernels.segment_mean(x, o, n, **kw), o, n, seq_len=seq_len, **kw)), x),
        "segment_gather": (grad(lambda x: kernels.segment_gather(x, o, n, **kw)), x),
        "cross_entropy": (grad(lambda z: kernels.segment_cross_entropy(
            z, targets, o, n, **kw)[0]), lambda: (normal(4, batch, seq_len, vocab),)),
        "loss_head": (grad(lambda h, w: kernels.segment_linear_cross_entropy(
            h, w, targets, o, n, mode="recompute", **kw)[0], (0, 1)),
            lambda: (*x(), normal(5, dim, vocab))),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", help="a token corpus (.npz: tokens, offsets); else synthetic")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dim", type=int, default=512, help="hidden size (segment ops, loss)")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--only", nargs="*", help="probe names (default: all)")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, interpret mode")
    args = parser.parse_args(argv)
    if args.smoke:
        args.seq_len, args.batch, args.heads, args.kv_heads = 64, 2, 2, 1
        args.head_dim, args.dim, args.vocab, args.runs = 16, 32, 64, 1
    if args.data:
        _, offsets, lengths = picked_rows(args.data, args.seq_len, args.batch)
    else:
        offsets, lengths = synthetic_rows(args.seq_len, args.batch)
    found = probes(offsets, lengths, args.seq_len, heads=args.heads, kv_heads=args.kv_heads,
                   head_dim=args.head_dim, dim=args.dim, vocab=args.vocab,
                   interpret=args.smoke or jax.default_backend() != "gpu")
    unknown = set(args.only or ()) - set(found)
    if unknown:
        raise SystemExit(f"Error: unknown probes {sorted(unknown)}; choose from {sorted(found)}")
    print(f"== jax {jax.__version__} {jax.devices()[0].device_kind}; B={args.batch} "
          f"L={args.seq_len} segments={int((lengths > 0).sum())}")
    for name, (fn, make_inputs) in found.items():
        if args.only and name not in args.only:
            continue
        inputs = make_inputs()
        for _ in range(args.runs):
            value, grads = jax.block_until_ready(fn(*inputs))
        total = float(value) + sum(float(jnp.sum(g.astype(jnp.float32)))
                                   for g in jax.tree.leaves(grads))
        if not np.isfinite(total):
            raise SystemExit(f"Error: probe {name} gave a non-finite value or gradient")
        print(f"ok {name} {total:.6g}")


if __name__ == "__main__":
    main()
