"""Packer benchmark: seqpack strategies vs Grain's packers and TRL's pack_dataset, same data.

    python -m benchmarks.packer_bench [--corpus chat_dev] [--seq-len 2048] [--max-segments 64]
    python -m benchmarks.packer_bench --grid [--corpus chat_turns] [--grid-seq-len 8192 ...]
    python -m benchmarks.packer_bench --scan [--corpus chat_dev]
    python -m benchmarks.packer_bench --boundary [--corpus chat_turns] [--repeat 8]

`--grid`: per corpus of benchmarks/corpora.py (chat_dev, gsm8k_train, stdlib_source,
chat_turns) and cell of L in {2k, 8k, 32k, 128k} x S in {8, 16, 32, 64, 256, 4096}: the simple bound
max(ceil(T/L), ceil(n/S)), the tight bound (`packer.bounds`) and rows over the tight bound for
best_fit_decreasing (the offline default), the baseline's best_fit_decreasing, best_fit,
first_fit and `StreamPlanner` (window 1024, its defaults) over the examples in corpus order and
in a seeded random order (as a loader that shuffles before packing feeds it), overflow split;
then `plan_rows` time
with this best_fit_decreasing against the baseline's (`--baseline`, default f002f8b: the packer
before the two-dimensional planner; its module loaded from `git show REV:...` into this
process, the two timed alternately, best of 3), in total and split by whether the baseline's
rows are within the target (`repair_target`) in the cell.

`--boundary`: where slots and tokens bind alike, S = f * L / (mean piece) for f in {0.8, 0.9,
1, 1.1, 1.25} and L in {2k, 8k, 32k, 128k}: the offline default against its target and
`StreamPlanner` (corpus order and shuffled) against the online one (0.3%, at least one row);
for the corpus-order cells above it, the rows of a perfect plan of each half and each eighth
of the corpus on its own (`parts_bound`: how far the corpus's order drifts).

`--repeat R` (with --grid, --scan, --boundary): each corpus R times over, each copy in its own
seeded order, so the plan sees a corpus R times larger with the same lengths.

`--cell NAME/L/S` (repeatable, with `--repeat`): the offline default at those cells against its
target, the same without the sample fills (`improve._SAMPLE_MODES` empty), and the
baseline's (`--baseline`), all timed in this process (what a plan costs at scale: `--repeat 128`
is about the 4M examples of a default block).

`--synthetic N [--seed K] [--lp SECONDS] [--small]`: seeded lognormal corpora the defaults were
not tuned on (benchmarks/synthetic_bench.py).

`--scan`: the offline default alone over L in {2k, 4k, 8k, 32k, 128k} x S in {8, 12, 16, 24,
32, 48, 64, 128, 256, 1024, 4096} (220 cells over the four corpora): rows over the tight bound
against the target of `best_fit_decreasing.repair_target` (0.1%, at least one row), plan time,
and the cells above the target.

The planning runs (`--grid`, `--scan`, `--cell`, `--boundary`) and the baseline's loading live
in benchmarks/packer_cells.py, `--synthetic` in benchmarks/synthetic_bench.py; without those
flags, one table per corpus (../shared/data/*.npz, or a synthetic lognormal corpus when absent):
strategy, rows, lower bound, efficiency, examples/s, tokens/s. Everything runs in this process on
one core; over-length examples are truncated to seq_len everywhere (as Grain and TRL's "bfd" do).
seqpack and TRL: one warm-up call, then the best of 3; Grain: one pass (it is slow).
Grain and TRL are measured only when installed.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.common import best_time, corpora, fmt_rate, pin_one_core, print_table
from benchmarks.packer_cells import BASELINE, run_boundary, run_cells, run_grid, run_scan
from seqpack.packer import PackConfig, StreamPlanner, lower_bound, pack_ragged, pack_stream


def _row(name, rows, lb, real, L, seconds, n, tokens, note=""):
    eff = real / (rows * L) if rows else 0.0
    return [name, rows, lb, f"{(rows / lb - 1) * 100:+.2f}%", f"{eff * 100:.2f}%",
            fmt_rate(n / seconds), fmt_rate(tokens / seconds), note]


def bench_seqpack(tokens, offsets, L, S, window):
    n = offsets.size - 1
    total = int(offsets[-1])
    lengths = np.minimum(np.diff(offsets), L)
    lb = lower_bound(int(lengths.sum()), int((lengths > 0).sum()), L, S)
    out = []
    for strategy in ["best_fit_decreasing", "best_fit", "first_fit", "concat_split"]:
        cfg = PackConfig(L, max_segments=S, strategy=strategy, overflow="truncate")
        t, b = best_time(lambda cfg=cfg: pack_ragged(tokens, offsets, cfg))
        rows = b["tokens"].shape[0]
        real = int(b["tokens_segment_lengths"].sum())
        note = "cuts examples" if strategy == "concat_split" else ""
        lb_here = lb if strategy != "concat_split" else lower_bound(
            int(np.diff(offsets).sum()), n, L, S)
        out.append(_row(f"seqpack {strategy} (pack_ragged)", rows, lb_here, real, L, t, n, total,
                        note))
    cfg = PackConfig(L, max_segments=S, overflow="truncate")
    raw = np.diff(offsets)

    def planner_only():
        planner = StreamPlanner(cfg, window=window)
        rows = real = 0
        for i in range(0, n, window):
            for r in planner.add(np.arange(i, min(i + window, n)), raw[i : i + window]):
                rows += 1
                real += int(r.length.sum())
        for r in planner.finish():
            rows += 1
            real += int(r.length.sum())
        return rows, real

    t, (rows, real) = best_time(planner_only)
    out.append(_row(f"seqpack stream w={window} (planner alone)", rows, lb, real, L, t, n, total))
    seqs = [tokens[offsets[i] : offsets[i + 1]] for i in range(n)]

    def stream():
        rows = real = 0
        for r in pack_stream(seqs, cfg, window=window):
            rows += 1
            real += int(r["tokens_segment_lengths"].sum())
        return rows, real

    t, (rows, real) = best_time(stream)
    out.append(_row(f"seqpack pack_stream w={window} (row dicts)", rows, lb, real, L, t, n, total))
    return out, lb


def bench_grain(tokens, offsets, L, lb):
    try:
        import grain
    except ImportError:
        return [["grain (not installed)"] + [""] * 7]
    # No prefetch threads: one core, and Grain's thread prefetch would dominate the timing.
    _NO_THREADS = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
    n = offsets.size - 1
    total = int(offsets[-1])
    source = [{"tokens": tokens[offsets[i] : offsets[i] + min(L, offsets[i + 1] - offsets[i])]}
              for i in range(n)]
    out = []
    for cls_name, bins in [("FirstFit", 64), ("FirstFit", 1024), ("BestFit", 64),
                           ("BestFit", 1024)]:
        cls = getattr(grain.experimental, f"{cls_name}PackIterDataset")

        def run(cls=cls, bins=bins, _NO_THREADS=_NO_THREADS):
            ds = grain.MapDataset.source(source).to_iter_dataset(_NO_THREADS)
            ds = cls(ds, length_struct={"tokens": L}, num_packing_bins=bins, shuffle_bins=False)
            rows = real = 0
            for ex in ds:
                rows += 1
                real += int(np.count_nonzero(ex["tokens_segment_ids"]))
            return rows, real

        t0 = time.perf_counter()
        rows, real = run()
        t = time.perf_counter() - t0
        out.append(_row(f"grain {cls_name} {bins} bins", rows, lb, real, L, t, n, total))
    return out


def bench_trl(tokens, offsets, L, lb):
    try:
        import pyarrow as pa
        from datasets import Dataset
        from trl import pack_dataset
    except ImportError:
        return [["trl pack_dataset (not installed)"] + [""] * 7]
    n = offsets.size - 1
    total = int(offsets[-1])
    arr = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(tokens))
    ds = Dataset(pa.table({"input_ids": arr}))
    out = []
    for name, kwargs in [("global", {"batch_size": None}), ("batches of 1000", {})]:
        t, packed = best_time(lambda kwargs=kwargs: pack_dataset(ds, L, strategy="bfd",
                                                                 map_kwargs=kwargs), repeats=3)
        lens = packed.data.column("seq_lengths").combine_chunks().flatten().to_numpy()
        out.append(_row(f"trl pack_dataset bfd, {name}", len(packed), lb, int(lens.sum()), L, t,
                        n, total, "no segment cap"))
    return out


def _parse_rate(text: str) -> float:
    scale = {"M": 1e6, "k": 1e3}.get(text[-1], 1.0)
    return float(text.rstrip("Mk")) * scale


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", action="append", help="corpus name (default: all)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--max-segments", type=int, default=64)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--no-baselines", action="store_true", help="skip Grain and TRL")
    ap.add_argument("--grid", action="store_true", help="the (L, S) grid (see the docstring)")
    ap.add_argument("--grid-seq-len", type=int, action="append")
    ap.add_argument("--grid-max-segments", type=int, action="append")
    ap.add_argument("--no-stream", action="store_true", help="--grid without StreamPlanner")
    ap.add_argument("--scan", action="store_true", help="the offline default over a finer grid "
                    "against its target (packer_cells.run_scan)")
    ap.add_argument("--boundary", action="store_true", help="offline and online where slots "
                    "and tokens bind alike (packer_cells.run_boundary)")
    ap.add_argument("--cell", action="append", help="NAME/L/S: the offline default there, with "
                    "and without the sample fills (repeatable; packer_cells.run_cells)")
    ap.add_argument("--synthetic", type=int, default=0, help="N seeded lognormal corpora, the "
                    "offline default against the baseline (synthetic_bench.run_synthetic)")
    ap.add_argument("--seed", type=int, default=0, help="--synthetic: the corpora's seed")
    ap.add_argument("--small", action="store_true", help="--synthetic: corpora of 500 to 3,000 "
                    "lengths, N seeds of three (synthetic_bench.small_cells)")
    ap.add_argument("--lp", type=float, default=0.0, help="--synthetic: seconds of the "
                    "configuration LP bound (benchmarks/lp_bound.py) per cell above the target")
    ap.add_argument("--repeat", type=int, default=1, help="--grid, --scan, --boundary, --cell: "
                    "each corpus this many times over, every copy shuffled (packer_cells._lengths)")
    ap.add_argument("--baseline", default=BASELINE, help="git revision timed against (default: "
                    "the packer before the two-dimensional planner)")
    args = ap.parse_args()
    print(f"seqpack packer benchmark ({pin_one_core()})")
    if args.grid:
        run_grid(args)
        return
    if args.scan:
        run_scan(args)
        return
    if args.boundary:
        run_boundary(args)
        return
    if args.cell:
        run_cells(args)
        return
    if args.synthetic:
        from benchmarks.synthetic_bench import run_synthetic

        run_synthetic(args)
        return
    L, S = args.seq_len, args.max_segments
    header = ["packer", "rows", "lower bound", "rows vs LB", "efficiency", "examples/s",
              "tokens/s", "note"]
    for name, (tokens, offsets) in corpora(args.corpus).items():
        n, total = offsets.size - 1, int(offsets[-1])
        rows, lb = bench_seqpack(tokens, offsets, L, S, args.window)
        if not args.no_baselines:
            rows += bench_grain(tokens, offsets, L, lb)
            rows += bench_trl(tokens, offsets, L, lb)
        print_table(f"{name}: {n} examples, {total} tokens, L={L}, max_segments={S}, one core",
                    header, rows)
        rate = {r[0]: r[6] for r in rows if len(r) > 6}
        bfd, trl = rate.get("seqpack best_fit_decreasing (pack_ragged)"), rate.get(
            "trl pack_dataset bfd, global")
        if bfd and trl:
            print(f"best_fit_decreasing vs TRL global: {_parse_rate(bfd) / _parse_rate(trl):.1f}x "
                  "tokens/s")
        if L == 2048 and S == 64:
            big, lb_big = bench_seqpack(tokens, offsets, 8192, 16, args.window)
            print_table(f"{name}: L=8192, max_segments=16 (the segment cap binds)", header,
                        big[:1])


if __name__ == "__main__":
    main()
