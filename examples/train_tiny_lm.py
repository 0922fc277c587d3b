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
output projection fused into the loss). A checkpoint (one file, `checkpoint.npz`, written
under a temporary name and renamed once: a crash mid-save leaves the previous one whole) holds
the parameters, the optimizer state, the step and the Grain iterator state, so a resumed run
continues with exactly the batches (and losses) of an uninterrupted one. The log's rate is real
tokens/s (tokens inside segments) since the previous line, the first step (it compiles) left
out.

`--sft`: the same paragraphs as supervised fine-tuning data: the first line is the prompt
(labels -100, no loss), the rest the response. Labels are packed with the tokens
(`Columns(labels=...)`), every batch carries `loss_tokens` (the positions the loss counts, per
row), and with `--micro-batches k` each step sums the k micro-batches' losses and divides by
the batch's total `loss_tokens`: the per-token mean of the unpacked examples, exactly, however
the batch is split (as a data-parallel step over hosts divides by the psum).

`--mix`: the paragraphs as two datasets, "short" (under 256 bytes) and "long", mixed half and
half in tokens (`pipelines.datasets.Mixture`); every row carries `segment_dataset_id` and the
log line adds each dataset's loss (`kernels.segment_dataset_loss` over the per-segment sums;
"n/a" for one with no tokens in the batch; with `--context-parallel`, the sums of the
context-parallel loss over the layout).

`--context-parallel C`: every row split over C devices (on a CPU, C host devices by XLA_FLAGS):
rows packed for C ranks and batches in the load-balanced layout (`Batching(context_parallel=C)`),
ring attention under `shard_map`, the loss psum'd over the ranks (examples/tiny_lm.py): the same
losses as one device, row for row.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import time

import grain
import jax
import numpy as np

from examples.lm_args import at_least
from examples.lm_data import real_tokens
from examples.lm_run import Meter, dataset_means, fmt_loss, json_default
from examples.tiny_lm import (
    ModelConfig,
    adam_init,
    cp_batch,
    cp_loss,
    cp_replicated,
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


CHECKPOINT = "checkpoint.npz"  # parameters, optimizer state and "meta": one file, one rename


def save_checkpoint(path: pathlib.Path, params, opt_state, step: int, iterator) -> None:
    """Writes the parameters, the optimizer state and the meta (step, iterator state, as JSON)
    into ONE file under a temporary name, then renames it: a crash at any point leaves the
    previous checkpoint whole (never new parameters beside an old step)."""
    path.mkdir(parents=True, exist_ok=True)
    meta = json.dumps({"step": step, "iterator": iterator.get_state()}, default=json_default)
    tmp = path / "checkpoint.tmp.npz"
    with open(tmp, "wb") as f:
        np.savez(f, **flatten_state(params, opt_state), meta=np.array(meta))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / CHECKPOINT)


def has_checkpoint(path: pathlib.Path) -> bool:
    return (path / CHECKPOINT).is_file() or (path / "meta.json").is_file()


def load_checkpoint(path: pathlib.Path, iterator):
    """(params, opt_state, step) of the checkpoint in `path`, the iterator set to its state.
    Reads an older example's two files (state.npz + meta.json) too, if they agree: a save
    interrupted between their two renames left them apart, which is an error, not a resume."""
    if (path / CHECKPOINT).is_file():
        with np.load(path / CHECKPOINT) as z:
            arrays = dict(z)
        meta = json.loads(str(arrays.pop("meta")))
    else:
        with np.load(path / "state.npz") as z:
            arrays = dict(z)
        meta = json.loads((path / "meta.json").read_text())
    params, opt_state = unflatten_state(arrays)
    if int(opt_state["t"]) != int(meta["step"]):  # one Adam update a step
        raise ValueError(f"checkpoint {path} is torn: its parameters are from step "
                         f"{int(opt_state['t'])}, its step and iterator state from step "
                         f"{meta['step']} (a save was interrupted); it cannot be resumed: "
                         "start again without --resume in an empty folder")
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
    """Trains until `steps` (counting restored steps); returns the losses of the steps it ran.
    `resume`: from the checkpoint in `checkpoint_dir` (a folder that must exist; one without
    a checkpoint starts at step 0, and says so)."""
    cfg = model or ModelConfig(max_len=seq_len)
    if fused_loss:
        cfg = dataclasses.replace(cfg, fused_loss=True)
    ckpt = pathlib.Path(checkpoint_dir) if checkpoint_dir else None
    if (resume or save_every) and ckpt is None:
        raise ValueError("resume and save_every need a checkpoint_dir")
    if resume and not ckpt.is_dir():
        raise FileNotFoundError(f"no folder {ckpt}: no checkpoint to resume from")
    examples = stdlib_corpus() if examples is None else examples
    if sft:
        examples = sft_corpus(examples)
    iterator = iter(build_pipeline(examples, seq_len=seq_len, batch_size=batch_size, seed=seed,
                                   context_parallel=context_parallel, mix=mix))
    if resume and has_checkpoint(ckpt):
        params, opt_state, step = load_checkpoint(ckpt, iterator)
    else:
        if resume:
            print(f"no checkpoint in {ckpt}: starting at step 0", flush=True)
        params = init_params(jax.random.key(seed), cfg)
        opt_state, step = adam_init(params), 0
    if context_parallel > 1:  # placed as the step's outputs are: one compilation
        params, opt_state = cp_replicated((params, opt_state), context_parallel)
    labels = "labels" if sft else None
    train_step = make_train_step(cfg, labels=labels, micro_batches=micro_batches,
                                 context_parallel=context_parallel)
    losses: list[float] = []
    meter, first = Meter(), step  # real tokens/s from the end of this run's first step
    while step < steps:
        batch = next(iterator)
        tokens = real_tokens(batch)  # tokens inside segments, padding left out
        if context_parallel > 1:  # next-token targets read through the layout, on the host
            batch = cp_batch(batch, context_parallel, labels=labels)
        logged = bool(log_every) and (step + 1) % log_every == 0
        per = ""  # each dataset's loss on the step's batch, before its update (not timed)
        if mix and logged:
            t0 = time.perf_counter()
            per = "".join(f"  {n} {fmt_loss(v)}" for n, v in zip(
                MIX, dataset_losses(params, batch, cfg, labels, context_parallel)))
            meter.exclude(time.perf_counter() - t0)
        params, opt_state, loss, _ = train_step(params, opt_state, batch)
        step += 1
        losses.append(float(loss))  # waits for the step
        meter.add(tokens, 0.0)
        if logged:
            rate = (f"{meter.rates()['tokens_per_s']:,.0f} real tokens/s" if step > first + 1
                    else "(compiled)")
            print(f"step {step:5d}  loss {losses[-1]:.4f}{per}  {rate}", flush=True)
        if step == first + 1 or logged:  # rates from the end of the first step, per line
            meter.start()
        if ckpt and save_every and step % save_every == 0:
            t0 = time.perf_counter()
            save_checkpoint(ckpt, params, opt_state, step, iterator)
            meter.exclude(time.perf_counter() - t0)
    if ckpt:
        save_checkpoint(ckpt, params, opt_state, step, iterator)
    return losses


