"""Trains examples/lm.py on an accelerator from seqpack's pipeline: packed rows of two corpora.

    python -m examples.train_lm --smoke          # tiny model, generated data, seconds
    D="--data CORPORA"        # a folder of NAME.npz (tokens, offsets): chat_dev, gsm8k_train
    python -m examples.train_lm $D --steps 300 --workers 8     # ~107M parameters, L=8192
    python -m examples.train_lm $D --padded --steps 100        # the same examples, padded
    python -m examples.train_lm $D --compare-steps 200 --plot loss.png   # both, in lockstep
    python -m examples.train_lm $D --steps 400 --checkpoint-dir ckpt --save-every 100 [--resume]

The model is examples/lm.py's flax (linen) module, the definition benchmarks/train_step.py
times; optax optimizes its parameters and orbax-checkpoint saves them.

Input: `make_training_pipeline` over a `Mixture` of two corpora in `--data` (`--datasets`,
default chat_dev and gsm8k_train; `--weights` their shares of the tokens; each repeats
in a new order when it runs out), packed at `--seq-len` (long examples split), `--workers`
processes packing (Grain's `mp_prefetch`). `--smoke` reads two generated datasets instead
(count and motif, equal shares unless `--weights` says) and small sizes for the flags the
command line does not give (examples/lm_args.py: the flags, each checked up front).

Packed (the default): `kernels.segment_attention` (each segment attends to itself) and
`kernels.segment_linear_cross_entropy` (no [B, L, V] logits), positions restarting per
segment, the loss per counted token. `--padded`: every batch's examples (its segments) one per
row, longest first, in micro-batches of `--padded-tokens` slots whose rows are padded to a
power of two from 512 (lm_data.padded_feeds): splash attention without segment ids on a TPU
(the jnp reference elsewhere) and materialized logits; the step's gradient is the sum over its
micro-batches of the per-token loss, divided by the batch's counted tokens: the packed step's
gradient, example for example. `--compare-steps N` trains both from one initialization in
lockstep, each step's examples packed for one model and padded for the other, and writes
both loss curves (`--plot` PNG + CSV).

Logged every `--log-every` steps: the loss, each dataset's loss (`segment_dataset_id` through
`kernels.segment_dataset_loss`; "n/a" for one with no tokens in the step, null in `--summary`),
real tokens/s (tokens inside segments) and the host's wait for input (time in
`next(iterator)`, as a share of the wall time). At the end: the run's rates beside the
pipeline's own (`--pipeline-batches` drained without the model). A checkpoint
(orbax) holds the parameters, the optimizer state, the step and the iterator state
(`get_state()`, as JSON): `--resume` continues with the same batches and the same losses
(`--checkpoint-dir` must exist; one without a checkpoint starts at step 0 and says so).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from examples import lm
from examples import lm_data as data
from examples.lm_args import parse_args
from examples.lm_run import Checkpoints, Log, summary_json, write_curves
from seqpack import kernels


def sources(args) -> dict:
    if args.smoke and args.data is None:
        corpora = data.smoke_corpora(args.model["vocab"], seed=args.seed)
        return {n: corpora[n] for n in args.names}
    if args.data is None:
        raise SystemExit("Error: pass --data FOLDER holding the --datasets as NAME.npz (token "
                         "corpora: tokens, offsets), or --smoke for generated data")
    folder = pathlib.Path(args.data)
    missing = [n for n in args.names if not (folder / f"{n}.npz").is_file()]
    if missing:
        raise SystemExit(f"Error: {missing} not found in {folder}: pass --data, or --smoke")
    return {n: data.load_corpus(folder / f"{n}.npz", args.model["vocab"]) for n in args.names}


def configs(args) -> dict[str, lm.LMConfig]:
    """The model configuration per feed: "packed" (seqpack's kernels) and "padded"."""
    cpu = jax.default_backend() == "cpu"
    base = lm.LMConfig(**args.model, rope=args.rope, dtype=args.dtype, interpret=cpu)
    return {"packed": dataclasses.replace(base, attention=args.attention, loss="fused"),
            "padded": dataclasses.replace(base, attention="reference" if cpu else "splash",
                                          segment_ids=False, loss="materialized")}


@functools.cache
def optimizer(lr: float, warmup: int, steps: int):
    """AdamW (b2 0.95, weight decay 0.1), warm-up then cosine decay to lr / 10, clipped at a
    global norm of 1 (one object per setting: the jitted steps below are cached on it)."""
    import optax

    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), lr / 10)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1))


@functools.cache
def packed_step(cfg: lm.LMConfig, opt, num_datasets: int):
    """jit: (state, feed) -> (state, metrics): one step on packed rows."""
    import optax

    def step(state, feed):
        batch = data.model_batch(feed)

        def objective(p):
            loss, per_seg, ntok = lm.losses(p, batch, cfg)
            return loss, (per_seg, ntok)

        (loss, (per_seg, ntok)), grads = jax.value_and_grad(objective, has_aux=True)(
            state["params"])
        updates, opt_state = opt.update(grads, state["opt"], state["params"])
        sums, tokens = kernels.segment_dataset_loss(per_seg, ntok, feed["dataset_id"],
                                                    num_datasets=num_datasets)
        return ({"params": optax.apply_updates(state["params"], updates), "opt": opt_state},
                {"loss": loss, "sums": sums, "tokens": tokens})

    return jax.jit(step, donate_argnums=0)


