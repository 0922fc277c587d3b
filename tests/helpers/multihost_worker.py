"""One JAX process of a multi-process training-input run (tests/test_multihost.py starts them).

Each process joins `jax.distributed` on loopback (CPU devices), runs `make_training_pipeline` on
its shard (the default: `jax.process_index()` / `jax.process_count()`), assembles every global
batch with `jax.make_array_from_process_local_data` on a mesh spanning every process, and runs
a jitted step (`kernels.segment_attention` + `kernels.segment_cross_entropy` under `shard_map`,
the loss summed over all devices). It writes, per step, the global batch (gathered back to
every process) and the loss; the state after `--save-at` steps; and, restored from that state
in a fresh pipeline, the batches it makes next (all hosts resume from their own states).
Online, `--save-dir` saves every process's state after the steps as Orbax's Grain handler
does (`process_<i>-of-<N>.json`), `--restore-dir` restores from such files on any number of
processes (`ElasticCheckpointHandler`), and `--drain` reads this process's rows to the end
of the epoch after the global steps (no short last batch dropped).

`--processes 1 --simulate N` is the reference: one process reading the N shards itself
(Batching(shard_index=h, shard_count=N)) and putting their batches side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["packed", "balanced", "online"], required=True)
    p.add_argument("--data", default="")
    p.add_argument("--processes", type=int, required=True)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--simulate", type=int, default=0)
    p.add_argument("--resume-state", default="")
    p.add_argument("--out", required=True)
    p.add_argument("--workers", type=int, default=0, help="Prefetch(worker_count=)")
    p.add_argument("--bench", action="store_true", help="time the input only (no step)")
    p.add_argument("--save-dir", default="")
    p.add_argument("--restore-dir", default="")
    p.add_argument("--drain", type=int, default=0)
    return p.parse_args()


def examples(n: int = 400, seed: int = 0):
    """Example i's first token is 1000 + i (its id); the rest random, lengths 1..24."""
    import numpy as np

    from seqpack.pipelines.datasets import ArraySource

    rng = np.random.default_rng(seed)
    return ArraySource.from_sequences([np.concatenate([[1000 + i], rng.integers(
        1, 999, int(rng.integers(0, 24)))]) for i in range(n)])


def pipeline(args: argparse.Namespace, batching):
    from seqpack.packer import PackConfig
    from seqpack.pipelines.datasets import (
        Columns,
        PackedArrayRecordSource,
        Prefetch,
        make_training_pipeline,
    )

    labels = Columns(labels=["labels"]) if args.mode != "online" and not args.bench else Columns()
    if args.drain:
        batching = dataclasses.replace(batching, drop_remainder=False)
    kw = dict(batch=batching, shuffle_seed=7, num_epochs=None if args.bench else 1,
              columns=labels, prefetch=Prefetch(worker_count=args.workers))
    if args.mode == "online" and args.data:  # a corpus (.npz: tokens, offsets), as benchmarked
        import numpy as np

        from seqpack.pipelines.datasets import ArraySource

        z = np.load(args.data)
        return make_training_pipeline(
            ArraySource({"tokens": (z["tokens"], z["offsets"])}),
            pack=PackConfig(2048, overflow="split"), **{**kw, "columns": Columns()})
    if args.mode == "online":
        return make_training_pipeline(examples(), pack=PackConfig(32, max_segments=8),
                                      **{**kw, "columns": Columns()})
    return make_training_pipeline(PackedArrayRecordSource(args.data), **kw)


