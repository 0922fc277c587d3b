"""Packed by reference (`--format index`) against a copy (`--format arrayrecord`), one run.

The corpus is `--copies` x chat_dev, written once under `--work` as Parquet (row groups of
`--group-rows` examples) and as ArrayRecord (one SQP1 record an example), `--files` files of
each. For each input kind both formats are packed (`PackConfig(2048, overflow="split")`,
`--workers`), then read through `make_training_pipeline` (batches of 8 rows, `--read-workers`
worker processes) for `--batches` batches after the first. Printed: the output's bytes against
the tokens' (as the inputs hold them, and as the copy's shards hold them), the pack's seconds,
and the rows per second read.

Usage (from the repo root)::

    python -m benchmarks.index_bench                          # 8 x chat_dev
    python -m benchmarks.index_bench --copies 2 --batches 200 --read-workers 2
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import tempfile
import time

import numpy as np

from benchmarks.common import corpora


def _write_inputs(work: pathlib.Path, copies: int, files: int, group_rows: int) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from seqpack.pipelines.formats.records import encode_row

    tokens, offsets = corpora(["chat_dev"])["chat_dev"]
    lengths = np.diff(offsets)
    n = lengths.size * copies
    out: dict[str, list[str]] = {"parquet": [], "arrayrecord": []}
    bounds = np.linspace(0, n, files + 1).astype(np.int64)
    for f in range(files):
        idx = np.arange(bounds[f], bounds[f + 1]) % lengths.size
        seqs = [tokens[offsets[i]:offsets[i + 1]].astype(np.int32) for i in idx]
        p = work / f"part{f}.parquet"
        if not p.exists():
            arr = pa.array(seqs, pa.list_(pa.int32()))
            pq.write_table(pa.table({"tokens": arr}), p, row_group_size=group_rows)
        out["parquet"].append(str(p))
        a = work / f"part{f}.arrayrecord"
        if not a.exists():
            from array_record.python.array_record_module import ArrayRecordWriter

            w = ArrayRecordWriter(str(a), "group_size:1")
            for s in seqs:
                w.write(encode_row({"tokens": s}))
            w.close()
        out["arrayrecord"].append(str(a))
    return out


def _pack(paths: list[str], out: pathlib.Path, fmt: str, workers: int) -> float:
    from seqpack.packer import PackConfig
    from seqpack.pipelines.offline import PackJob, WriteOptions
    from seqpack.pipelines.offline import pack as run

    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    run(PackJob(paths, str(out), PackConfig(2048, overflow="split"), workers=workers,
                write_options=WriteOptions(format=fmt)))
    return time.perf_counter() - start


def _rows_per_s(out: pathlib.Path, workers: int, batches: int) -> float:
    from seqpack.pipelines.datasets import PackedSource, Prefetch, make_training_pipeline
    from seqpack.pipelines.datasets.training import ensure_flags_parsed

    ensure_flags_parsed()
    it = iter(make_training_pipeline(PackedSource(str(out)), batch=8, shuffle_seed=0,
                                     num_epochs=None, prefetch=Prefetch(worker_count=workers)))
    next(it)
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    seconds = time.perf_counter() - start
    it.close()
    return batches * 8 / seconds


def _bytes(out: pathlib.Path, suffix: str) -> int:
    return sum(p.stat().st_size for p in out.glob(f"*{suffix}"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--copies", type=int, default=8)
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--group-rows", type=int, default=1024)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--read-workers", type=int, default=8)
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--work", default=None)
    args = p.parse_args()
    work = pathlib.Path(args.work or tempfile.mkdtemp(prefix="index_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    inputs = _write_inputs(work, args.copies, args.files, args.group_rows)
    _, offsets = corpora(["chat_dev"])["chat_dev"]
    n_tokens = int(offsets[-1]) * args.copies
    print(f"\n{args.copies} x chat_dev: {n_tokens:,} tokens in {args.files} files "
          f"(Parquet row groups of {args.group_rows}); pack workers {args.workers}, read "
          f"workers {args.read_workers}\n")
    print("| inputs | format | output MB | vs int32 tokens | vs the copy | pack s | rows/s read |")
    print("|---|---|---|---|---|---|---|")
    for kind, paths in inputs.items():
        results = {}
        for fmt, suffix in (("arrayrecord", ".arrayrecord"), ("index", ".index")):
            out = work / f"out-{kind}-{fmt}"
            seconds = _pack(paths, out, fmt, args.workers)
            results[fmt] = (_bytes(out, suffix), seconds,
                            _rows_per_s(out, args.read_workers, args.batches))
        copy = results["arrayrecord"][0]
        for fmt, (size, seconds, rate) in results.items():
            print(f"| {kind} | {fmt} | {size / 1e6:,.1f} | {size / (4 * n_tokens):.2%} | "
                  f"{size / copy:.2%} | {seconds:.1f} | {rate:,.0f} |")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