@functools.cache
def padded_step(cfg: lm.LMConfig, opt, num_datasets: int):
    """(state, feeds, counted) -> (state, metrics): the micro-batches' summed per-token losses
    over `counted`, the batch's counted tokens (the packed step's objective), one update."""
    import optax

    def micro(params, acc, feed, counted):
        batch = data.model_batch(feed)

        def objective(p):
            _, per_seg, ntok = lm.losses(p, batch, cfg)
            return per_seg.sum() / counted, (per_seg, ntok)

        (loss, (per_seg, ntok)), grads = jax.value_and_grad(objective, has_aux=True)(params)
        sums, tokens = kernels.segment_dataset_loss(per_seg, ntok, feed["dataset_id"],
                                                    num_datasets=num_datasets)
        return jax.tree.map(jnp.add, acc, {"grads": grads, "loss": loss, "sums": sums,
                                           "tokens": tokens})

    def apply(state, acc):
        updates, opt_state = opt.update(acc["grads"], state["opt"], state["params"])
        return ({"params": optax.apply_updates(state["params"], updates), "opt": opt_state},
                {k: acc[k] for k in ("loss", "sums", "tokens")})

    micro_jit = jax.jit(micro, donate_argnums=1)
    apply_jit = jax.jit(apply, donate_argnums=0)

    def zeros(params):  # committed, as the micro-batches' outputs are: one compile a width
        return jax.device_put(
            {"grads": jax.tree.map(jnp.zeros_like, params), "loss": jnp.zeros((), jnp.float32),
             "sums": jnp.zeros((num_datasets,), jnp.float32),
             "tokens": jnp.zeros((num_datasets,), jnp.int32)}, jax.devices()[0])

    def step(state, feeds, counted):
        acc = zeros(state["params"])
        for feed in feeds:
            acc = micro_jit(state["params"], acc, feed, jnp.float32(counted))
        return apply_jit(state, acc)

    def warm_up(params, widths, slots, dtype):
        """Compiles the micro-batch of every width ahead (empty rows; no state changes)."""
        for w in widths:
            n = max(1, slots // w)
            feed = {**data.padded_rows([], n, w, dtype),
                    "dataset_id": np.full((n, 1), -1, np.int32)}
            jax.block_until_ready(micro_jit(params, zeros(params), feed, jnp.float32(1)))

    step.warm_up = warm_up
    return step


counted_tokens = data.counted_tokens  # public here too: the padded step's denominator


def run(argv: list[str] | None = None) -> dict:
    """Trains as the flags say; returns the figures (losses per step of this run, rates)."""
    args = parse_args(argv)
    if args.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    srcs = sources(args)
    make_pipeline = functools.partial(
        data.pipeline, srcs, args.shares, seq_len=args.seq_len, batch_size=args.batch_size,
        max_segments=args.max_segments, seed=args.seed, workers=args.workers,
        worker_buffer=args.worker_buffer)
    feeds = ["padded"] if args.padded else ["packed"] + (["padded"] if args.compare_steps else [])
    states, steps_fn, n_params = model_states(args, feeds)
    iterator = iter(make_pipeline())
    ckpt = Checkpoints(args.checkpoint_dir) if args.checkpoint_dir else None
    step = 0
    if ckpt and args.resume:
        restored = ckpt.restore(states, iterator)
        if restored is not None:
            states, step = restored
            print(f"resumed at step {step} from {args.checkpoint_dir}", flush=True)
        else:
            print(f"no checkpoint in {args.checkpoint_dir}: starting at step 0", flush=True)
    print(f"backend={jax.default_backend()} device={jax.devices()[0].device_kind}; model "
          f"{args.model} ({n_params / 1e6:.1f}M parameters); feeds {feeds}; L={args.seq_len} "
          f"B={args.batch_size} S={args.max_segments}; datasets {args.shares} (tokens); "
          f"workers {args.workers}", flush=True)
    if "padded" in feeds:
        warm_up_padded(args, steps_fn["padded"], states["padded"]["params"])
    stop = min(args.steps, step + args.stop_after) if args.stop_after else args.steps
    log = Log(feeds, args.names, steps=args.steps, first=step, stop=stop,
              log_every=args.log_every)
    states, step = train_loop(args, states, steps_fn, iterator, ckpt, log, step)
    rates = log.meter.rates()
    log.progress.close()
    if ckpt:
        if not args.save_every or step % args.save_every:
            ckpt.save(step, states, iterator)
        ckpt.close()
    close = getattr(iterator, "close", None)
    if close is not None:
        close()
    out = {"steps": step, "params": n_params, "feeds": feeds, "losses": log.history,
           "dataset_losses": log.per_dataset, "datasets": args.names, **rates,
           "batches_per_s": rates["steps_per_s"]}
    report(args, out, log, make_pipeline)
    return out


def model_states(args, feeds: list[str]) -> tuple[dict, dict, int]:
    """(states: each feed's params and optimizer state from one initialization, on device;
    the jitted step of each feed; the parameter count)."""
    cfgs, k = configs(args), len(args.names)
    opt = optimizer(args.lr, args.warmup, args.schedule_steps or args.steps)
    params = lm.init_params(jax.random.key(args.seed), cfgs["packed"])
    states = jax.device_put(  # committed, as restored states are: one compile; own buffers
        {f: {"params": jax.tree.map(jnp.copy, params), "opt": opt.init(params)} for f in feeds},
        jax.devices()[0])
    steps_fn = {"packed": packed_step(cfgs["packed"], opt, k),
                "padded": padded_step(cfgs["padded"], opt, k)}
    return states, steps_fn, lm.param_count(params)


def warm_up_padded(args, step_fn, params) -> None:
    """Compiles the padded micro-batch of every width the run can meet, before the first step,
    for the rows' token dtype (one for all corpora: lm_data.token_dtype)."""
    t0 = time.perf_counter()
    widths = sorted({lm.bucket(n, min_width=min(args.padded_min_width, args.seq_len),
                               seq_len=args.seq_len)
                     for n in 2 ** np.arange(int(np.log2(args.seq_len)) + 2)})
    step_fn.warm_up(params, widths, args.padded_tokens, data.token_dtype(args.model["vocab"]))
    print(f"padded widths {widths} compiled in {time.perf_counter() - t0:.1f}s", flush=True)


def train_loop(args, states: dict, steps_fn: dict, iterator, ckpt: Checkpoints | None,
               log: Log, step: int) -> tuple[dict, int]:
    """Steps from `step` to `log.stop`, each feed on the same batch; a step's figures are read
    after the next one is queued (the first step's at once: it compiles). -> (states, step)."""
    pending = None
    while step < log.stop:
        t0 = time.perf_counter()
        batch = next(iterator)
        wait = time.perf_counter() - t0
        metrics = {}
        for f in log.feeds:
            if f == "packed":
                states[f], metrics[f] = steps_fn[f](states[f], data.packed_feed(batch))
            else:
                micro = data.padded_feeds(batch, slots=args.padded_tokens,
                                          min_width=args.padded_min_width)
                states[f], metrics[f] = steps_fn[f](states[f], micro, counted_tokens(batch))
        if pending is not None:
            log.record(*pending)  # the previous step's figures: this step is already queued
        step += 1
        pending = (step, metrics, data.real_tokens(batch), wait)
        if step == log.first + 1:  # the first step compiles: rates from its end on
            log.record(*pending)
            pending = None
        if ckpt and args.save_every and step % args.save_every == 0:
            jax.block_until_ready(states)  # the step's own time stays in the rates
            t0 = time.perf_counter()
            ckpt.save(step, states, iterator)
            log.exclude(time.perf_counter() - t0)
    if pending is not None:
        log.record(*pending)
    return states, step


def report(args, out: dict, log: Log, make_pipeline) -> None:
    """Prints the run's rates, then the pipeline's own (drained without the model, into
    out["pipeline"]); writes the summary (--summary), then the curves (--plot)."""
    feeds, timed = out["feeds"], log.meter.steps
    rates = (f"{out['tokens_per_s'] / 1e3:,.1f}k real tokens/s, {out['steps_per_s']:.2f} "
             f"batches/s consumed, input wait {out['input_wait']:.2%} of the wall time"
             if timed else "no rates (the run's first step compiles and is not timed)")
    print(f"{feeds[0] if len(feeds) == 1 else 'packed + padded'}: {timed} steps timed: "
          f"{rates}", flush=True)
    if args.pipeline_batches:
        pipe = data.pipeline_rate(make_pipeline(), args.pipeline_batches)
        out["pipeline"] = pipe
        ratio = (f": {pipe['batches_per_s'] / out['steps_per_s']:.1f}x the consumption"
                 if out["steps_per_s"] > 0 else "; the consumption: n/a (no timed steps)")
        print(f"pipeline alone ({args.workers} workers, {args.pipeline_batches} batches): "
              f"{pipe['batches_per_s']:.2f} batches/s, {pipe['tokens_per_s'] / 1e3:,.1f}k real "
              f"tokens/s (first batch {pipe['first_batch_s']:.1f}s){ratio}", flush=True)
    if args.summary:  # first: a failing plot leaves the figures written
        path = pathlib.Path(args.summary)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(summary_json(out))
    if args.plot:
        write_curves(args.plot, out["losses"], log.first)


def main(argv: list[str] | None = None) -> None:
    run(argv)


if __name__ == "__main__":
    main()
