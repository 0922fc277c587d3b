"""Mixtures through packing: seqpack's `Mixture` + `PackIterDataset` against Grain's `mix` +
FirstFit / BestFit, on two datasets whose mean lengths differ ~6x, in one process.

    short: chat_dev examples (mean ~400 tokens once truncated)
    long:  chat_sft_dev examples concatenated 6 at a time (mean ~2,500 tokens)

(every example truncated to L, which Grain's packers require). Weights 0.5 / 0.5; seqpack's in
tokens, Grain's in elements (its only unit). Printed:

1. Token share of `short`: over the run, and per batch of `--batch` rows (p5 / p50 / p95).
2. Resume after a weight change (0.5 / 0.5 -> 0.2 / 0.8) at batch `--resume-at`, read to the
   end: documents emitted before the checkpoint and again after it (repeated), and documents
   drawn before it (held by the packer) that never come out after it (lost). seqpack's epoch
   ends with every document exactly once (on_exhausted="continue").
3. Speed (examples/s through the packer, best of --repeats) against the unmixed
   `PackIterDataset` over the same documents and Grain's mix + BestFit.
4. Rows: the mixture's against the unmixed packing of the same documents.

5. With --cases: issue 55's cases instead (tiny vs long documents, repeat / stop / continue,
   three datasets, loss tokens, worker processes, a resume under edited weights, offline
   steps), each dataset's share per batch p5 / p95 / worst: `benchmarks/mixture_batches.py`.

    python -m benchmarks.mixture_bench                       # ../shared/data, about a minute
    python -m benchmarks.mixture_bench --short 8000 --long 1000 --repeats 1   # quicker
    python -m benchmarks.mixture_bench --open-rows 4         # rows kept open (default 2)
    python -m benchmarks.mixture_bench --cases [--batches 48]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

import grain
import grain.experimental as ge
import numpy as np

from benchmarks.common import DATA, fmt_rate, pin_one_core, print_table
from seqpack.packer import PackConfig
from seqpack.pipelines.datasets import (
    ArraySource,
    Mixture,
    PackIterDataset,
    SequentialIterDataset,
    Window,
)
from seqpack.pipelines.datasets.elastic import decode_refs

UID = 10**7  # a token's value names its document: dataset * UID + index (lengths are real)


def datasets(n_short: int, n_long: int, L: int) -> dict[str, list[int]]:
    """Lengths of the two datasets (real: the shared corpora, truncated to L)."""
    def lengths(name: str) -> np.ndarray:
        if not (DATA / f"{name}.npz").is_file():
            raise SystemExit(f"Error: {DATA / name}.npz not found (the shared corpora, "
                             "../shared/data from the repository root)")
        z = np.load(DATA / f"{name}.npz")
        return np.diff(z["offsets"].astype(np.int64))
    short = lengths("chat_dev")[:n_short]
    sft = lengths("chat_sft_dev")
    long = sft[: (sft.size // 6) * 6].reshape(-1, 6).sum(1)[:n_long]
    return {"short": np.minimum(short, L).tolist(), "long": np.minimum(long, L).tolist()}


def source(lengths: list[int], d: int) -> ArraySource:
    """Documents whose every token is their uid (d * UID + index)."""
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    values = d * UID + np.repeat(np.arange(len(lengths)), lengths)
    return ArraySource.from_ragged(values.astype(np.int64), offsets)


WINDOW = Window(1024)


def ours(srcs, weights, L, *, policy="stop"):
    mix = Mixture(dict(zip(("short", "long"), srcs)), weights=dict(zip(("short", "long"),
                  weights)), unit="tokens", on_exhausted=policy, seed=0)
    return PackIterDataset(mix, PackConfig(L, max_segments=256), window=WINDOW)


def grain_mix(srcs, weights, L, packer):
    ds = grain.MapDataset.mix(list(srcs), weights=list(weights)).to_iter_dataset(
        grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    cls = ge.BestFitPackIterDataset if packer == "best" else ge.FirstFitPackIterDataset
    return cls(ds, length_struct={"tokens": L}, num_packing_bins=1024 if packer == "best" else 64)


def docs_of(row) -> Counter:
    """uid -> tokens in the row."""
    v = np.asarray(row["tokens"])
    seg = np.asarray(row["tokens_segment_ids"])
    return Counter(np.asarray(v[seg > 0]).tolist())


def shares(rows, batch: int) -> tuple[float, np.ndarray]:
    short = np.array([sum(n for u, n in docs_of(r).items() if u < UID) for r in rows], float)
    total = np.array([sum(docs_of(r).values()) for r in rows], float)
    per = [short[i:i + batch].sum() / total[i:i + batch].sum()
           for i in range(0, len(rows) - batch + 1, batch)]
    return short.sum() / total.sum(), np.percentile(per, [5, 50, 95])


def drain(make, limit=None):
    it, rows = iter(make()), []
    for r in it:
        rows.append(r)
        if limit and len(rows) >= limit:
            break
    return it, rows


def resume_counts(make_old, make_new, at_rows: int, consumed) -> tuple[int, int]:
    """(repeated, lost) documents across a checkpoint at row `at_rows` restored under new
    weights and read to its end; `consumed(it)` names the documents the old iterator had drawn
    at the checkpoint."""
    it, before = drain(make_old, at_rows)
    state, drawn = it.get_state(), consumed(it)
    emitted = set().union(*(docs_of(r) for r in before))
    resumed = iter(make_new())
    resumed.set_state(state)
    after: set = set()
    for r in resumed:
        after |= set(docs_of(r))
    return len(emitted & after), len((drawn - emitted) - after)


def grain_consumed(srcs, weights):
    """Documents Grain's mix had handed the packer: positions [0, next index) of the mix."""
    mixed = grain.MapDataset.mix(list(srcs), weights=list(weights))

    def consumed(it) -> set:
        state = it.get_state()
        nxt = int(state["parent"]["next_index"])
        return {int(mixed[i]["tokens"][0]) for i in range(nxt) if len(mixed[i]["tokens"])}
    return consumed


