"""`seqpack pack` locally vs as a Beam job (DirectRunner, 1 and 2 worker processes) on chat_dev.

The real corpus (``../shared/data/chat_dev.npz``) is written, in a temporary directory, as
``--files`` Parquet files (one ``input_ids: list<int32>`` column; examples split evenly, in
order), since the Beam job reads (stages A, C) one input per element. Each configuration is one
real `seqpack pack` process (interpreter start, imports and, for Beam, worker start-up included),
best fit decreasing, L = 2048, S = 64, over-length examples truncated, shards of 1024 rows:

    local      seqpack pack FILES -o OUT --overflow truncate ...
    beam, 1    ... --runner beam --beam-option direct_num_workers=1
    beam, 2    ... --runner beam --beam-option direct_num_workers=2

``--format index`` packs rows by reference (no tokens routed after the plan). Runs alternate,
best and median of ``--repeats``. Every Beam output is checked byte for byte
against the local one (shards and manifest.json). A last row times the 2-worker Beam job on a
one-example input: its fixed cost (Beam import, worker processes, gRPC), whatever the data. ::

    .venv/bin/python -m benchmarks.beam_bench [--data PATH.npz] [--files 8] [--repeats 3]
        [--format index]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "chat_dev.npz"
RUNS = {
    "local CLI": [],
    "Beam DirectRunner, 1 worker": ["--runner", "beam", "--beam-option", "direct_num_workers=1"],
    "Beam DirectRunner, 2 workers": ["--runner", "beam", "--beam-option", "direct_num_workers=2"],
}
TWO = "Beam DirectRunner, 2 workers"


def to_parquet_files(npz: str, out_dir: str, num_files: int) -> tuple[list[str], int, int]:
    """The corpus as `num_files` Parquet files, examples in order; returns (paths, n, tokens)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    z = np.load(npz)
    tokens, offsets = z["tokens"], z["offsets"].astype(np.int64)
    n = offsets.size - 1
    cuts = np.linspace(0, n, num_files + 1).astype(np.int64)
    paths = []
    for k, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        local = (offsets[a : b + 1] - offsets[a]).astype(np.int32)
        col = pa.ListArray.from_arrays(pa.array(local),
                                       pa.array(tokens[offsets[a] : offsets[b]].astype(np.int32)))
        path = os.path.join(out_dir, f"chat_dev-{k:02d}.parquet")
        pq.write_table(pa.table({"input_ids": col}), path)
        paths.append(path)
    return paths, int(n), int(tokens.size)


def run_pack(paths: list[str], out: str, extra: list[str], seq_len: int) -> float:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "seqpack.cli", "pack", *paths, "-o", out, "--column", "input_ids",
           "--seq-len", str(seq_len), "--max-segments", "64", "--overflow", "truncate", *extra]
    t = time.perf_counter()
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    dt = time.perf_counter() - t
    if result.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr}")
    return dt


def dir_bytes(path: str) -> dict[str, bytes]:
    return {n: pathlib.Path(path, n).read_bytes() for n in sorted(os.listdir(path))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DATA))
    parser.add_argument("--files", type=int, default=8, help="Parquet files the corpus becomes")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--format", default="arrayrecord", help="seqpack pack --format")
    args = parser.parse_args()
    runs = {name: [*extra, "--format", args.format] for name, extra in RUNS.items()}
    with tempfile.TemporaryDirectory(prefix="seqpack-beam-bench-") as tmp:
        paths, n, num_tokens = to_parquet_files(args.data, tmp, args.files)
        print(f"corpus: {args.data}: {n:,} examples, {num_tokens:,} tokens in {args.files} "
              f"Parquet files; L = {args.seq_len}, S = 64, best_fit_decreasing, truncate; "
              f"--format {args.format}; {os.cpu_count()} CPUs\n")
        times: dict[str, list[float]] = {name: [] for name in RUNS}
        outputs = {name: os.path.join(tmp, f"out{k}") for k, name in enumerate(RUNS)}
        identical = {}
        for _ in range(args.repeats):
            for name, extra in runs.items():
                times[name].append(run_pack(paths, outputs[name], extra, args.seq_len))
        want = dir_bytes(outputs["local CLI"])
        manifest = json.loads(want["manifest.json"])
        for name in RUNS:
            identical[name] = dir_bytes(outputs[name]) == want
        tiny = os.path.join(tmp, "tiny.jsonl")
        with open(tiny, "w") as f:
            f.write('{"input_ids": [1, 2, 3]}\n')
        fixed = [run_pack([tiny], os.path.join(tmp, "tiny"), RUNS[TWO], args.seq_len)
                 for _ in range(args.repeats)]
        s = manifest["stats"]
        print("| runner | wall time, best (s) | median (s) | rows / lower bound | efficiency | "
              "bytes = local |")
        print("|---|---|---|---|---|---|")
        for name in RUNS:
            got = json.loads(pathlib.Path(outputs[name], "manifest.json").read_text())["stats"]
            print(f"| {name} | {min(times[name]):.2f} | {statistics.median(times[name]):.2f} | "
                  f"{got['num_rows']} / {got['lower_bound_rows']} | {got['efficiency']:.4%} | "
                  f"{'yes' if identical[name] else 'NO'} |")
        print(f"| {TWO}, one-example input (fixed cost) | {min(fixed):.2f} | "
              f"{statistics.median(fixed):.2f} | | | |")
        print(f"\nlocal: {s['num_rows']} rows, {len(manifest['shards'])} shards, "
              f"{s['counters']['truncated_examples']} examples truncated")


if __name__ == "__main__":
    main()
