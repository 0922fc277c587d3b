"""A mixture's selection: what meets in one place, and what one task holds, for the legacy
selection (made in one place: the local main process, one Beam worker, Spark's driver) and the
hashed one (`mixture.hashed`: steps per input and per chunk on the workers).

    python -m benchmarks.mix_select_bench [--examples 10000000] [--per-input 1000000]

Three datasets of lognormal lengths (median 400 tokens, sigma 1; 60 / 30 / 10% of the
examples, in inputs of --per-input examples), weights 0.5 / 0.3 / 0.2, `mix_tokens` 1.2 times
the largest mixture without repetition, blocks of 4,194,304 examples. Each step is timed and
its allocations traced (tracemalloc peak, the inputs' lengths not counted); "in one place"
adds what the step gathers there (the legacy step: every input's lengths and loss counts, 16
bytes an example; the hashed steps: the tallies, the crossing buckets' examples, one size a
chunk). Same stream: the hashed steps run as a cluster runs them give `select_inputs`'s.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.common import print_table

BLOCK = 4_194_304


def _traced(fn: Callable[..., Any], *args: Any) -> tuple[Any, float, float]:
    """(fn(*args), peak MB of its allocations, seconds)."""
    tracemalloc.start()
    t0 = time.perf_counter()
    out = fn(*args)
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1] / 1e6
    tracemalloc.stop()
    return out, peak, seconds


def _corpus(examples: int, per_input: int, seed: int = 0) -> tuple[Any, list[np.ndarray]]:
    from seqpack.pipelines.offline.mixture import MixSpec

    rng = np.random.default_rng(seed)
    sizes = [int(examples * f) for f in (0.6, 0.3, 0.1)]
    lengths, datasets = [], []
    for k, n in enumerate(sizes):
        parts = [np.minimum(np.exp(rng.normal(6, 1, m)).astype(np.int64) + 1, 100_000)
                 for m in np.diff([*range(0, n, per_input), n])]
        datasets.append((f"d{k}", [f"d{k}_{i}" for i in range(len(parts))]))
        lengths += parts
    weights = {"d0": 0.5, "d1": 0.3, "d2": 0.2}
    avail = [sum(int(x.sum()) for x in lengths[a:b]) for a, b in _spans(datasets)]
    natural = min(a / w for a, w in zip(avail, weights.values()))
    return MixSpec(datasets, weights, mix_tokens=int(1.2 * natural), seed=1), lengths


def _spans(datasets: list) -> list[tuple[int, int]]:
    ends = np.cumsum([len(p) for _, p in datasets]).tolist()
    return list(zip([0, *ends[:-1]], ends))


def _distributed(spec: Any, lengths: list[np.ndarray]
                 ) -> tuple[np.ndarray, dict[str, list[float]]]:
    """The hashed steps one task at a time: the stream, and per step [the largest task's peak
    MB, seconds of all its tasks, MB its tasks send to one place]."""
    from seqpack.pipelines.offline.mixture import hashed

    rows: dict[str, list[float]] = {}

    def note(step: str, peak: float, s: float, met: float = 0.0) -> None:
        r = rows.setdefault(step, [0.0, 0.0, 0.0])
        r[0], r[1], r[2] = max(r[0], peak), r[1] + s, r[2] + met

    items = hashed.inputs_of(spec, lengths, [None] * len(lengths))
    counts = np.bincount([i.dataset for i in items], [i.lengths.size for i in items])
    tallies = [np.zeros((4, 1 << hashed.bucket_bits(c)), np.int64) for c in counts]
    for item in items:
        t, peak, s = _traced(hashed.tally, spec, item, counts[item.dataset])
        tallies[item.dataset] += t
        note("tally (per input)", peak, s, t.nbytes / 1e6)
    (total, cross), peak, s = _traced(hashed.crossings, spec, tallies)
    note("crossings (once)", peak, s)
    found: list[list] = [[] for _ in cross]
    for item in items:
        m, peak, s = _traced(hashed.members, spec, cross[item.dataset], item)
        found[item.dataset].append(m)
        note("members (per input)", peak, s, (m[0].nbytes + m[1].nbytes) / 1e6)
    mix, peak, s = _traced(hashed.plan, spec, total, cross, found)
    note("plan (once)", peak, s)
    chunks = mix.chunks(BLOCK)
    by: dict[int, list] = {}
    for item in items:
        got, peak, s = _traced(hashed.picks, spec, mix, chunks, item)
        for g, p in got:
            by.setdefault(g, []).append(p)
        note("picks (per input)", peak, s)
    parts = []
    for g in sorted(by):
        part, peak, s = _traced(hashed.chunk, by[g])
        parts.append(part)
        note("chunk (per chunk)", peak, s, 8e-6)
    return np.concatenate([p[1] for p in parts]), rows


def main() -> None:
    from seqpack.pipelines.offline.mixture import hashed, legacy

    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=int, default=10_000_000)
    ap.add_argument("--per-input", type=int, default=1_000_000)
    a = ap.parse_args()
    spec, lengths = _corpus(a.examples, a.per_input)
    n = sum(x.size for x in lengths)
    gathered = 16 * n / 1e6
    old, p_old, s_old = _traced(legacy.select_inputs, spec, lengths, [None] * len(lengths))
    new, p_new, s_new = _traced(hashed.select_inputs, spec, lengths,
                                    [None] * len(lengths), BLOCK)
    ref, steps = _distributed(spec, lengths)
    title = (f"{n:,} examples in {len(lengths)} inputs; the stream: {old.num_examples:,} takes "
             f"(legacy), {new.num_examples:,} (hashed)")
    once = sum(r[2] for r in steps.values()) + max(r[0] for k, r in steps.items() if "once" in k)
    print_table(title, ["selection", "in one place, MB", "seconds"], [
        ["legacy (one place)", f"{p_old + gathered:,.0f}", f"{s_old:.2f}"],
        ["hashed, in process (the local runner)", f"{p_new:,.0f}", f"{s_new:.2f}"],
        ["hashed, as a cluster runs it", f"{once:,.1f}",
         f"{sum(r[1] for r in steps.values()):.2f}"]])
    print_table("the hashed steps", ["hashed step", "largest task's peak MB", "seconds (all tasks)",
                 "MB sent to one place"],
                [[k, f"{r[0]:,.1f}", f"{r[1]:.2f}", f"{r[2]:,.2f}"] for k, r in steps.items()])
    print(f"\nthe steps' stream equals select_inputs's: {np.array_equal(ref, new.ref)}")


if __name__ == "__main__":
    main()