def ours_consumed(it) -> set:
    """Documents the packer held at the checkpoint: the references its state names."""
    state = it.get_state()
    _, dataset, index = decode_refs(state["refs"])
    return set((dataset.astype(np.int64) * UID + index).tolist())


def timed(make, repeats: int) -> tuple[float, list]:
    best, rows = float("inf"), []
    for _ in range(repeats):
        t0 = time.perf_counter()
        rows = list(make())
        best = min(best, time.perf_counter() - t0)
    return best, rows


def main() -> None:
    if "--cases" in sys.argv:
        from benchmarks import mixture_batches

        mixture_batches.main([a for a in sys.argv[1:] if a != "--cases"])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--short", type=int, default=20_000)
    ap.add_argument("--long", type=int, default=3_000)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--resume-at", type=int, default=4, help="batches before the checkpoint")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--window-rows", type=int, default=128)
    ap.add_argument("--open-rows", type=int, default=None, help="Window(open_rows=)")
    a = ap.parse_args()
    global WINDOW
    WINDOW = Window(a.window, window_rows=a.window_rows, open_rows=a.open_rows)
    note = pin_one_core()
    L, B = a.seq_len, a.batch
    lens = datasets(a.short, a.long, L)
    srcs = [source(lens["short"], 0), source(lens["long"], 1)]
    mean = [np.mean(v) for v in lens.values()]
    print(f"short: {len(lens['short'])} docs, mean {mean[0]:.0f}; long: {len(lens['long'])} "
          f"docs, mean {mean[1]:.0f} ({mean[1] / mean[0]:.1f}x); L = {L}, {note}")

    systems = {
        "seqpack Mixture (tokens) + PackIterDataset": lambda: ours(srcs, (.5, .5), L),
        "grain mix + FirstFit (64 bins)": lambda: grain_mix(srcs, (.5, .5), L, "first"),
        "grain mix + BestFit (1024 bins)": lambda: grain_mix(srcs, (.5, .5), L, "best"),
    }
    runs = {name: timed(make, a.repeats) for name, make in systems.items()}
    rows_of = {name: rows for name, (_, rows) in runs.items()}
    # the unmixed packer over exactly the documents the mixture drew, in a shuffled order
    drawn = sorted(set().union(*(docs_of(r) for r in rows_of[next(iter(systems))])))
    uid_len = {d * UID + i: n for d, key in enumerate(lens) for i, n in enumerate(lens[key])}
    same = ArraySource.from_sequences([np.full(uid_len[u], u) for u in drawn], dtype=np.int64)
    unmixed = lambda: PackIterDataset(SequentialIterDataset(same.shuffle(seed=0)),  # noqa: E731
                                      PackConfig(L, max_segments=256),
                                      window=Window(a.window, window_rows=a.window_rows))
    runs["seqpack PackIterDataset, unmixed (same docs)"] = timed(unmixed, a.repeats)

    table = []
    for name, (sec, rows) in runs.items():
        docs = sum(len(docs_of(r)) for r in rows)
        share, (p5, p50, p95) = shares(rows, B)
        table.append([name, len(rows), f"{100 * share:.2f}%", f"{100 * p5:.1f}%",
                      f"{100 * p50:.1f}%", f"{100 * p95:.1f}%", fmt_rate(docs / sec)])
    print_table(f"Token share of `short` (target 50%), per batch of {B} rows, speed",
                ["system", "rows", "share", "p5", "p50", "p95", "docs/s"], table)

    at = a.resume_at * B
    res = [["seqpack Mixture (tokens)", *resume_counts(
        lambda: ours(srcs, (.5, .5), L, policy="continue"),
        lambda: ours(srcs, (.2, .8), L, policy="continue"), at, ours_consumed)]]
    for packer, label in (("first", "FirstFit"), ("best", "BestFit")):
        res.append([f"grain mix + {label}", *resume_counts(
            lambda p=packer: grain_mix(srcs, (.5, .5), L, p),
            lambda p=packer: grain_mix(srcs, (.2, .8), L, p), at,
            grain_consumed(srcs, (.5, .5)))])
    print_table(f"Resume at batch {a.resume_at} under weights 0.2 / 0.8, read to the end",
                ["system", "docs repeated", "docs lost"], res)
    full = Counter()
    it, before = drain(lambda: ours(srcs, (.5, .5), L, policy="continue"), at)
    resumed = iter(ours(srcs, (.2, .8), L, policy="continue"))
    resumed.set_state(it.get_state())
    for r in before + list(resumed):
        full.update(docs_of(r))
    want = sum(len(v) for v in lens.values())
    print(f"\nseqpack, resumed to the end of the epoch: {len(full)} of {want} documents, "
          f"{sum(full[u] != uid_len[u] for u in full)} with a token count other than theirs")

    mixed_rows, unmixed_rows = len(rows_of[next(iter(systems))]), len(runs[
        "seqpack PackIterDataset, unmixed (same docs)"][1])
    speed = {name: sum(len(docs_of(r)) for r in rows) / sec for name, (sec, rows) in runs.items()}
    names = list(runs)
    print(f"\nrows: mixed {mixed_rows}, unmixed {unmixed_rows} "
          f"({100 * (mixed_rows / unmixed_rows - 1):+.2f}%); speed: mixed / unmixed "
          f"{speed[names[0]] / speed[names[3]]:.2f}x, mixed / grain mix + BestFit "
          f"{speed[names[0]] / speed[names[2]]:.2f}x")


if __name__ == "__main__":
    main()
