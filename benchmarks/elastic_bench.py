"""Online packing that survives a change of host count: its cost, its packing, its restore.

Three tables on one corpus (chat_dev; `PackConfig(2048, overflow="split")`, batches of 8 rows
per host, the default `Window`):

1. **Throughput** of one host's `make_training_pipeline` (host 0 of `--hosts`), examples per
   second over `--batches` batches after one, with 0 and `--workers` worker processes, against
   the per-host packing it replaced, built in the same process as that pipeline was (the
   host's examples h, h + H, ... shuffled, repeated, `SequentialIterDataset`, the same
   `PackIterDataset`, batch, loss tokens, prefetch). Runs alternate; the best of `--repeats`.
   Target: >= 0.9x.
2. **Packing through changes**: one epoch on 4 hosts unchanged, against the same epoch saved
   and restored 4 -> 2 -> 3 hosts (at a third and two thirds of it): rows, rows over the lower
   bound ceil(tokens / L), padding. Target: rows within 0.1%.
3. **Restore cost**: the seconds of `set_state` (every host's state of 4 hosts, restored on 3)
   plus the first batch, after 10, `--late` / 5 and `--late` steps, beside the pieces in flight
   it fetches. Target: no growth with the steps.

Usage (from the repo root)::

    python -m benchmarks.elastic_bench                 # ../shared/data/chat_dev.npz
    python -m benchmarks.elastic_bench --repeats 3 --batches 300
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from benchmarks.common import corpora

L, B = 2048, 8


def _source(name: str):
    from seqpack.pipelines.datasets import ArraySource

    tokens, offsets = corpora([name])[name]
    return ArraySource({"tokens": (tokens.astype(np.int32), offsets)})


def _elastic(src, *, host: int, hosts: int, workers: int, epochs: int | None):
    from seqpack.packer import PackConfig
    from seqpack.pipelines.datasets import Batching, Prefetch, make_training_pipeline

    return make_training_pipeline(
        src, pack=PackConfig(L, overflow="split"),
        batch=Batching(B, drop_remainder=False, shard_index=host, shard_count=hosts),
        shuffle_seed=0, num_epochs=epochs, prefetch=Prefetch(worker_count=workers))


def _per_host(src, *, host: int, hosts: int, workers: int):
    """The pipeline online packing had before: this host's examples, shuffled, packed."""
    import grain

    from seqpack.packer import PackConfig
    from seqpack.pipelines.datasets import LossTokens, PackIterDataset, SequentialIterDataset
    from seqpack.pipelines.datasets.training import Prefetch, _prefetch

    ds = grain.MapDataset.source(src)[host::hosts].shuffle(seed=0).repeat(None)
    rows = PackIterDataset(SequentialIterDataset(ds), PackConfig(L, overflow="split"), seed=0)
    batches = rows.batch(B).map(LossTokens(feature="tokens", labels=(), masks=()))
    return _prefetch(batches, Prefetch(worker_count=workers))


def _examples_per_s(make, batches: int) -> float:
    it = iter(make())
    next(it)
    start, n = time.perf_counter(), 0
    for _ in range(batches):
        b = next(it)
        n += int((b["tokens_segment_lengths"] > 0).sum())  # segments: examples, split pieces
    seconds = time.perf_counter() - start
    it.close()
    return n / seconds


def throughput(src, args) -> None:
    print(f"\n### Throughput: host 0 of {args.hosts}, examples (segments) per second\n")
    print("| worker processes | per-host packing (before) | elastic (now) | now / before |")
    print("|---|---|---|---|")
    for workers in (0, args.workers):
        best = {"before": 0.0, "now": 0.0}
        for _ in range(args.repeats):
            best["before"] = max(best["before"], _examples_per_s(
                lambda w=workers: _per_host(src, host=0, hosts=args.hosts, workers=w),
                args.batches))
            best["now"] = max(best["now"], _examples_per_s(
                lambda w=workers: _elastic(src, host=0, hosts=args.hosts, workers=w,
                                           epochs=None), args.batches))
        print(f"| {workers} | {best['before']:,.0f} | {best['now']:,.0f} | "
              f"{best['now'] / best['before']:.3f}x |")


