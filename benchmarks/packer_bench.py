"""Packer benchmark: seqpack strategies vs Grain's packers and TRL's pack_dataset, same data.

    python -m benchmarks.packer_bench [--corpus chat_dev] [--seq-len 2048] [--max-segments 64]

One table per corpus (../shared/data/*.npz, or a synthetic lognormal corpus when absent):
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
    args = ap.parse_args()
    print(f"seqpack packer benchmark ({pin_one_core()})")
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