def dataset_losses(params, batch: dict, cfg: ModelConfig, labels: str | None,
                   context_parallel: int = 1) -> list[float]:
    """Each dataset's per-token loss on `batch` (a mixture's: it carries segment_dataset_id),
    NaN for a dataset with no tokens in it. With `context_parallel` C > 1, `batch` is a
    `cp_batch` (its labels already in its loss mask), and the loss runs over C devices."""
    if context_parallel > 1:
        sums, tokens = _cp_dataset_losses(cfg, context_parallel)(params, batch)
    else:
        sums, tokens = _dataset_losses(params, batch, cfg, labels)
    return dataset_means(sums, tokens)


@jax.jit(static_argnames=("cfg", "labels"))
def _dataset_losses(params, batch, cfg, labels):
    _, (per_seg, count) = loss_fn(params, batch, cfg, normalize="none", labels=labels)
    return kernels.segment_dataset_loss(per_seg, count, batch["segment_dataset_id"],
                                        num_datasets=len(MIX))


@functools.cache
def _cp_dataset_losses(cfg: ModelConfig, context_parallel: int):
    """jit: (params, cp batch) -> each dataset's (loss sum, tokens), from the per-segment sums
    of the context-parallel loss (`cp_loss`: the layout's tokens, psum'd over the ranks)."""
    loss = cp_loss(cfg, context_parallel, normalize="none")

    @jax.jit
    def sums(params, batch):
        _, (per_seg, count) = loss(params, batch)
        return kernels.segment_dataset_loss(per_seg, count, batch["segment_dataset_id"],
                                            num_datasets=len(MIX))

    return sums


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=at_least(0), default=300)
    ap.add_argument("--seq-len", type=at_least(1), default=256)
    ap.add_argument("--batch-size", type=at_least(1), default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint-dir")
    ap.add_argument("--save-every", type=at_least(0), default=0,
                    help="save every N steps (needs --checkpoint-dir; 0: only at the end)")
    ap.add_argument("--resume", action="store_true",
                    help="continue from the checkpoint in --checkpoint-dir (which must exist)")
    ap.add_argument("--log-every", type=at_least(0), default=25)
    ap.add_argument("--sft", action="store_true", help="labels -100 on each paragraph's first line")
    ap.add_argument("--micro-batches", type=at_least(1), default=1)
    ap.add_argument("--mix", action="store_true",
                    help="two datasets (short / long paragraphs), half and half in tokens; "
                         "logs each one's loss")
    ap.add_argument("--context-parallel", type=at_least(1), default=1, metavar="C",
                    help="split every row over C devices (ring attention)")
    ap.add_argument("--fused-loss", action="store_true",
                    help="the loss head without logits (kernels.segment_linear_cross_entropy)")
    a = ap.parse_args(argv)
    if (a.resume or a.save_every) and not a.checkpoint_dir:
        ap.error(f"{'--resume' if a.resume else '--save-every'} needs --checkpoint-dir")
    if a.resume and not pathlib.Path(a.checkpoint_dir).is_dir():
        ap.error(f"--resume: no folder {a.checkpoint_dir} (no checkpoint to resume from): "
                 "check the path, or leave out --resume to start at step 0")
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
