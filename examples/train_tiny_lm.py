"""Trains a tiny decoder-only LM on packed rows on CPU: seqpack pipeline in, segment loss out.

    python -m examples.train_tiny_lm --steps 300                   # a couple of minutes on CPU
    python -m examples.train_tiny_lm --steps 300 --checkpoint-dir /tmp/ckpt --save-every 100
    python -m examples.train_tiny_lm --steps 400 --checkpoint-dir /tmp/ckpt --resume
    python -m examples.train_tiny_lm --steps 300 --sft --micro-batches 2   # labels, exact mean
    python -m examples.train_tiny_lm --steps 300 --mix             # two datasets, loss of each
    python -m examples.train_tiny_lm --steps 300 --fused-loss      # no [B, L, V] logits
    XLA_FLAGS=--xla_force_host_platform_device_count=2 \
        python -m examples.train_tiny_lm --steps 300 --context-parallel 2  # rows over 2 devices

Data: Python's own standard library sources, byte-tokenized (vocab 256), one example per
paragraph (the CLI's built-in sample) — no download. The input pipeline is
`pipelines.make_training_pipeline` (shard, shuffle, pack, batch; options in frozen dataclasses:
`PackConfig`, `Batching`, `Columns`, `Prefetch`); the model (examples/tiny_lm.py) restricts
attention to segments and takes positions from the packed rows; the loss is
`kernels.segment_cross_entropy` (`--fused-loss`: `kernels.segment_linear_cross_entropy`, the
output projection fused into the loss). A checkpoint holds the parameters, the optimizer state,
the step and the Grain iterator state, so a resumed run continues with exactly the batches (and
losses) of an uninterrupted one.

`--sft`: the same paragraphs as supervised fine-tuning data: the first line is the prompt
(labels -100, no loss), the rest the response. Labels are packed with the tokens
(`Columns(labels=...)`), every batch carries `loss_tokens` (the positions the loss counts, per
row), and with `--micro-batches k` each step sums the k micro-batches' losses and divides by
the batch's total `loss_tokens`: the per-token mean of the unpacked examples, exactly, however
the batch is split (as a data-parallel step over hosts divides by the psum).

`--mix`: the paragraphs as two datasets, "short" (under 256 bytes) and "long", mixed half and
half in tokens (`pipelines.datasets.Mixture`); every row carries `segment_dataset_id` and the
log line adds each dataset's loss (`kernels.segment_dataset_loss` over the per-segment sums).

`--context-parallel C`: every row split over C devices (on a CPU, C host devices by XLA_FLAGS):
rows packed for C ranks and batches in the load-balanced layout (`Batching(context_parallel=C)`),
ring attention under `shard_map`, the loss psum'd over the ranks (examples/tiny_lm.py): the same
losses as one device, row for row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import time

import grain
import jax
import numpy as np

from examples.lm_run import json_default
from examples.tiny_lm import (
    ModelConfig,
    adam_init,
    cp_batch,
    flatten_state,
    init_params,
    loss_fn,
    make_train_step,
    unflatten_state,
)
from seqpack import kernels
from seqpack.packer import PackConfig
from seqpack.pipelines.datasets import (
    Batching,
    Columns,
    Mixture,
    Prefetch,
    make_training_pipeline,
)
from seqpack.pipelines.formats.inputs import sample_files
from seqpack.pipelines.formats.text import read_text

MIX = ("short", "long")  # --mix: paragraphs under 256 bytes, and the rest


def stdlib_corpus(max_examples: int = 3000) -> list[np.ndarray]:
    """The CLI's built-in sample: stdlib sources, one byte-tokenized example per paragraph."""
    out: list[np.ndarray] = []
    for path in sample_files():
        values, offsets = read_text(path, None, "paragraph")
        out += [values[a:b].astype(np.int32) for a, b in zip(offsets[:-1], offsets[1:])]
        if len(out) >= max_examples:
            break
    return out[:max_examples]