def local_batches(args: argparse.Namespace, *, state=None):
    """This process's batches (or, simulating N shards, theirs side by side) and a function
    returning the state(s)."""
    import numpy as np

    from seqpack.pipelines.datasets import Batching

    per_host = args.global_batch // (args.simulate or args.processes)
    if not args.simulate:
        it = iter(pipeline(args, Batching(per_host)))  # shard from jax
        if state is not None:
            it.set_state(state)
        return it, it.get_state
    its = [iter(pipeline(args, Batching(per_host, shard_index=h, shard_count=args.simulate)))
           for h in range(args.simulate)]
    for h, it in enumerate(its):
        if state is not None:
            it.set_state(state[h])

    def side_by_side():
        for parts in zip(*its, strict=False):
            yield {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    return side_by_side(), lambda: [it.get_state() for it in its]


def example_ids(batch) -> list[int]:
    """The example of every segment of an online batch (its first token - 1000)."""
    return [int(tokens[o]) - 1000 for tokens, offsets, lengths in zip(
        batch["tokens"], batch["tokens_segment_offsets"], batch["tokens_segment_lengths"],
        strict=True) for o, n in zip(offsets, lengths, strict=True) if n]


def epoch_pass(args: argparse.Namespace) -> list:
    """What this process reads in a whole epoch, without jax: each row's segment source
    indices (packed rows: global example ids), or each segment's example id (online: its
    first token - 1000). Balanced rows by whole steps; otherwise a short last batch kept."""
    import numpy as np

    from seqpack.pipelines.datasets import Batching

    per_host = args.global_batch // args.processes
    batching = Batching(per_host, drop_remainder=args.mode == "balanced")
    seen = []
    for b in pipeline(args, batching):
        if args.mode != "online":
            seen += [tuple(r) for r in b["segment_source_index"].tolist()]
            continue
        seen += example_ids(b)
    return seen if args.mode != "online" else sorted(np.asarray(seen).tolist())


def make_step(mesh):
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from seqpack import kernels

    V, E, H = 64, 16, 2
    key = jax.random.key(0)
    params = {"embed": jax.random.normal(key, (V, E)) * 0.1,
              "qkv": jax.random.normal(jax.random.fold_in(key, 1), (E, 3, H, E // H)) * 0.1,
              "out": jax.random.normal(jax.random.fold_in(key, 2), (H * (E // H), V)) * 0.1}

    def local_loss(params, tokens, offsets, lengths):
        x = params["embed"][tokens % V]
        q, k, v = jnp.einsum("ble,ecnd->cblnd", x, params["qkv"])
        y = kernels.segment_attention(q, k, v, offsets, lengths)
        logits = y.reshape(*y.shape[:2], -1) @ params["out"]
        targets = jnp.roll(tokens, -1, axis=1) % V
        _, per_segment, count = kernels.segment_cross_entropy(logits, targets, offsets, lengths,
                                                              normalize="none")
        total = jax.lax.psum(per_segment.sum(), "data")
        return total / jnp.maximum(jax.lax.psum(count.sum(), "data"), 1)

    spec = P("data")
    sharded = jax.shard_map(local_loss, mesh=mesh, in_specs=(P(), spec, spec, spec),
                            out_specs=P(), check_vma=False)
    return jax.jit(lambda t, o, n: sharded(params, t, o, n))


def run(args: argparse.Namespace) -> dict:
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(jax.devices()), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    step = make_step(mesh)
    keys = ("tokens", "tokens_segment_offsets", "tokens_segment_lengths", "segment_source_index")

    def global_batch(local):
        arrays = {k: jax.make_array_from_process_local_data(sharding, np.asarray(local[k]))
                  for k in keys}
        loss = step(arrays["tokens"], arrays["tokens_segment_offsets"],
                    arrays["tokens_segment_lengths"])
        gathered = {k: np.asarray(multihost_utils.process_allgather(v, tiled=True))
                    for k, v in arrays.items()}
        return gathered, float(loss)

    resume = None
    if args.resume_state:
        with open(args.resume_state) as f:
            resume = json.load(f)
    it, get_state = local_batches(args, state=resume)
    if args.restore_dir:
        import etils.epath

        from seqpack.pipelines.datasets import ElasticCheckpointHandler

        ElasticCheckpointHandler().restore(etils.epath.Path(args.restore_dir), item=it)
    out: dict = {"batches": [], "losses": [], "state": None, "resumed": [], "drained": [],
                 "epoch": [] if args.simulate or args.drain else epoch_pass(args)}
    for k in range(args.steps):
        if k == args.save_at:
            out["state"] = json.loads(json.dumps(get_state()))
        b, loss = global_batch(next(it))
        out["batches"].append(b)
        out["losses"].append(loss)
    if args.save_dir:
        import etils.epath

        from seqpack.pipelines.datasets import ElasticCheckpointHandler

        ElasticCheckpointHandler().save(etils.epath.Path(args.save_dir), item=it)
    if args.drain:
        out["drained"] = [i for b in it for i in example_ids(b)]
    elif args.save_at < args.steps and resume is None and not args.restore_dir:
        it2, _ = local_batches(args, state=out["state"])
        for _ in range(args.save_at, args.steps):
            out["resumed"].append(global_batch(next(it2))[0])
    return out


def bench(args: argparse.Namespace) -> dict:
    """Input throughput of this process: batches made and assembled into global arrays."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(Mesh(np.asarray(jax.devices()), ("data",)), P("data"))
    it, _ = local_batches(args)
    first = next(it)
    rows = 0
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        local = next(it)
        arr = jax.make_array_from_process_local_data(sharding, local["tokens"])
        arr.block_until_ready()
        rows += local["tokens"].shape[0]
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    del first
    return {"rows": rows, "seconds": seconds, "rows_per_s": rows / seconds,
            "rows_per_cpu_s": rows / cpu}


def main() -> None:
    args = _parse()
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.processes > 1:
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}",
                                   num_processes=args.processes, process_id=args.process_id,
                                   initialization_timeout=60)
    assert jax.process_count() == args.processes and jax.process_index() == args.process_id
    out = bench(args) if args.bench else run(args)
    import pickle

    with open(args.out + ".tmp", "wb") as f:
        pickle.dump(out, f)
    os.replace(args.out + ".tmp", args.out)
    if args.processes > 1:
        jax.distributed.shutdown()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
