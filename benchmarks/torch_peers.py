"""The PyTorch peers of seqpack's GPU benchmarks, on the same rows and sizes, in their own process.

    python -m benchmarks.torch_peers attention [--seq-len 8192 --batch 4 --heads 8 --kv-heads 8]
    python -m benchmarks.torch_peers loss-head --preset 16k
    python -m benchmarks.torch_peers attention --smoke   # tiny sizes on the CPU (runs, no times)

Run after the JAX benchmark has released the GPU (benchmarks/device_run.sh does). Imports numpy,
torch and seqpack.packer only (no jax).

attention: the rows attention_bench times (benchmarks.common.picked_rows: chat_dev packed at L,
the same seeded draw), q / k / v normal in bf16, [B, L, H, D]:
- FlexAttention with a document mask (segment ids, causal): its BlockMask skips the blocks of no
  document; built once per batch outside the timing (a model reuses it in every layer);
- `torch.nn.attention.varlen.varlen_attn` (FlashAttention-2 on the packed tokens: the rows'
  live tokens gathered, cumulative lengths; the gather and scatter back are timed with it);
- SDPA with the dense mask (math: what a masked kernel computes), for the error column only.
Rates count the useful work, 4 D H sum_l l(l + 1) / 2 forward and 3.5x that fwd+bwd, as
attention_bench does, so its rows and these compare.

loss-head: N tokens of hidden [N, H] bf16, weight [V, H] bf16, targets uniform: the materialized
head (bf16 logits, f32 cross-entropy), Liger's fused linear cross-entropy with fp32 and with
bf16 d-weight accumulation (`accum_dtype`), Cut Cross-Entropy (`linear_cross_entropy`, impl
"cce"). Time of fwd+bwd (median), peak memory beyond the inputs (torch.cuda.max_memory_allocated
over what was allocated before), TFLOP/s on 6NHV. Liger and CCE travel as wheels
(benchmarks/device_wheels.sh --gpu); a row whose library is missing says so.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
from collections.abc import Callable

import numpy as np

from benchmarks.common import DATA, LOSS_HEAD_PRESETS, picked_rows, print_table

MIB = 2**20


def _timed(fn: Callable[[], object], repeats: int, device) -> float:
    """Median ms of `repeats` calls after one warm-up (CUDA events; wall time on the CPU)."""
    import time

    import torch

    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def document_ids(offsets: np.ndarray, lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """i32[B, L]: 1 + the slot of each token's segment, 0 outside every segment."""
    ids = np.zeros((len(offsets), seq_len), np.int32)
    for r, (offs, lens) in enumerate(zip(offsets, lengths)):
        for s, (o, n) in enumerate(zip(offs, lens)):
            ids[r, o:o + n] = s + 1
    return ids


