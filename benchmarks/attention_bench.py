"""Benchmark segment attention on real packed rows: block pairs visited, time and useful TFLOP/s.

    python -m benchmarks.attention_bench          # pairs table (CPU); timings on a GPU / TPU
    python -m benchmarks.attention_bench --smoke  # tiny sizes on any backend (interpret on a CPU)
    benchmarks/device_run.sh                      # this and kernels_bench --gpu-sizes (a device)

Rows are chat_dev packed with seqpack.packer (best-fit decreasing, long examples split) at each
`--seq-lens`. Pairs table, per block size b (bq = bk = b), means per row:
- visited: (query block, key block) pairs the kernels compute (attention_schedule: the ranges);
- bound: sum over segments of m(m + 1) / 2, m = blocks a segment touches;
- triangle: nq(nq + 1) / 2, what a masked kernel computes (splash with segment ids, jax's Pallas
  GPU attention, cuDNN with a mask); `x fewer`: triangle / visited;
- used: useful (query, key) entries over the b^2 entries of the visited pairs;
- TPU copies: key blocks the TPU forward fetches per row and head (host replay of its index map).
Timings (a GPU or TPU, or --smoke): fwd and fwd + bwd of `B` rows sampled from the packing
(seeded), ms (median) and TFLOP/s of the USEFUL work only, 4 D H sum_l l(l + 1) / 2 forward and
2.5x that backward, the same count for every row, so rates compare like with like; against
on a GPU: seqpack's default (impl="auto") and its Triton kernels at each --gpu-blocks, cuDNN's
packed layout (impl="cudnn": the family, guarded), the masked kernels MaxText runs (tokamax's
Triton kernel with the dense segment mask where tokamax imports, jax.nn's cuDNN with the mask,
jax's Pallas GPU attention with segment_ids), and cuDNN's dense causal attention ignoring the
segments, the upper bound (its rate counted on its own work, the whole triangle); then the XLA
rows, one batch row at a time (lax.map: [H, L, L] scores per row). The PyTorch rows
(FlexAttention's document mask, varlen_attn) on the same rows: benchmarks/torch_peers.py.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (
    BLOCK_OPTIONS,
    DATA,
    attention_blocks,
    packed_rows,
    picked_rows,
    print_table,
)
from benchmarks.kernels_bench import time_call
from examples.masked import dense_segment_mask, masked_attention, tokamax_available
from seqpack import kernels
from seqpack.kernels import attention_schedule as sched

PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12}  # dense bf16 FLOP/s
FULL = dict(batch=8, seq_len=8192, heads=32, kv_heads=8, head_dim=128, dtype="bfloat16")
SMOKE = dict(batch=2, seq_len=256, heads=4, kv_heads=2, head_dim=32, dtype="float32")


@functools.partial(jax.jit, static_argnames=("seq_len", "block"))
def _ranges(offsets, lengths, *, seq_len, block):
    nb = -(-seq_len // block)
    start, end = sched.token_bounds(offsets, lengths, seq_len, nb * block)
    return sched.block_ranges(start, end, block_q=block, block_kv=block, num_q_blocks=nb,
                              causal=True)


def pairs_rows(offsets, lengths, seq_len: int, blocks: list[int]) -> list[list]:
    lengths64 = lengths.astype(np.int64)
    useful = (lengths64 * (lengths64 + 1) // 2).sum(axis=1)  # causal (query, key) entries
    out = []
    for b in blocks:
        lo, hi = (np.asarray(x) for x in _ranges(offsets, lengths, seq_len=seq_len, block=b))
        visited = sched.visited_pairs(lo, hi)
        bound = sched.pair_bound(offsets, lengths, block=b, causal=True)
        tri = sched.causal_triangle(seq_len, b)
        nb = -(-seq_len // b)
        copies = np.concatenate([sched.fetched_blocks(lo[i:i + 64], hi[i:i + 64], nb)
                                 for i in range(0, len(lo), 64)]) if nb <= 256 else None
        out.append([seq_len, b, len(lo), f"{(lengths > 0).sum(1).mean():.1f}",
                    f"{visited.mean():.0f}", f"{bound.mean():.0f}", tri,
                    f"{visited.mean() / tri:.1%}", f"{tri / visited.mean():.1f}x",
                    f"{useful.sum() / (visited.sum() * b * b):.1%}",
                    "-" if copies is None else f"{copies.mean():.0f}"])
    return out


def random_qkv(sizes: dict):
    """q, k, v and the output cotangent g: normal, in the benchmark dtype."""
    batch, seq_len = sizes["batch"], sizes["seq_len"]
    dtype = jnp.dtype(sizes["dtype"])
    keys = jax.random.split(jax.random.key(0), 4)
    shape = lambda n: (batch, seq_len, n, sizes["head_dim"])  # noqa: E731
    q = jax.random.normal(keys[0], shape(sizes["heads"]), dtype)
    k = jax.random.normal(keys[1], shape(sizes["kv_heads"]), dtype)
    v = jax.random.normal(keys[2], shape(sizes["kv_heads"]), dtype)
    return q, k, v, jax.random.normal(keys[3], q.shape, dtype)


def per_row(fn):
    """fn(q, k, v, offsets, lengths) one batch row at a time (lax.map): bounded memory."""
    def run(q, k, v, offsets, lengths):
        one = lambda args: fn(*(a[None] for a in args))[0]  # noqa: E731
        return jax.lax.map(one, (q, k, v, offsets, lengths))

    return run


def _segment_ids(offsets, lengths, seq_len):  # i32[B, L]: 1..n, 0 outside segments
    ids = kernels.reference.segment_index(offsets, lengths, seq_len)
    return jnp.where(ids < offsets.shape[1], ids + 1, 0)


def _mask(offsets, lengths, seq_len):  # bool[B, 1, L, L]: same segment, causal applied apart
    return dense_segment_mask(_segment_ids(offsets, lengths, seq_len))


def _dpa(implementation):
    def run(q, k, v, offsets, lengths):
        return jax.nn.dot_product_attention(q, k, v, mask=_mask(offsets, lengths, q.shape[1]),
                                            is_causal=True, implementation=implementation)

    return run


class Dense(NamedTuple):
    """A row that ignores the segments (the dense causal bound): its rate counts its own work,
    the whole causal triangle of every row."""

    fn: Callable


def _dense_cudnn(q, k, v, offsets, lengths):
    del offsets, lengths
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def _masked(interpret: bool):
    """MaxText's GPU attention (examples/masked.py) on the rows' segment ids."""
    def run(q, k, v, offsets, lengths):
        ids = _segment_ids(offsets, lengths, q.shape[1])
        return masked_attention(q, k, v, ids, interpret=interpret)

    return run


class BHLD(NamedTuple):
    """An implementation that reads q, k, v as [B, H, L, D] (transposed before timing)."""

    fn: Callable


def _splash(q, k, v, offsets, lengths):  # [B, H, L, D]: MaxText's way on packed rows
    from examples.splash import splash_attention

    return splash_attention(q, k, v, _segment_ids(offsets, lengths, q.shape[2]))


def tpu_options(spec: str) -> kernels.AttentionBlockSizes:
    """'unfused+w16' -> the default AttentionBlockSizes with those options
    (common.BLOCK_OPTIONS); SystemExit naming an unknown one."""
    return _blocks(spec, kernels.AttentionBlockSizes())


def _blocks(spec: str, base):
    try:
        return attention_blocks(spec, base)
    except ValueError as e:
        raise SystemExit(f"Error: {e}") from None


def implementations(backend: str, sizes: dict, *, gpu_blocks, tpu_blocks, tpu_opts=()) -> dict:
    """name -> fn(q, k, v, offsets, lengths): seqpack first (the rate others compare to)."""
    impls = {}
    on_cpu = backend not in ("gpu", "tpu")
    if backend == "tpu":
        for spec in tpu_blocks:
            blocks = _blocks(spec, kernels.AttentionBlockSizes())
            impls[f"seqpack pallas_tpu {spec}"] = functools.partial(
                kernels.segment_attention, impl="pallas_tpu", block_sizes=blocks)
        impls["seqpack pallas_tpu defaults, bhld"] = BHLD(functools.partial(
            kernels.segment_attention, layout="bhld"))
        for spec in tpu_opts:
            impls[f"seqpack pallas_tpu defaults + {spec}, bhld"] = BHLD(functools.partial(
                kernels.segment_attention, layout="bhld", block_sizes=tpu_options(spec)))
        impls["splash 512 (segment ids), bhld"] = BHLD(_splash)
    else:
        for spec in gpu_blocks[:1] if on_cpu else gpu_blocks:
            blocks = _blocks(spec, kernels.GpuAttentionBlockSizes())
            impls[f"seqpack pallas_gpu {spec}"] = functools.partial(
                kernels.segment_attention, impl="pallas_gpu", interpret=on_cpu,
                block_sizes=blocks)
    if backend == "gpu":
        impls["seqpack default (impl='auto')"] = kernels.segment_attention
        impls["cudnn packed (impl='cudnn')"] = functools.partial(kernels.segment_attention,
                                                                 impl="cudnn")
        impls["masked: jax.nn dpa cudnn (dense mask)"] = _dpa("cudnn")
    if backend != "tpu":
        name = ("tokamax triton (dense mask)" if tokamax_available() and not on_cpu
                else "jax pallas gpu mha (ids)")
        impls[f"masked: {name}"] = _masked(on_cpu)
    if backend == "gpu":
        impls["bound: cudnn dense causal (no packing)"] = Dense(_dense_cudnn)
    impls["jax.nn dpa xla (mask, per row)"] = per_row(_dpa("xla"))
    impls["XLA reference (per row)"] = per_row(kernels.reference.segment_attention)
    return impls


def _peak() -> float | None:
    kind = jax.devices()[0].device_kind
    return next((p for name, p in PEAK_BF16.items() if name in kind), None)


def timing_rows(impls: dict, q, k, v, g, offsets, lengths, repeats: int) -> list[list]:
    lengths64 = np.asarray(lengths).astype(np.int64)
    useful = 4 * q.shape[2] * q.shape[3] * float((lengths64 * (lengths64 + 1) // 2).sum())
    dense = 4 * q.shape[2] * q.shape[3] * q.shape[0] * q.shape[1] * (q.shape[1] + 1) / 2
    peak = _peak()
    inside = np.asarray(kernels.reference.segment_index(offsets[:1], lengths[:1], q.shape[1]))
    inside = (inside < offsets.shape[1])[0]
    want = np.asarray(per_row(kernels.reference.segment_attention)(
        q[:1], k[:1], v[:1], offsets[:1], lengths[:1]), np.float32)[0][inside]
    rows, base = [], None
    heads_second = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    for name, fwd in impls.items():
        fwd_flops = dense if isinstance(fwd, Dense) else useful
        both_flops = 3.5 * fwd_flops
        try:
            bhld = isinstance(fwd, BHLD)
            fn = fwd.fn if isinstance(fwd, BHLD | Dense) else fwd
            args = tuple(map(heads_second, (q, k, v, g))) if bhld else (q, k, v, g)
            # the metadata is an argument: the schedule is computed at run time, as in training
            f = jax.jit(fn)
            loss = lambda q, k, v, o, n, g, f=f: jnp.sum(  # noqa: E731
                f(q, k, v, o, n).astype(jnp.float32) * g)
            both = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            t_fwd = time_call(f, *args[:3], offsets, lengths, repeats=repeats)
            t_both = time_call(both, *args[:3], offsets, lengths, args[3], repeats=repeats)
            got = f(*args[:3], offsets, lengths)
            got = np.asarray((heads_second(got) if bhld else got)[:1], np.float32)
            err = (float("nan") if isinstance(fwd, Dense) else  # other work: no comparison
                   float(np.abs(got[0][inside] - want).max() / max(np.abs(want).max(), 1e-30)))
        except Exception as e:  # an alternative this backend / jax lacks: say why, go on
            rows.append([name, "-", "-", "-", "-", "-", "-", f"{type(e).__name__}: "
                         f"{str(e).splitlines()[0][:60] if str(e) else ''}"])
            continue
        base = base or t_both
        rows.append([name, f"{t_fwd:.3f}", f"{t_both:.3f}", f"{fwd_flops / t_fwd / 1e9:.3g}",
                     f"{both_flops / t_both / 1e9:.3g}",
                     "-" if peak is None else f"{both_flops / (t_both * 1e-3) / peak:.0%}",
                     f"{t_both / base:.2f}x", f"{err:.1e}"])
    return rows


def targets(rows: list[list]) -> list[str]:
    """Issue 64's ratios from the timing rows (fwd+bwd ms; TFLOP/s for the dense bound)."""
    time = {r[0]: float(r[2]) for r in rows if r[2] != "-"}
    rate = {r[0]: float(r[4]) for r in rows if r[4] != "-"}
    masked = min((t for name, t in time.items() if name.startswith("masked")), default=None)
    cudnn = time.get("cudnn packed (impl='cudnn')")
    bound = next((r for name, r in rate.items() if name.startswith("bound")), None)
    out = []
    for name in [n for n in time if n.startswith("seqpack")]:
        parts = [f"{name}:"]
        if masked:
            parts.append(f"{masked / time[name]:.2f}x the fastest masked kernel")
        if cudnn:
            parts.append(f"{cudnn / time[name]:.2f}x cuDNN packed")
        if bound:
            parts.append(f"{rate[name] / bound:.0%} of dense causal cuDNN's TFLOP/s")
        out.append(" ".join(parts[:1]) + " " + ", ".join(parts[1:]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DATA / "chat_dev.npz"))
    parser.add_argument("--smoke", action="store_true", help=f"tiny sizes: {SMOKE}")
    parser.add_argument("--seq-lens", default=None, help="pairs table L's (default 8192,32768)")
    parser.add_argument("--blocks", default="64,128,256,512", help="pairs table block sizes")
    parser.add_argument("--no-timing", action="store_true", help="the pairs table only")
    parser.add_argument("--gpu-blocks", nargs="*", default=["64,64,64,64", "128,64,64,64"],
                        help="GpuAttentionBlockSizes to time: bq,bk,bq_bwd,bk_bwd each")
    parser.add_argument("--tpu-blocks", nargs="*", default=["256,256,256,256", "512,512,256,256"])
    parser.add_argument("--tpu-options", nargs="*", default=["unfused", "wfull"],
                        help=f"rows of the defaults with options, {BLOCK_OPTIONS}")
    parser.add_argument("--repeats", type=int, default=None, help="default 10, CPU 2")
    for key, value in FULL.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None)
    args = parser.parse_args()
    try:  # interpret-mode callbacks dispatch jax ops: inline CPU dispatch avoids a deadlock
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    except AttributeError:  # an option this jax does not have
        pass
    for spec in args.tpu_options:  # refused before anything runs
        tpu_options(spec)
    sizes = {k: getattr(args, k) or (SMOKE if args.smoke else FULL)[k] for k in FULL}
    limit = 3000 if args.smoke else None
    seq_lens = [int(x) for x in (args.seq_lens or ("512,2048" if args.smoke else "8192,32768"))
                .split(",")]
    blocks = [int(x) for x in args.blocks.split(",")]
    print(f"corpus {args.data}{f' (first {limit} examples)' if limit else ''}; causal")
    table = []
    for seq_len in seq_lens:
        offsets, lengths = packed_rows(args.data, seq_len, limit)
        table += pairs_rows(offsets, lengths, seq_len, [b for b in blocks if b <= seq_len])
    print_table("Block pairs per row (bq = bk = b): visited by segment_attention vs the causal "
                "triangle", ["L", "b", "rows", "segments", "visited", "bound", "triangle",
                             "visited/tri", "x fewer", "used", "TPU copies"], table)

    backend = jax.default_backend()
    if args.no_timing or (backend not in ("gpu", "tpu") and not args.smoke):
        print(f"\nNo timings: backend {backend!r} (use --smoke for a CPU run at tiny sizes).")
        return
    pick, offsets, lengths = picked_rows(args.data, sizes["seq_len"], sizes["batch"], limit)
    q, k, v, g = random_qkv(sizes)
    impls = implementations(backend, sizes, gpu_blocks=args.gpu_blocks,
                                tpu_blocks=args.tpu_blocks,
                                tpu_opts=args.tpu_options)
    on_cpu = backend not in ("gpu", "tpu")
    device = jax.devices()[0].device_kind
    print(f"\nbackend={backend} device={device} B={sizes['batch']} L={sizes['seq_len']} "
          f"H={sizes['heads']} K={sizes['kv_heads']} D={sizes['head_dim']} {sizes['dtype']}; "
          f"rows {pick.tolist()}, {int((lengths > 0).sum())} segments"
          + ("; INTERPRET MODE: times are not performance figures" if on_cpu else ""))
    rows = timing_rows(impls, q, k, v, g, jnp.asarray(offsets), jnp.asarray(lengths),
                       args.repeats or (2 if on_cpu else 10))
    print_table("segment attention, useful FLOPs only (vs seqpack: fwd+bwd time over the first "
                "row's; err: forward, row 0, vs the reference)",
                ["impl", "fwd ms", "fwd+bwd ms", "fwd TFLOP/s", "fwd+bwd TFLOP/s", "% peak",
                 "vs seqpack", "err"], rows)
    if not on_cpu:
        print("\n" + "\n".join(targets(rows)))

if __name__ == "__main__":
    main()
