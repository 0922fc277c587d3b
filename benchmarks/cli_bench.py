"""End to end offline packing: `seqpack pack` (read Parquet, plan, write) vs TRL pack_dataset.

The real corpus (``../shared/data/chat_dev.npz``) is converted once to a Parquet file with one
``input_ids: list<int32>`` column (pyarrow's default writer settings). Then, alternating, best of
``--repeats`` runs each, in one process, after a warm-up run of each:

    seqpack   offline.runners.pack_to_dir, the function `seqpack pack` calls: read the Parquet
              column, plan (best fit decreasing, global), assemble every row, encode SQP1 records,
              write ArrayRecord shards (uncompressed) + manifest.json
    trl       datasets.Dataset(pyarrow.parquet.read_table(...)) + trl.pack_dataset(..., "bfd")
              (in-memory Arrow result: input_ids + seq_lengths; nothing written)

Both truncate over-length examples (TRL "bfd"; seqpack --overflow truncate). Efficiency = real
tokens / (rows x seq_len). One real `seqpack pack` subprocess run is timed too (interpreter start
and imports included). Usage::

    .venv/bin/python -m benchmarks.cli_bench [--data PATH.npz] [--seq-len 2048] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from seqpack.packer import PackConfig, assemble, lower_bound, plan
from seqpack.pipelines.formats.inputs import ReadOptions, read_corpus
from seqpack.pipelines.offline import PackJob, WriteOptions
from seqpack.pipelines.offline.runners import pack_to_dir

ROOT = pathlib.Path(__file__).resolve().parents[1]


def to_parquet(npz: str, path: str) -> tuple[int, int]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    z = np.load(npz)
    tokens, offsets = z["tokens"], z["offsets"]
    col = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),
                                   pa.array(tokens.astype(np.int32)))
    pq.write_table(pa.table({"input_ids": col}), path)
    return int(offsets.size - 1), int(tokens.size)


def run_seqpack(parquet: str, out: str, seq_len: int, compression: str) -> dict:
    """`seqpack pack` in-process into a fresh directory (removed afterwards, untimed)."""
    config = PackConfig(seq_len, max_segments=64, strategy="best_fit_decreasing",
                        overflow="truncate")
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    manifest = pack_to_dir(PackJob([parquet], out, config, workers=1,
                                   read_options=ReadOptions(column="input_ids"),
                                   write_options=WriteOptions(compression=compression)))
    dt = time.perf_counter() - t
    s = manifest.stats
    return {"time": dt, "rows": s["num_rows"], "real": s["real_tokens"],
            "segments": s["num_segments"]}


def run_in_memory(parquet: str, seq_len: int) -> dict:
    """Read + plan + assemble every row in memory (what TRL's timing covers); nothing written."""
    config = PackConfig(seq_len, max_segments=64, strategy="best_fit_decreasing",
                        overflow="truncate")
    t = time.perf_counter()
    corpus = read_corpus([parquet], ReadOptions(column="input_ids"))
    p = plan(corpus.lengths, config)
    batch = assemble(corpus.values, corpus.offsets, p, config)
    dt = time.perf_counter() - t
    seg = batch["tokens_segment_lengths"]
    return {"time": dt, "rows": p.num_rows, "real": int(seg.sum()),
            "segments": int((seg > 0).sum())}


def run_trl(parquet: str, seq_len: int) -> dict | None:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    from datasets import Dataset
    from trl import pack_dataset

    t = time.perf_counter()
    ds = Dataset(pq.read_table(parquet))
    packed = pack_dataset(ds, seq_len, strategy="bfd")
    dt = time.perf_counter() - t
    lengths = packed.data.column("seq_lengths").combine_chunks()
    real = pc.sum(pc.list_flatten(lengths)).as_py()
    return {"time": dt, "rows": len(packed), "real": real,
            "segments": len(pc.list_flatten(lengths))}


def trl_available() -> str | None:
    try:
        import datasets  # noqa: F401
        from trl import pack_dataset  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: skip TRL
        return f"{type(e).__name__}: {e}"
    try:
        datasets.disable_progress_bars()
    except AttributeError:
        pass
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "chat_dev.npz"))
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--compression", default="none", choices=["none", "snappy", "zstd"])
    args = ap.parse_args()
    if not os.path.exists(args.data):
        sys.exit(f"{args.data} not found; pass --data PATH.npz (tokens + offsets)")
    work = tempfile.mkdtemp(prefix="seqpack-cli-bench-")
    try:
        parquet = os.path.join(work, "corpus.parquet")
        n, tokens = to_parquet(args.data, parquet)
        print(f"corpus: {n:,} examples, {tokens:,} tokens -> {parquet} "
              f"({os.path.getsize(parquet) / 1e6:.1f} MB, list<int32>), L={args.seq_len}, "
              f"best of {args.repeats}, {os.cpu_count()} CPUs (shared)")
        skip = trl_available()
        out = os.path.join(work, "packed")
        names = ("seqpack", "seqpack in memory", "trl")
        times: dict[str, list[float]] = {name: [] for name in names}
        results: dict[str, dict] = {}
        for rep in range(args.repeats + 1):  # rep 0 warms up both
            r = run_seqpack(parquet, out, args.seq_len, args.compression)
            results["seqpack"] = r
            if rep:
                times["seqpack"].append(r["time"])
            r = run_in_memory(parquet, args.seq_len)
            results["seqpack in memory"] = r
            if rep:
                times["seqpack in memory"].append(r["time"])
            if skip is None:
                r = run_trl(parquet, args.seq_len)
                results["trl"] = r
                if rep:
                    times["trl"].append(r["time"])
        disk = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)) / 1e6
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "seqpack.cli", "pack", parquet, "-o", out + "-sub",
                        "--column", "input_ids", "--seq-len", str(args.seq_len),
                        "--overflow", "truncate", "--compression", args.compression,
                        "--overwrite"], cwd=ROOT, check=True, capture_output=True)
        sub_time = time.perf_counter() - t
        print("\n| system | rows | lower bound | efficiency | best s | median s | tokens/s "
              "| vs TRL |\n|---|---|---|---|---|---|---|---|")
        trl_best = min(times["trl"]) if times["trl"] else None
        for name in names:
            if name not in results:
                continue
            r = results[name]
            best, med = min(times[name]), statistics.median(times[name])
            cap = r["segments"] if name == "trl" else 64
            lb = lower_bound(r["real"], r["segments"], args.seq_len, cap)
            ratio = f"{trl_best / best:.2f}x" if trl_best else "n/a"
            eff = r["real"] / (r["rows"] * args.seq_len)
            print(f"| {name} | {r['rows']:,} | {lb:,} | {eff:.4%} "
                  f"| {best:.3f} | {med:.3f} | {tokens / best / 1e6:.1f}M | {ratio} |")
        print(f"\nseqpack output: {disk:.0f} MB of shards ({args.compression}); "
              f"`seqpack pack` as a subprocess (interpreter + imports included): {sub_time:.2f} s "
              f"= {tokens / sub_time / 1e6:.1f}M tokens/s")
        if skip is not None:
            print(f"TRL skipped: {skip}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