def _flex(torch, doc, heads: tuple[int, int]):
    """FlexAttention with the rows' document mask, causal (heads: query and key/value heads)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    batch, seq_len = doc.shape
    gqa = heads[0] != heads[1]

    def mask_mod(b, h, q, k):
        return (doc[b, q] == doc[b, k]) & (doc[b, q] > 0) & (q >= k)

    block_mask = create_block_mask(mask_mod, batch, None, seq_len, seq_len, device=doc.device)
    flex = torch.compile(flex_attention) if doc.device.type == "cuda" else flex_attention

    def run(q, k, v):
        o = flex(*(x.transpose(1, 2) for x in (q, k, v)), block_mask=block_mask, enable_gqa=gqa)
        return o.transpose(1, 2)

    return run


def _varlen(torch, offsets, lengths, seq_len, heads, kv_heads):
    from torch.nn.attention.varlen import varlen_attn

    rows, slots = np.nonzero(lengths)
    starts = rows * seq_len + offsets[rows, slots]
    n = lengths[rows, slots]
    index = torch.as_tensor(np.concatenate([np.arange(s, s + m) for s, m in zip(starts, n)]))
    cu = torch.as_tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32)
    params = inspect.signature(varlen_attn).parameters
    options = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    repeat = kv_heads != heads and "enable_gqa" not in params
    if "enable_gqa" in params:
        options["enable_gqa"] = kv_heads != heads

    def run(q, k, v):
        index_, cu_ = index.to(q.device), cu.to(q.device)
        if repeat:
            k, v = (x.repeat_interleave(heads // kv_heads, dim=2) for x in (k, v))
        flat = [x.reshape(-1, *x.shape[2:])[index_] for x in (q, k, v)]
        o = varlen_attn(*flat, cu_, cu_, int(n.max()), int(n.max()), **options)
        out = torch.zeros(q.shape[0] * seq_len, heads, q.shape[3], dtype=q.dtype, device=q.device)
        return out.index_copy(0, index_, o).reshape(q.shape)

    return run


def _masked_reference(torch, doc):
    def run(q, k, v):
        pos = torch.arange(doc.shape[1], device=doc.device)
        mask = (doc[:, :, None] == doc[:, None, :]) & (doc[:, :, None] > 0) & (
            pos[:, None] >= pos[None, :])
        groups = q.shape[2] // k.shape[2]
        k, v = (x.repeat_interleave(groups, dim=2) for x in (k, v))
        o = torch.nn.functional.scaled_dot_product_attention(
            *(x.transpose(1, 2).float() for x in (q, k, v)), attn_mask=mask[:, None])
        return torch.nan_to_num(o.transpose(1, 2)) * (doc > 0)[:, :, None, None]

    return run


def attention(args) -> None:
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    limit = 3000 if args.smoke else None
    pick, offsets, lengths = picked_rows(args.data, args.seq_len, args.batch, limit)
    heads, kv_heads, dim, seq_len = args.heads, args.kv_heads, args.head_dim, args.seq_len
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    shape = lambda n: (args.batch, seq_len, n, dim)  # noqa: E731
    q, k, v = (torch.randn(shape(n), generator=gen).to(device, dtype).requires_grad_()
               for n in (heads, kv_heads, kv_heads))
    g = torch.randn(q.shape, generator=gen).to(device, dtype)
    fixed = [x.detach() for x in (q, k, v)]  # the forward alone: no autograd graph
    doc = torch.as_tensor(document_ids(offsets, lengths, seq_len), device=device)
    lengths64 = lengths.astype(np.int64)
    fwd_flops = 4 * heads * dim * float((lengths64 * (lengths64 + 1) // 2).sum())
    with torch.no_grad():
        want = _masked_reference(torch, doc[:1])(q[:1], k[:1], v[:1]).float()
    impls = {"torch flex_attention (document mask)": lambda: _flex(torch, doc, (heads, kv_heads)),
             "torch varlen_attn (FA2, packed tokens)": lambda: _varlen(
                 torch, offsets, lengths, seq_len, heads, kv_heads)}
    rows = []
    for name, make in impls.items():
        row = [name, "-", "-", "-", "-", "-"]
        try:  # a peer this torch or device lacks: say why, go on
            fn = make()
            with torch.no_grad():
                got = fn(*fixed)[:1].float()
                t_fwd = _timed(lambda fn=fn: fn(*fixed), args.repeats, device)
            row[5] = f"{float((got - want).abs().max() / want.abs().max().clamp_min(1e-30)):.1e}"
            row[1], row[3] = f"{t_fwd:.3f}", f"{fwd_flops / t_fwd / 1e9:.3g}"
            t_both = _timed(lambda fn=fn: torch.autograd.grad(
                (fn(q, k, v).float() * g).sum(), (q, k, v)), args.repeats, device)
            row[2], row[4] = f"{t_both:.3f}", f"{3.5 * fwd_flops / t_both / 1e9:.3g}"
        except Exception as e:  # noqa: BLE001
            row[5] += f"; {type(e).__name__}: {str(e)[:60]}"
        rows.append(row)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__} on {name}: B={args.batch} L={seq_len} H={heads} "
          f"K={kv_heads} D={dim} bfloat16; rows {pick.tolist()}, {int((lengths > 0).sum())} "
          "segments" + ("; CPU: times are not performance figures" if device.type != "cuda"
                        else ""))
    print_table("segment attention in PyTorch, useful FLOPs only (err: forward, row 0, vs SDPA "
                "with the dense mask)", ["impl", "fwd ms", "fwd+bwd ms", "fwd TFLOP/s",
                                         "fwd+bwd TFLOP/s", "err"], rows)


def _loss_heads(torch) -> dict[str, Callable]:
    def materialized(h, w, t):
        return torch.nn.functional.cross_entropy((h @ w.T).float(), t)

    def liger(accum):
        from liger_kernel.transformers.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyLoss,
        )
        loss = LigerFusedLinearCrossEntropyLoss(accum_dtype=accum)
        return lambda h, w, t: loss(w, h, t)

    def cce(h, w, t):
        from cut_cross_entropy import linear_cross_entropy
        return linear_cross_entropy(h, w, t, impl="cce")

    return {"torch materialized logits": lambda: materialized,
            "liger fused linear CE (fp32 accum)": lambda: liger(torch.float32),
            "liger fused linear CE (bf16 accum)": lambda: liger(None),
            "cut cross-entropy (cce)": lambda: cce}


def loss_head(args) -> None:
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokens, dim, vocab = (512, 64, 1000) if args.smoke else LOSS_HEAD_PRESETS[args.preset]
    gen = torch.Generator().manual_seed(0)
    hidden = (torch.randn(tokens, dim, generator=gen) * dim**-0.5).to(device, torch.bfloat16)
    weight = (torch.randn(vocab, dim, generator=gen) * dim**-0.5).to(device, torch.bfloat16)
    targets = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    hidden.requires_grad_(), weight.requires_grad_()
    flops = 6 * tokens * dim * vocab
    rows = []
    for name, make in _loss_heads(torch).items():
        try:
            fn = make()
            step = lambda fn=fn: torch.autograd.grad(fn(hidden, weight, targets), (hidden, weight))  # noqa: E731
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                step()
                torch.cuda.synchronize()
                peak = f"{(torch.cuda.max_memory_allocated() - before) / MIB:,.0f}"
            else:
                peak = "-"
            ms = _timed(step, args.repeats, device)
        except Exception as e:  # noqa: BLE001 (a library missing here: say why, go on)
            rows.append([name, "-", "-", "-", f"{type(e).__name__}: {str(e)[:60]}"])
            continue
        rows.append([name, f"{ms:.2f}", peak, f"{flops / ms / 1e9:.0f}", ""])
    print(f"torch {torch.__version__}: N={tokens} H={dim} V={vocab} bf16 hidden and weight")
    print_table("loss head in PyTorch, fwd+bwd (peak MiB: beyond the inputs)",
                ["impl", "ms", "peak MiB", "TFLOP/s (6NHV)", "note"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["attention", "loss-head"])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (any device)")
    parser.add_argument("--data", default=str(DATA / "chat_dev.npz"))
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--preset", choices=sorted(LOSS_HEAD_PRESETS), default="16k")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if args.smoke:
        args.seq_len, args.batch, args.heads, args.kv_heads, args.head_dim = 256, 2, 4, 2, 32
        args.repeats = 1
    try:
        import torch  # noqa: F401
    except ImportError:
        print("torch is not importable here: the PyTorch peers are skipped")
        return
    (attention if args.what == "attention" else loss_head)(args)


if __name__ == "__main__":
    main()