def sft_corpus(examples: list[np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Each paragraph as an SFT example: its first line the prompt (labels -100), the rest the
    response (labels = the tokens)."""
    out = []
    for e in examples:
        newline = np.flatnonzero(e == ord("\n"))
        prompt = int(newline[0]) + 1 if newline.size else 0
        labels = e.copy()
        labels[:prompt] = -100
        out.append({"tokens": e, "labels": labels})
    return out


def mixture(rows: list[dict], *, seed: int = 0) -> Mixture:
    """`rows` as two datasets by length ("short" under 256 tokens, "long"), half and half in
    tokens; each repeats in a new order when it runs out."""
    short = [r for r in rows if len(r["tokens"]) < 256]
    long = [r for r in rows if len(r["tokens"]) >= 256]
    return Mixture({MIX[0]: grain.MapDataset.source(short), MIX[1]: grain.MapDataset.source(long)},
                   weights=dict.fromkeys(MIX, 0.5), unit="tokens", on_exhausted="repeat",
                   seed=seed, num_epochs=None)


def build_pipeline(examples, *, seq_len: int, batch_size: int, seed: int = 0,
                   context_parallel: int = 1, mix: bool = False):
    """The training pipeline over `examples`: token arrays, or SFT dicts (`sft_corpus`); with
    `context_parallel` C > 1, rows packed for C ranks, in the load-balanced layout; with `mix`,
    the examples as a `mixture` of two datasets."""
    sft = bool(examples) and isinstance(examples[0], dict)
    rows = examples if sft else [{"tokens": e} for e in examples]
    return make_training_pipeline(
        mixture(rows, seed=seed) if mix else grain.MapDataset.source(rows),
        pack=PackConfig(seq_len, max_segments=16, overflow="split"),
        batch=Batching(batch_size, shard_index=0, shard_count=1,
                       context_parallel=context_parallel if context_parallel > 1 else None),
        shuffle_seed=seed,
        num_epochs=None,
        columns=Columns(labels={"labels": -100} if sft else ()),
        prefetch=Prefetch(buffer_size=0),
    )


def save_checkpoint(path: pathlib.Path, params, opt_state, step: int, iterator) -> None:
    """Writes state.npz + meta.json to temporary names, then renames (a crash leaves the old)."""
    path.mkdir(parents=True, exist_ok=True)
    np.savez(path / "state.tmp.npz", **flatten_state(params, opt_state))
    meta = {"step": step, "iterator": iterator.get_state()}
    (path / "meta.tmp.json").write_text(json.dumps(meta, default=json_default))
    os.replace(path / "state.tmp.npz", path / "state.npz")
    os.replace(path / "meta.tmp.json", path / "meta.json")


def load_checkpoint(path: pathlib.Path, iterator):
    with np.load(path / "state.npz") as z:
        params, opt_state = unflatten_state(dict(z))
    meta = json.loads((path / "meta.json").read_text())
    iterator.set_state(meta["iterator"])
    return params, opt_state, int(meta["step"])


def train(
    steps: int,
    *,
    seq_len: int = 128,
    batch_size: int = 8,
    seed: int = 0,
    checkpoint_dir: str | None = None,
    save_every: int = 0,
    resume: bool = False,
    log_every: int = 0,
    model: ModelConfig | None = None,
    examples: list | None = None,
    sft: bool = False,
    micro_batches: int = 1,
    context_parallel: int = 1,
    mix: bool = False,
    fused_loss: bool = False,
) -> list[float]:
    """Trains until `steps` (counting restored steps); returns the losses of the steps it ran."""
    cfg = model or ModelConfig(max_len=seq_len)
    if fused_loss:
        cfg = dataclasses.replace(cfg, fused_loss=True)
    examples = stdlib_corpus() if examples is None else examples
    if sft:
        examples = sft_corpus(examples)
    iterator = iter(build_pipeline(examples, seq_len=seq_len, batch_size=batch_size, seed=seed,
                                   context_parallel=context_parallel, mix=mix))
    ckpt = pathlib.Path(checkpoint_dir) if checkpoint_dir else None
    if resume and ckpt and (ckpt / "meta.json").exists():
        params, opt_state, step = load_checkpoint(ckpt, iterator)
    else:
        params = init_params(jax.random.key(seed), cfg)
        opt_state, step = adam_init(params), 0
    labels = "labels" if sft else None
    train_step = make_train_step(cfg, labels=labels, micro_batches=micro_batches,
                                 context_parallel=context_parallel)
    losses: list[float] = []
    tokens_seen, t0 = 0, time.perf_counter()
    while step < steps:
        batch = next(iterator)
        if context_parallel > 1:  # next-token targets read through the layout, on the host
            batch = cp_batch(batch, context_parallel, labels=labels)
        logged = bool(log_every) and (step + 1) % log_every == 0
        per = ""  # each dataset's loss on the step's batch, before its update
        if mix and logged:
            per = "".join(f"  {n} {v:.4f}"
                          for n, v in zip(MIX, dataset_losses(params, batch, cfg, labels)))
        params, opt_state, loss, ntok = train_step(params, opt_state, batch)
        step += 1
        losses.append(float(loss))
        tokens_seen += int(ntok)
        if log_every and step % log_every == 0:
            dt = time.perf_counter() - t0
            print(f"step {step:5d}  loss {losses[-1]:.4f}{per}  {tokens_seen / dt:,.0f} "
                  "tokens/s", flush=True)
        if ckpt and save_every and step % save_every == 0:
            save_checkpoint(ckpt, params, opt_state, step, iterator)
    if ckpt:
        save_checkpoint(ckpt, params, opt_state, step, iterator)
    return losses


def dataset_losses(params, batch: dict, cfg: ModelConfig, labels: str | None) -> np.ndarray:
    """Each dataset's per-token loss on `batch` (a mixture's: it carries segment_dataset_id)."""
    sums, tokens = _dataset_losses(params, batch, cfg, labels)
    return np.asarray(sums) / np.maximum(np.asarray(tokens), 1)


@jax.jit(static_argnames=("cfg", "labels"))
def _dataset_losses(params, batch, cfg, labels):
    _, (per_seg, count) = loss_fn(params, batch, cfg, normalize="none", labels=labels)
    return kernels.segment_dataset_loss(per_seg, count, batch["segment_dataset_id"],
                                        num_datasets=len(MIX))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint-dir")
    ap.add_argument("--save-every", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--sft", action="store_true", help="labels -100 on each paragraph's first line")
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--mix", action="store_true",
                    help="two datasets (short / long paragraphs), half and half in tokens; "
                         "logs each one's loss")
    ap.add_argument("--context-parallel", type=int, default=1, metavar="C",
                    help="split every row over C devices (ring attention)")
    ap.add_argument("--fused-loss", action="store_true",
                    help="the loss head without logits (kernels.segment_linear_cross_entropy)")
    a = ap.parse_args()
    losses = train(a.steps, seq_len=a.seq_len, batch_size=a.batch_size, seed=a.seed,
                   checkpoint_dir=a.checkpoint_dir, save_every=a.save_every, resume=a.resume,
                   log_every=a.log_every, sft=a.sft, micro_batches=a.micro_batches,
                   context_parallel=a.context_parallel, mix=a.mix, fused_loss=a.fused_loss)
    if losses:
        k = max(1, len(losses) // 10)
        print(f"mean loss: first {k} steps {np.mean(losses[:k]):.4f}, "
              f"last {k} steps {np.mean(losses[-k:]):.4f}")


if __name__ == "__main__":
    main()