def _rows(batch) -> tuple[int, int]:
    used = batch["tokens_segment_lengths"] > 0
    return int(used.any(1).sum()), int(batch["tokens_segment_lengths"].sum())


def _epoch(src, plan: list[tuple[int, int | None]]) -> tuple[int, int]:
    """(rows, tokens) of one epoch run on each (hosts, steps) of `plan` in turn, every host's
    state handed to the next layout."""
    state, rows, tokens = None, 0, 0
    for hosts, steps in plan:
        its = [iter(_elastic(src, host=h, hosts=hosts, workers=0, epochs=1))
               for h in range(hosts)]
        if state is not None:
            for it in its:
                it.set_state(state)
        k = 0
        while steps is None or k < steps:
            got = [next(it, None) for it in its]
            if all(g is None for g in got):
                break
            for g in got:
                if g is not None:
                    r, t = _rows(g)
                    rows, tokens = rows + r, tokens + t
            k += 1
        state = {"hosts": [json.loads(json.dumps(it.get_state())) for it in its]}
    return rows, tokens


def quality(src) -> None:
    whole_rows, tokens = _epoch(src, [(4, None)])
    steps = whole_rows // (4 * B)  # steps of the unchanged run
    changed_rows, changed_tokens = _epoch(src, [(4, steps // 3), (2, steps // 3), (3, None)])
    assert changed_tokens == tokens, (changed_tokens, tokens)
    bound = -(-tokens // L)
    print("\n### Packing through changes: one epoch, 4 hosts, against 4 -> 2 -> 3\n")
    print("| run | rows | over the bound | padding |")
    print("|---|---|---|---|")
    for name, rows in (("4 hosts, unchanged", whole_rows), ("4 -> 2 -> 3 hosts", changed_rows)):
        print(f"| {name} | {rows:,} | {rows / bound - 1:.3%} | {1 - tokens / (rows * L):.3%} |")
    print(f"\nrows changed / unchanged: {changed_rows / whole_rows - 1:+.3%} (bound {bound:,})")


def _in_flight(state: dict) -> int:
    """Pieces the hosts' packers held in flight at the save (rows not emitted, open rows)."""
    from seqpack.pipelines.datasets.elastic.flight import decode_table

    n = 0
    for s in state["hosts"]:
        t = decode_table(s["pipeline"]["flight"]["pieces"])
        n += int(((t[:, 0] < 0) | (t[:, 0] >= s["pipeline"]["emitted"])).sum())
    return n


def restore_cost(src, args) -> None:
    print("\n### Restore cost: 4 hosts' states restored on 3 hosts (seconds, best of 3)\n")
    print("| steps before the save | pieces in flight | set_state + first batch, every host | "
          "per piece in flight |")
    print("|---|---|---|---|")
    its = [iter(_elastic(src, host=h, hosts=4, workers=0, epochs=None)) for h in range(4)]
    done = 0
    for steps in (10, args.late // 5, args.late):
        for _ in range(steps - done):
            for it in its:
                next(it)
        done = steps
        state = {"hosts": [json.loads(json.dumps(it.get_state())) for it in its]}
        best = float("inf")
        for _ in range(3):
            new = [iter(_elastic(src, host=h, hosts=3, workers=0, epochs=None))
                   for h in range(3)]
            start = time.perf_counter()
            for it in new:
                it.set_state(state)
                next(it)
            best = min(best, time.perf_counter() - start)
        pieces = _in_flight(state)
        print(f"| {steps} | {pieces:,} | {best:.3f} s | {best / pieces * 1e6:.0f} us |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default="chat_dev")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--late", type=int, default=1500)
    p.add_argument("--only", choices=["throughput", "quality", "restore"], nargs="*")
    args = p.parse_args()
    from seqpack.pipelines.datasets.training import ensure_flags_parsed

    ensure_flags_parsed()
    src = _source(args.corpus)
    only = set(args.only or ["throughput", "quality", "restore"])
    if "throughput" in only:
        throughput(src, args)
    if "quality" in only:
        quality(src)
    if "restore" in only:
        restore_cost(src, args)


if __name__ == "__main__":
    main()
