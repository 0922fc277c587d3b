"""Benchmark a transformer training step (value_and_grad) on packed rows against MaxText's way.

    python -m benchmarks.train_step                      # L=8192, 32,768 slots a step (a TPU)
    python -m benchmarks.train_step --seq-len 32768 --rope interleaved --profile
    python -m benchmarks.train_step --smoke              # tiny sizes on a CPU, in seconds

One process, one model (examples/lm.py: d=1024, 8 heads of 128, gated MLP 4096, vocab 32,768,
4 layers, bf16 compute), the same examples (chat_dev, packed at --seq-len by seqpack.packer;
long examples split) fed three ways:
- padded: one example a row, rows bucketed to the step's longest (powers of two from 512),
  --tokens slots a step; splash attention (causal) + materialized logits;
- maxtext: packed rows; splash attention with segment ids + materialized logits (MaxText);
- seqpack: packed rows; kernels.segment_attention + kernels.segment_linear_cross_entropy, all
  defaults (the variant a user gets who passes nothing).
On a GPU (GPU_BASE): padded rows through cuDNN with each row's length; maxtext: MaxText's GPU
flash kernel masking the segments (examples/masked.py); cudnn: packed rows through cuDNN's packed
layout (segment_attention(impl="cudnn")); all three with materialized logits.
Extra variants (--variants seqpack+b512+bhld, ...) isolate one change each. Real tokens/s
counts tokens inside segments, the same examples for every variant. --profile prints device
time by XLA op (jax.profiler trace, parsed in process) for each variant.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import numpy as np

from benchmarks.common import BLOCK_OPTIONS, DATA, attention_blocks, print_table
from benchmarks.profile import profile_ops
from examples import lm
from seqpack import kernels
from seqpack.packer import PackConfig, pack_ragged

MODEL = dict(vocab=32768, dim=1024, heads=8, head_dim=128, mlp=4096, layers=4)
SMOKE_MODEL = dict(vocab=512, dim=128, heads=2, head_dim=128, mlp=256, layers=1)
PADDED_BUCKET = 512  # the shortest padded row; longer buckets double


BASE = {
    "padded": ("padded", dict(attention="splash", segment_ids=False, loss="materialized")),
    "maxtext": ("packed", dict(attention="splash", loss="materialized")),
    "seqpack": ("packed", dict()),
}
GPU_BASE = {  # the same ways on a GPU: cuDNN for padded rows, MaxText's masked flash kernel
    "padded": ("padded", dict(attention="cudnn", segment_ids=False, loss="materialized")),
    "maxtext": ("packed", dict(attention="masked", loss="materialized")),
    "cudnn": ("packed", dict(attention="cudnn", loss="materialized")),  # cuDNN packed layout
    "seqpack": ("packed", dict()),
}
OPTIONS = "seqpack options, joined by '+': logits (materialized loss), bhld (layout), f32 " \
    f"(the fused head's logits in float32), and the attention kernels' {BLOCK_OPTIONS}"


def variant(name: str, backend: str | None = None) -> tuple[str, dict]:
    """'seqpack+b512+bhld' -> (rows, LMConfig overrides): one change from a base each (the
    bases of `backend`, default jax's: GPU_BASE on a GPU, else BASE)."""
    bases = GPU_BASE if (backend or jax.default_backend()) == "gpu" else BASE
    base, *opts = name.split("+")
    if base not in bases or (opts and base != "seqpack"):
        raise SystemExit(f"Error: unknown variant {name!r}: {list(bases)}; {OPTIONS}")
    rows, overrides = bases[base]
    overrides = dict(overrides)
    model = {"logits": ("loss", "materialized"), "bhld": ("attention_layout", "bhld"),
             "f32": ("loss_logits_dtype", "float32")}
    overrides.update(model[opt] for opt in opts if opt in model)
    defaults = (kernels.GpuAttentionBlockSizes() if bases is GPU_BASE
                else kernels.AttentionBlockSizes())
    try:  # the rest: the attention kernels' block sizes and options
        blocks = attention_blocks([o for o in opts if o not in model], defaults)
    except ValueError as e:
        raise SystemExit(f"Error: {e} (in {name!r}; {OPTIONS})") from None
    if blocks != defaults:
        overrides["attention_block_sizes"] = blocks
    return rows, overrides


DEFAULT_VARIANTS = "padded,maxtext,seqpack"


def load_examples(path: str, need_tokens: int, seq_len: int):
    """(tokens, offsets) of the corpus' first examples holding ~need_tokens, pieces <= seq_len."""
    z = np.load(path)
    tokens, offsets = z["tokens"], z["offsets"].astype(np.int64)
    n = int(np.searchsorted(offsets, need_tokens)) + 1
    n = min(n, offsets.size - 1)
    return tokens[: offsets[n]], offsets[: n + 1]


def packed_steps(tokens, offsets, seq_len: int, rows_per_step: int, steps: int):
    """Packed batches (numpy dicts, the model's keys) and the examples they hold."""
    cfg = PackConfig(seq_len, max_segments=max(seq_len // 32, 16), overflow="split")
    b = pack_ragged(tokens, offsets, cfg)
    fullest = np.argsort(-b["tokens_segment_lengths"].sum(1), kind="stable")
    rows = np.sort(fullest[: rows_per_step * steps])
    if rows.size < rows_per_step * steps:
        raise ValueError(f"the corpus packs into {rows.size} rows: fewer than {steps} steps of "
                         f"{rows_per_step}; pass fewer --steps")
    out = []
    for s in range(steps):
        r = rows[s * rows_per_step:(s + 1) * rows_per_step]
        out.append(dict(tokens=b["tokens"][r], segment_ids=b["tokens_segment_ids"][r],
                        positions=b["tokens_positions"][r], offsets=b["tokens_segment_offsets"][r],
                        lengths=b["tokens_segment_lengths"][r]))
    src = b["segment_source_index"][rows], b["segment_source_start"][rows]
    lens = b["tokens_segment_lengths"][rows]
    used = lens > 0
    pieces = sorted(zip(src[0][used].tolist(), src[1][used].tolist(), lens[used].tolist()))
    return out, pieces


def padded_steps(tokens, offsets, pieces, slots: int, seq_len: int):
    """The same example pieces one a row, in corpus order, greedily into steps of `slots`
    tokens; each step's rows padded to the bucket of its longest (PADDED_BUCKET * 2^k)."""
    bucket = functools.partial(lm.bucket, min_width=PADDED_BUCKET, seq_len=seq_len)
    steps, cur, longest = [], [], 0
    for piece in pieces:
        new_longest = max(longest, piece[2])
        if cur and (len(cur) + 1) * bucket(new_longest) > slots:
            steps.append(cur)
            cur, new_longest = [], piece[2]
        cur.append(piece)
        longest = new_longest
    if cur:
        steps.append(cur)
    out = []
    for step in steps:
        width = bucket(max(p[2] for p in step))
        out.append(lm.padded_rows([tokens[offsets[i] + start:offsets[i] + start + n]
                                   for i, start, n in step], slots // width, width))
    return out


def _device_batches(steps):
    return [jax.device_put(lm.make_batch(**s)) for s in steps]


def run_variant(step_fn, params, batches, repeats: int) -> tuple[float, float]:
    """(seconds for all batches, once; median over repeats) after a warm-up over every shape,
    and the last loss."""
    loss = None
    for b in batches:  # compile every shape
        loss, _ = step_fn(params, b)
    jax.block_until_ready(loss)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for b in batches:
            loss, grads = step_fn(params, b)
        jax.block_until_ready((loss, grads))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), float(loss)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DATA / "chat_dev.npz"))
    parser.add_argument("--seq-len", type=int, nargs="*", default=None, help="default 8192")
    parser.add_argument("--tokens", type=int, default=None, help="token slots a step (32768)")
    parser.add_argument("--steps", type=int, default=None, help="distinct batches (default 6)")
    parser.add_argument("--repeats", type=int, default=None, help="passes timed (default 3)")
    parser.add_argument("--rope", nargs="*", default=["half"], choices=["half", "interleaved"])
    parser.add_argument("--variants", default=DEFAULT_VARIANTS,
                        help=f"comma-separated: {list(BASE)}; {OPTIONS}")
    parser.add_argument("--profile", action="store_true", help="device time by op, per variant")
    parser.add_argument("--top", type=int, default=12, help="ops listed by --profile")
    for key, value in MODEL.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(value), default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on a CPU (interpret)")
    args = parser.parse_args(argv)
    on_cpu = jax.default_backend() not in ("tpu", "gpu")
    base = SMOKE_MODEL if args.smoke else MODEL
    model = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}
    seq_lens = args.seq_len or ([256] if args.smoke else [8192])
    slots = args.tokens or (256 if args.smoke else 32768)
    steps = args.steps or (1 if args.smoke else 6)
    repeats = args.repeats or (1 if args.smoke else 3)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    variants = {n: variant(n) for n in names}
    if jax.default_backend() != "tpu" and any(v[1].get("attention") == "splash"
                                              for v in variants.values()) and not on_cpu:
        raise SystemExit("Error: splash attention runs on a TPU (or a CPU in interpret mode)")
    print(f"backend={jax.default_backend()} device={jax.devices()[0].device_kind} "
          f"jax={jax.__version__}; model {model}; {slots} token slots a step, {steps} steps, "
          f"median of {repeats} passes" + ("; INTERPRET MODE: not performance figures"
                                           if on_cpu else ""))
    for seq_len in seq_lens:
        if slots % seq_len:
            raise SystemExit(f"Error: --tokens {slots} must be a multiple of --seq-len {seq_len}")
        tokens, offsets = load_examples(args.data, int(slots * steps * 1.6), seq_len)
        tokens = (tokens % model["vocab"]).astype(np.int32)  # a smaller --vocab folds ids
        packed, pieces = packed_steps(tokens, offsets, seq_len, slots // seq_len, steps)
        padded = padded_steps(tokens, offsets, pieces, slots, seq_len)
        feeds = {"packed": _device_batches(packed), "padded": _device_batches(padded)}
        real = sum(int(p[2]) for p in pieces)
        for rope in args.rope:
            rows, profiles, base_rate = [], [], {}
            for name in names:
                which, overrides = variants[name]
                cfg = lm.LMConfig(**model, rope=rope, interpret=on_cpu, **overrides)
                params = lm.init_params(jax.random.key(0), cfg)
                step_fn = lm.value_and_grad(cfg)
                secs, loss = run_variant(step_fn, params, feeds[which], repeats)
                rate = real / secs
                base_rate[name] = rate
                rows.append([name, len(feeds[which]), f"{secs / len(feeds[which]) * 1e3:.1f}",
                             f"{rate / 1e3:.1f}k", f"{loss:.4f}"])
                if args.profile:
                    profiles.append((name, profile_ops(step_fn, params, feeds[which], args.top)))
            for row in rows:
                rate = base_rate[row[0]]
                row.append(f"{rate / base_rate['maxtext']:.2f}x" if "maxtext" in base_rate
                           else "-")
                row.append(f"{rate / base_rate['padded']:.2f}x" if "padded" in base_rate
                           else "-")
            print_table(f"L={seq_len}, RoPE {rope}: value_and_grad, {real} real tokens in "
                        f"{len(packed)} packed steps / {len(padded)} padded steps",
                        ["variant", "steps", "ms / step", "real tokens/s", "loss", "vs maxtext",
                         "vs padded"], rows)
            for name, (by_cat, table) in profiles:
                print_table(f"profile: {name}, L={seq_len}, RoPE {rope} (device ms a step, "
                            "exclusive)", ["category", "ms", "share"], by_cat)
                print_table(f"profile: {name}: top ops", ["op", "ms", "share"], table)


if __name__ == "__main__":
    main()
