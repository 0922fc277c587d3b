"""Benchmarks seqpack's Grain datasets against Grain's own packers on one core.

All systems read the same source object in the same process: `SequentialIterDataset` over an
`ArraySource` of the corpus (examples truncated to L, which Grain's packers require). Each system
runs `--repeats` times, interleaved with the others, and the fastest run counts; rows are kept
and compared afterwards (drop-ins must equal Grain's rows exactly).

Usage (from the repo root)::

    .venv/bin/python -m benchmarks.pipeline_bench                    # ../shared/data/chat_dev.npz
    .venv/bin/python -m benchmarks.pipeline_bench --num-examples 20000 --repeats 5 --core 0

Without the corpus a synthetic lognormal corpus (chat-like lengths) is used. Targets:
PackIterDataset (window 1024) >= 5x the examples/s of Grain BestFit with 1024 bins, efficiency
>= 99.8%; drop-ins: identical rows, >= 3x their Grain original. Exit status 1 if a target fails
(with --check).
"""

from __future__ import annotations

import argparse
import gc
import os
import pathlib
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_corpus(path: pathlib.Path, n: int, seq_len: int, seed: int):
    """(values, offsets, name): the first n examples, each truncated to seq_len."""
    if path.exists():
        z = np.load(path)
        tokens, offsets, name = z["tokens"], z["offsets"], path.name
    else:
        rng = np.random.default_rng(seed)
        lengths = rng.lognormal(np.log(333), 0.75, n).astype(np.int64).clip(1, 9399)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        tokens = rng.integers(0, 30522, int(offsets[-1])).astype(np.uint16)
        name = "synthetic lognormal (chat_dev.npz not found)"
    n = min(n, offsets.size - 1)
    starts = offsets[:n]
    lengths = np.minimum(np.diff(offsets[: n + 1]), seq_len)
    new_offsets = np.concatenate([[0], np.cumsum(lengths)])
    take = np.repeat(starts - new_offsets[:-1], lengths) + np.arange(int(new_offsets[-1]))
    return tokens[take], new_offsets, name


def run_once(make, rows_out: list | None):
    """Seconds to drain one fresh iterator; keeps the rows if rows_out is a list."""
    gc.collect()
    it = iter(make())
    t0 = time.perf_counter()
    if rows_out is None:
        for _ in it:
            pass
    else:
        append = rows_out.append
        for row in it:
            append(row)
    return time.perf_counter() - t0


def real_tokens(row: dict) -> int:
    if "tokens_segment_lengths" in row:
        return int(row["tokens_segment_lengths"].sum())
    return int(np.count_nonzero(row["tokens_segment_ids"]))


def rows_identical(a: list[dict], b: list[dict]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        for k in y:
            if x[k].dtype != y[k].dtype or not np.array_equal(x[k], y[k]):
                return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "chat_dev.npz"))
    ap.add_argument("--num-examples", type=int, default=20000)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--core", type=int, default=None, help="pin to this CPU (default: first)")
    ap.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    args = ap.parse_args(argv)

    if hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {args.core if args.core is not None else cores[0]})

    import grain.experimental as ge

    from seqpack.packer import PackConfig
    from seqpack.pipelines import datasets as pipelines

    L = args.seq_len
    values, offsets, name = load_corpus(pathlib.Path(args.data), args.num_examples, L, seed=0)
    n = offsets.size - 1
    total = int(offsets[-1])
    lower = -(-total // L)
    source = pipelines.SequentialIterDataset(pipelines.ArraySource.from_ragged(values, offsets))
    grain_source = pipelines.ArraySource.from_ragged(values, offsets).to_iter_dataset(
        pipelines.sources.read_options_inline())

    kw = lambda bins: dict(length_struct={"tokens": L}, num_packing_bins=bins)  # noqa: E731
    systems = {
        "source alone (SequentialIterDataset)": lambda: source,
        "source alone (grain to_iter_dataset)": lambda: grain_source,
        f"seqpack PackIterDataset (window {args.window})":
            lambda: pipelines.PackIterDataset(source, PackConfig(L),
                                              window=pipelines.Window(args.window)),
    }
    for bins in (64, 1024):
        for label, g_cls, o_cls in (
            ("FirstFit", ge.FirstFitPackIterDataset, pipelines.FirstFitPackIterDataset),
            ("BestFit", ge.BestFitPackIterDataset, pipelines.BestFitPackIterDataset),
        ):
            systems[f"grain {label}, {bins} bins"] = (
                lambda g_cls=g_cls, bins=bins: g_cls(source, **kw(bins)))
            systems[f"seqpack drop-in {label}, {bins} bins"] = (
                lambda o_cls=o_cls, bins=bins: o_cls(source, **kw(bins)))

    best = dict.fromkeys(systems, float("inf"))
    rows: dict[str, list] = {}
    for rep in range(args.repeats):
        for label, make in systems.items():
            keep = [] if rep == 0 and not label.startswith("source") else None
            best[label] = min(best[label], run_once(make, keep))
            if keep is not None:
                rows[label] = keep
    rate = {k: n / t for k, t in best.items()}

    print(f"corpus: {name}, first {n} examples truncated to L={L} ({total} tokens, lower bound "
          f"{lower} rows); one core, best of {args.repeats}")
    head = f"{'system':44s} {'rows':>6s} {'efficiency':>10s} {'examples/s':>11s} {'vs grain':>9s}"
    print(head + "  identical rows")
    print("-" * (len(head) + 16))
    failures = []
    ours_label = f"seqpack PackIterDataset (window {args.window})"
    for label in systems:
        r = rows.get(label)
        eff = (f"{100 * sum(real_tokens(x) for x in r) / (len(r) * L):9.2f}%" if r else "")
        nrows = f"{len(r):6d}" if r else f"{'':6s}"
        ratio, same = "", ""
        if label.startswith("seqpack drop-in"):
            twin = label.replace("seqpack drop-in", "grain")
            ratio = f"{rate[label] / rate[twin]:8.2f}x"
            ok = rows_identical(r, rows[twin])
            same = "yes" if ok else "NO"
            if not ok:
                failures.append(f"{label}: rows differ from {twin}")
            if rate[label] < 3 * rate[twin]:
                failures.append(f"{label}: {rate[label] / rate[twin]:.2f}x < 3x")
        elif label == ours_label:
            twin = "grain BestFit, 1024 bins"
            ratio = f"{rate[label] / rate[twin]:8.2f}x"
            efficiency = sum(real_tokens(x) for x in r) / (len(r) * L)
            if rate[label] < 5 * rate[twin]:
                failures.append(f"{label}: {rate[label] / rate[twin]:.2f}x < 5x {twin}")
            if efficiency < 0.998:
                failures.append(f"{label}: efficiency {100 * efficiency:.2f}% < 99.8%")
        print(f"{label:44s} {nrows} {eff:>10s} {rate[label]:11,.0f} {ratio:>9s}  {same}")
    print()
    print("vs grain: PackIterDataset against grain BestFit 1024 bins; drop-ins against their "
          "grain original.")
    if failures:
        print("targets missed:\n  " + "\n  ".join(failures))
    else:
        print("all targets met")
    return 1 if failures and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
