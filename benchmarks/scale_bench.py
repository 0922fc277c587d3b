"""`seqpack pack` at scale: wall time, peak memory of the process tree, rows, against the I/O floor.

Corpora of k x chat_dev (``../shared/data/chat_dev.npz``, 30,590 examples, 11.7M tokens; a
synthetic lognormal corpus of the same size without it), written once as k Parquet files (one
``input_ids: list<int32>`` column, pyarrow's default writer settings) under ``--work``. Per k:

    seqpack  `python -m seqpack.cli pack FILES -o OUT --seq-len 2048 --overflow split`
             (best_fit_decreasing), a subprocess per worker count; wall time, peak RSS of the
             process tree (the CLI and its workers, sampled every 20 ms from /proc), rows
    floor    in this process, one thread: pyarrow reads the token column of the same files
             (`pq.read_table`), then the same number of bytes as the run's output is written to
             a file beside it: what any packer must at least read and write

then `seqpack verify OUT --workers N` on the output (wall time against pack's, peak RSS), and
the packed output's rows against the lower bound. Then the planner alone
(`packer.plan_rows`, the one `seqpack pack` uses) on synthetic lengths, in a subprocess per
worker count, its blocks in that many worker processes: peak RSS of the main process and time,
with the lengths held as int32, and a digest of the plan (the same for any count).

    .venv/bin/python -m benchmarks.scale_bench [--k 1 4 16 48] [--workers 1 2]
        [--plan-examples 100000000] [--plan-seq-len 2048] [--plan-max-segments 64]
        [--work /tmp/seqpack-scale]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time

import numpy as np

from benchmarks.common import DATA, corpora, print_table

ROOT = pathlib.Path(__file__).resolve().parents[1]


def write_corpus(work: pathlib.Path, k: int) -> list[str]:
    """k Parquet copies of chat_dev (reused across runs); returns their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    work.mkdir(parents=True, exist_ok=True)
    paths = [work / f"part-{i:03d}.parquet" for i in range(k)]
    missing = [p for p in paths if not p.exists()]
    if missing:
        name = "chat_dev" if (DATA / "chat_dev.npz").exists() else None
        tokens, offsets = next(iter(corpora([name] if name else None).values()))
        col = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),
                                       pa.array(tokens.astype(np.int32)))
        table = pa.table({"input_ids": col})
        for p in missing:
            pq.write_table(table, str(p) + ".tmp")
            os.replace(str(p) + ".tmp", p)
    return [str(p) for p in paths]


def tree_rss(root: int) -> int:
    """Resident bytes of `root` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/statm") as f:
                pages = int(f.read().split()[1])
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
        rss[int(entry)] = pages * os.sysconf("SC_PAGE_SIZE")
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo.extend(children.get(pid, []))
    return total


def run_measured(cmd: list[str]) -> tuple[float, int, str]:
    """Runs `cmd`; returns (seconds, peak RSS of its process tree, stdout)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    peak = [0]

    def sample():
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_rss(proc.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    out, err = proc.communicate()
    seconds = time.perf_counter() - t0
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err}")
    return seconds, peak[0], out


def io_floor(paths: list[str], out_bytes: int, where: pathlib.Path) -> float:
    """Seconds to read the token column of `paths` and write `out_bytes` bytes."""
    import pyarrow.parquet as pq

    t0 = time.perf_counter()
    for p in paths:
        col = pq.read_table(p, columns=["input_ids"]).column(0)
        del col
    block = bytes(8 << 20)
    target = where / "floor.bin"
    with open(target, "wb") as f:
        left = out_bytes
        while left > 0:
            f.write(block[: min(left, len(block))])
            left -= len(block)
    seconds = time.perf_counter() - t0
    target.unlink()
    return seconds


