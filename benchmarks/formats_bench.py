"""`seqpack pack --format`: time and bytes of every format against ArrayRecord, and `--format hf`
end to end against TRL's own `pack_dataset(strategy="bfd")` + `Dataset.to_parquet`, one run.

The corpus: chat_sft_dev (``../shared/data/chat_sft_dev.npz``; label -100 on each example's
prompt) repeated until it holds `--tokens` tokens (default 10^8), as one Parquet file of
`input_ids` and `labels` (`list<int32>` each; a synthetic lognormal corpus without the data). In
one process, one after the other:

    seqpack <format>  offline.runners.pack_to_dir, what `seqpack pack` calls: both columns,
                      L = --seq-len, best fit decreasing, --overflow truncate, --workers
                      processes, each --compression; output bytes = every file it wrote
                      (shards, manifest, side files); random reads: `PackedSource` rows at
                      shuffled indices, rows/s
    trl               datasets.Dataset(pq.read_table(corpus)) + trl.pack_dataset(ds, L, "bfd")
                      (truncates too) + ds.to_parquet(file): TRL's padding-free rows written
                      (pyarrow's defaults: snappy, dictionary pages), in a process of its own

Efficiency = real tokens / (rows x L). Usage::

    python -m benchmarks.formats_bench [--tokens 1e8] [--seq-len 4096] [--workers 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.common import DATA, print_table

FORMATS = ("arrayrecord", "parquet", "hf", "megatron")


def write_corpus(path: str, tokens: float, data: str) -> tuple[int, int]:
    """The corpus Parquet file (see the module docstring): (examples, tokens)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if os.path.exists(data):
        z = np.load(data)
        values, offsets = z["tokens"].astype(np.int32), z["offsets"]
        prompt = z["prompt_lengths"] if "prompt_lengths" in z.files else np.zeros(
            offsets.size - 1, np.int64)
    else:
        rng = np.random.default_rng(0)
        lengths = np.clip(rng.lognormal(5.6, 0.7, 30_000).astype(np.int64), 1, 9_000)
        offsets = np.concatenate(([0], np.cumsum(lengths)))
        values = rng.integers(0, 30_000, int(offsets[-1])).astype(np.int32)
        prompt = lengths // 10
    position = np.arange(values.size) - np.repeat(offsets[:-1], np.diff(offsets))
    labels = np.where(position < np.repeat(prompt, np.diff(offsets)), -100, values).astype(
        np.int32)
    copies = max(1, int(np.ceil(tokens / values.size)))
    ids = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values))
    lab = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(labels))
    table = pa.table({"input_ids": ids, "labels": lab})
    with pq.ParquetWriter(path, table.schema) as writer:
        for _ in range(copies):
            writer.write_table(table)
    return copies * (offsets.size - 1), copies * int(values.size)


def output_bytes(out: str) -> int:
    return sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out))


def run_seqpack(corpus: str, out: str, fmt: str, seq_len: int, workers: int,
                reads: int, compression: str) -> dict:
    from seqpack.packer import PackConfig
    from seqpack.pipelines.datasets import PackedSource
    from seqpack.pipelines.formats.inputs import ReadOptions
    from seqpack.pipelines.offline import PackJob, WriteOptions
    from seqpack.pipelines.offline.runners import pack_to_dir

    shutil.rmtree(out, ignore_errors=True)
    job = PackJob([corpus], out, PackConfig(seq_len, overflow="truncate", feature="input_ids"),
                  read_options=ReadOptions(column="input_ids", extra_columns=("labels",)),
                  write_options=WriteOptions(format=fmt, compression=compression),
                  workers=workers)
    t = time.perf_counter()
    manifest = pack_to_dir(job)
    dt = time.perf_counter() - t
    source = PackedSource(out)
    order = np.random.default_rng(0).permutation(len(source))[:reads]
    t = time.perf_counter()
    for i in order.tolist():
        source[i]
    read_rate = order.size / (time.perf_counter() - t)
    stats = manifest.stats or {}
    return {"time": dt, "bytes": output_bytes(out), "rows": stats["num_rows"],
            "real": stats["real_tokens"], "reads": read_rate}


_TRL = """
import json, os, sys, time
import pyarrow.compute as pc
import pyarrow.parquet as pq
from datasets import Dataset, disable_progress_bars
from trl import pack_dataset

corpus, out, seq_len = sys.argv[1], sys.argv[2], int(sys.argv[3])
disable_progress_bars()
t = time.perf_counter()
packed = pack_dataset(Dataset(pq.read_table(corpus)), seq_len, strategy="bfd")
packed.to_parquet(os.path.join(out, "packed.parquet"))
dt = time.perf_counter() - t
lengths = packed.data.column("seq_lengths").combine_chunks()
print(json.dumps({"time": dt, "rows": len(packed),
                  "real": pc.sum(pc.list_flatten(lengths)).as_py()}))
"""


def run_trl(corpus: str, out: str, seq_len: int) -> dict:
    """TRL in a process of its own, started in `out` (from the repository root, its folder
    `kernels/` would shadow Hugging Face's `kernels` package that transformers imports); the
    time covers reading, packing and writing, not the imports."""
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    done = subprocess.run([sys.executable, "-c", _TRL, corpus, out, str(seq_len)], cwd=out,
                          capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return {**result, "bytes": output_bytes(out), "reads": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(DATA / "chat_sft_dev.npz"))
    ap.add_argument("--tokens", type=float, default=1e8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--reads", type=int, default=2000, help="random row reads per format")
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    ap.add_argument("--compression", nargs="+", default=["none", "snappy"],
                    choices=["none", "snappy", "zstd"], help="each format with each")
    ap.add_argument("--no-trl", action="store_true")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="seqpack-formats-bench-")
    try:
        corpus = os.path.join(work, "corpus.parquet")
        n, tokens = write_corpus(corpus, args.tokens, args.data)
        print(f"corpus: {n:,} examples, {tokens:,} tokens, input_ids + labels "
              f"({os.path.getsize(corpus) / 2**20:,.0f} MiB Parquet); L = {args.seq_len}, "
              f"overflow truncate, {args.workers} worker(s), {os.cpu_count()} CPUs")
        results = {f"seqpack {fmt} ({c})": run_seqpack(corpus, os.path.join(work, fmt), fmt,
                                                       args.seq_len, args.workers, args.reads, c)
                   for c in args.compression for fmt in args.formats}
        if not args.no_trl:
            results["trl pack_dataset + to_parquet"] = run_trl(corpus, os.path.join(work, "trl"),
                                                               args.seq_len)
        base = results.get(f"seqpack arrayrecord ({args.compression[0]})")
        rows = []
        for name, r in results.items():
            vs = f"{r['bytes'] / base['bytes']:.2f}x / {r['time'] / base['time']:.2f}x" \
                if base else "n/a"
            rows.append([name, f"{r['rows']:,}", f"{r['real'] / (r['rows'] * args.seq_len):.4%}",
                         f"{r['time']:.1f}", f"{tokens / r['time'] / 1e6:.1f}M",
                         f"{r['bytes'] / 2**20:,.0f}", vs,
                         "n/a" if r["reads"] is None else f"{r['reads']:,.0f}"])
        print_table("formats", ["system", "rows", "efficiency", "s", "tokens/s", "MiB",
                                "bytes / time vs arrayrecord", "random rows/s"], rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