def dir_bytes(path: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def dir_digest(path: pathlib.Path) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in sorted(path.iterdir()):
        h.update(p.name.encode())
        with open(p, "rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()


def planner(n: int, workers: int = 1, seq_len: int = 2048, max_segments: int = 64) -> dict:
    """`plan_rows` on n synthetic lengths, in a fresh interpreter, its blocks in `workers`
    processes (as `seqpack pack --workers` plans them): seconds, peak RSS (this process's),
    rows and a digest of the plan."""
    code = f"""
import hashlib, json, resource, time
import numpy as np
from seqpack.packer import PackConfig
from seqpack.packer.plan import plan_rows
from seqpack.pipelines.offline.runners import Workers
rng = np.random.default_rng(0)
lengths = np.empty({n}, np.int32)
for a in range(0, {n}, 1 << 24):
    b = min({n}, a + (1 << 24))
    lengths[a:b] = np.clip(rng.lognormal(5.6, 0.9, b - a), 1, 8192)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
pool = Workers({workers})
t = time.perf_counter()
a = plan_rows(lengths, PackConfig({seq_len}, max_segments={max_segments}, overflow="split"),
              map_blocks=lambda fn, calls, k: pool.map(fn, calls, k, what="planning"))
seconds = time.perf_counter() - t
pool.close()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(dict(seconds=seconds, peak=peak, before=base, rows=a.num_rows,
                      blocks=-(-{n} // a.block_size), tokens=int(lengths.sum(dtype=np.int64)),
                      digest=hashlib.sha256(a.row.tobytes()).hexdigest()[:12])))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, nargs="*", default=[1, 4, 16, 48],
                    help="copies of chat_dev to pack (none: the planner alone)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--plan-examples", type=int, default=100_000_000)
    ap.add_argument("--plan-seq-len", type=int, default=2048)
    ap.add_argument("--plan-max-segments", type=int, default=64)
    ap.add_argument("--work", default="/tmp/seqpack-scale")
    ap.add_argument("--keep", action="store_true", help="keep the Parquet corpora")
    args = ap.parse_args()
    work = pathlib.Path(args.work)
    rows_out = []
    for k in args.k:
        paths = write_corpus(work / "inputs", k)
        in_bytes = sum(os.path.getsize(p) for p in paths)
        results = {}
        for w in args.workers:
            out = work / f"out-{k}-{w}"
            shutil.rmtree(out, ignore_errors=True)
            cmd = [sys.executable, "-m", "seqpack.cli", "pack", *paths[:k], "-o", str(out),
                   "--column", "input_ids", "--seq-len", "2048", "--overflow", "split",
                   "--workers", str(w), "--json"]
            seconds, peak, _ = run_measured(cmd)
            manifest = json.loads((out / "manifest.json").read_text())
            check, check_peak, _ = run_measured([sys.executable, "-m", "seqpack.cli", "verify",
                                                 str(out), "--workers", str(w)])
            results[w] = (seconds, peak, manifest, dir_bytes(out), dir_digest(out), check,
                          check_peak)
            shutil.rmtree(out)
        first = results[args.workers[0]]
        floor = io_floor(paths[:k], first[3], work)
        same = all(r[4] == first[4] for r in results.values())
        s = first[2]["stats"]
        tokens = first[2]["inputs"]["num_tokens"]
        examples = first[2]["inputs"]["num_examples"]
        for w, (seconds, peak, _, _, _, check, check_peak) in results.items():
            rows_out.append([
                f"{k}x", f"{tokens / 1e6:,.0f}M", f"{examples:,}", w, f"{seconds:.1f}",
                f"{check:.1f}", f"{check / seconds:.2f}x", f"{check_peak / 2**20:,.0f}",
                f"{tokens / seconds / 1e6:.1f}M", f"{peak / 2**20:,.0f}",
                f"{seconds / floor:.2f}x", f"{results[args.workers[0]][0] / seconds:.2f}x",
                f"{s['num_rows']:,}", f"{s['lower_bound_rows']:,}",
                f"{s['rows_over_lower_bound']:.3%}", "yes" if same else "NO",
            ])
        print(f"k={k}: inputs {in_bytes / 2**20:,.0f} MiB, output {first[3] / 2**20:,.0f} MiB, "
              f"I/O floor {floor:.1f} s", flush=True)
    if rows_out:
        print_table("seqpack pack (L=2048, best_fit_decreasing, split) on k x chat_dev as Parquet",
                    ["corpus", "tokens", "examples", "workers", "wall s", "verify s",
                     "verify / pack", "verify peak MiB", "tokens/s",
                     "peak RSS MiB", "wall / I/O floor", f"speed-up vs {args.workers[0]}",
                     "rows", "lower bound", "over bound", "same bytes"], rows_out)
    if args.plan_examples:
        n, L, S = args.plan_examples, args.plan_seq_len, args.plan_max_segments
        table = []
        for w in args.workers:
            r = planner(n, w, L, S)
            table.append([f"{n:,}", r["blocks"], w, f"{r['seconds']:.1f}",
                          f"{r['peak'] / 2**20:,.0f}", f"{r['peak'] / n:.1f}", f"{r['rows']:,}",
                          r["digest"]])
        print_table(f"packer.plan_rows on {n:,} synthetic lengths (int32, lognormal; L={L}, "
                    f"S={S}), blocks planned in `workers` processes",
                    ["examples", "blocks", "workers", "seconds", "peak RSS MiB (main)",
                     "bytes / example", "rows", "plan digest"], table)
    if not args.keep:
        shutil.rmtree(work / "inputs", ignore_errors=True)


if __name__ == "__main__":
    main()
