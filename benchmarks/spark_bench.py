"""`seqpack pack` with every runner on one corpus: local processes, Beam's DirectRunner, Spark
with 1 and 2 executors on a real standalone cluster; wall time, peak memory of the driver and
of each executor (or worker process), and what Spark's shuffle moved.

The corpus is k copies of chat_dev (``../shared/data/chat_dev.npz``) as k Parquet files (one
``input_ids: list<int32>`` column: `scale_bench.write_corpus`). Each configuration is one real
`seqpack pack` process (interpreter start, imports, JVM or worker start-up included), L = 2048,
best fit decreasing, overflow split, shards of 1024 rows:

    local         seqpack pack FILES -o OUT ... --workers 2
    beam          ... --runner beam --beam-option direct_num_workers=2
    spark, 1 / 2  ... --runner spark --spark-option master=spark://... spark.cores.max=1 / 2

The Spark cluster (a master and two one-core workers, executors of
``--executor-memory``) is started here through pyspark's `spark-class`
(`tests.helpers.spark_cluster`) and stopped at the end. Memory is sampled from /proc every 50
ms: the peak RSS of the driver process (the CLI), of the driver's JVM (Spark), of each worker
process (local, Beam) and of each executor (its JVM and its Python workers together). Spark's
event log gives the bytes each stage's shuffle wrote. With ``--small-k`` the 2-executor Spark
run is repeated on that many copies too: the growth of the driver's peak between the two sizes,
per added example, is the driver's memory per example. Every output is checked byte for byte
against the local runner's (shards and manifest). ::

    .venv/bin/python -m benchmarks.spark_bench [--k 8] [--small-k 1] [--runs local beam spark1
        spark2] [--work /tmp/seqpack-spark-bench] [--format index]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import json
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time

from benchmarks.common import print_table
from benchmarks.scale_bench import dir_digest, write_corpus

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = os.sysconf("SC_PAGE_SIZE")
ARGS = ["--column", "input_ids", "--seq-len", "2048", "--overflow", "split", "--shard-rows",
        "1024"]


def _procs() -> dict[int, tuple[int, int, bytes]]:
    """pid -> (parent pid, RSS bytes, command line) of every process."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/statm") as f:
                rss = int(f.read().split()[1]) * PAGE
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        out[int(entry)] = (ppid, rss, cmd)
    return out


def _tree(root: int, procs: dict) -> list[int]:
    children = collections.defaultdict(list)
    for pid, (ppid, _, _) in procs.items():
        children[ppid].append(pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children[pid])
    return found


class Sampler:
    """Peak RSS per role, every 50 ms, while a `seqpack pack` runs: "driver" (the CLI),
    "driver JVM", each "worker <pid>" (the CLI's other descendants) and each "executor
    <pid>" (an executor JVM of the cluster with its Python workers)."""

    def __init__(self, cli: int):
        self.cli = cli
        self.peaks: dict[str, int] = collections.defaultdict(int)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            procs = _procs()
            mine = [p for p in _tree(self.cli, procs) if p in procs]
            jvms = [p for p in mine if p != self.cli and procs[p][2].split(b"\0")[0].endswith(
                b"java")]
            in_jvm = {q for j in jvms for q in _tree(j, procs) if q in procs}
            self._peak("driver", procs.get(self.cli, (0, 0, b""))[1])
            if jvms:  # a local master's Python workers are the driver JVM's children
                self._peak("driver JVM", sum(procs[q][1] for q in in_jvm))
            for pid in mine:  # the local runner's and Beam's workers (not a launch script)
                if pid != self.cli and pid not in in_jvm and not procs[pid][2].split(b"\0")[
                        0].endswith((b"sh", b"bash")):
                    self._peak(f"worker {pid}", procs[pid][1])
            for pid, (_, _, cmd) in procs.items():
                if b"CoarseGrainedExecutorBackend" in cmd:
                    self._peak(f"executor {pid}",
                               sum(procs[q][1] for q in _tree(pid, procs) if q in procs))
            self.stop.wait(0.05)

    def _peak(self, role: str, rss: int) -> None:
        self.peaks[role] = max(self.peaks[role], rss)

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def run_pack(paths: list[str], out: pathlib.Path, extra: list[str]) -> tuple[float, dict]:
    """One `seqpack pack`; (seconds, peak RSS by role)."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "seqpack.cli", "pack", *paths, "-o", str(out), *ARGS, *extra]
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    with Sampler(proc.pid) as sampler:
        _, err = proc.communicate()
    seconds = time.perf_counter() - t
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-3000:]}")
    return seconds, dict(sampler.peaks)


def stages(event_dir: pathlib.Path) -> list[list]:
    """[stage, what, tasks, seconds, task seconds, shuffle bytes written] of each stage that
    ran, from the Spark event log in `event_dir` (one application); task seconds: the
    executors' run time of its successful tasks, added up."""
    info: dict[int, dict] = {}
    written: dict[int, int] = collections.defaultdict(int)
    busy: dict[int, int] = collections.defaultdict(int)
    for path in glob.glob(str(event_dir / "**" / "*"), recursive=True):
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            for line in f:
                event = json.loads(line)
                kind = event.get("Event")
                if kind == "SparkListenerStageCompleted":
                    stage = event["Stage Info"]
                    info[stage["Stage ID"]] = stage
                elif kind == "SparkListenerTaskEnd" and event.get("Task End Reason", {}).get(
                        "Reason") == "Success":
                    metrics = event.get("Task Metrics") or {}
                    busy[event["Stage ID"]] += metrics.get("Executor Run Time", 0)
                    written[event["Stage ID"]] += metrics.get("Shuffle Write Metrics", {}).get(
                        "Shuffle Bytes Written", 0)
    return [[k, v["Stage Name"].split(" at ")[0], v["Number of Tasks"],
             (v["Completion Time"] - v["Submission Time"]) / 1000, busy[k] / 1000, written[k]]
            for k, v in sorted(info.items())]


def mib(n: int) -> str:
    return f"{n / 2**20:,.0f}"


def _spark_flags(url: str, executors: int, memory: str, events: pathlib.Path) -> list[str]:
    options = [f"master={url}", f"spark.cores.max={executors}", "spark.executor.cores=1",
               f"spark.executor.memory={memory}", "spark.eventLog.enabled=true",
               f"spark.eventLog.dir=file://{events}", "spark.eventLog.compress=false",
               "spark.eventLog.rolling.enabled=false"]
    return ["--runner", "spark", *(x for o in options for x in ("--spark-option", o))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=8, help="copies of chat_dev")
    ap.add_argument("--small-k", type=int, default=1,
                    help="copies for the driver's memory per example (0: skip)")
    ap.add_argument("--runs", nargs="+", default=["local", "beam", "spark1", "spark2"])
    ap.add_argument("--executor-memory", default="2g")
    ap.add_argument("--work", default="/tmp/seqpack-spark-bench")
    ap.add_argument("--format", default="arrayrecord", help="seqpack pack --format")
    args = ap.parse_args()
    fmt = ["--format", args.format]
    from tests.helpers.spark_cluster import spark_class, standalone_cluster

    if any(r.startswith("spark") for r in args.runs) and spark_class() is None:
        raise SystemExit("the Spark runs need pyspark and java (pip install '.[spark]')")
    work = pathlib.Path(args.work)
    paths = write_corpus(work / "inputs", args.k)
    results: dict[str, tuple[float, dict, str]] = {}
    shuffles: dict[str, list[list]] = {}
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(standalone_cluster(
            work / "cluster", memory=args.executor_memory)) if any(
            r.startswith("spark") for r in args.runs) else None
        for run in ["local", *[r for r in args.runs if r != "local"]]:
            out = work / f"out-{run}"
            extra = ["--workers", "2"]
            if run == "beam":
                extra = ["--runner", "beam", "--beam-option", "direct_num_workers=2"]
            elif run.startswith("spark"):
                events = work / f"events-{run}"
                shutil.rmtree(events, ignore_errors=True)
                events.mkdir(parents=True)
                extra = _spark_flags(cluster.url, int(run[5:]), args.executor_memory, events)
            seconds, peaks = run_pack(paths, out, [*extra, *fmt])
            results[run] = (seconds, peaks, dir_digest(out))
            if run.startswith("spark"):
                shuffles[run] = stages(events)
            if run != "local":
                shutil.rmtree(out)
            print(f"{run}: {seconds:.1f} s", flush=True)
        manifest = json.loads((work / "out-local" / "manifest.json").read_text())
        small = None
        if args.small_k and "spark2" in args.runs:
            small_paths = write_corpus(work / "inputs", args.k)[: args.small_k]
            events = work / "events-small"
            shutil.rmtree(events, ignore_errors=True)
            events.mkdir(parents=True)
            seconds, peaks = run_pack(small_paths, work / "out-small", [*_spark_flags(
                cluster.url, 2, args.executor_memory, events), *fmt])
            small = (seconds, peaks, json.loads(
                (work / "out-small" / "manifest.json").read_text())["inputs"]["num_examples"])
            shutil.rmtree(work / "out-small")
    _report(args, manifest, results, shuffles, small)
    shutil.rmtree(work / "out-local", ignore_errors=True)


def _report(args, manifest: dict, results: dict, shuffles: dict, small) -> None:
    s, inputs = manifest["stats"], manifest["inputs"]
    n, tokens = inputs["num_examples"], inputs["num_tokens"]
    print(f"\ncorpus: {args.k} x chat_dev as {args.k} Parquet files: {n:,} examples, "
          f"{tokens:,} tokens; {s['num_rows']:,} rows in {len(manifest['shards'])} shards; "
          f"--format {args.format}; {os.cpu_count()} CPUs")
    want = results["local"][2]
    rows = []
    for run, (seconds, peaks, digest) in results.items():
        workers = sorted(v for k, v in peaks.items() if k.startswith(("worker", "executor"))
                         and v)  # an executor of the run before, gone before it was sampled
        rows.append([run, f"{seconds:.1f}", f"{tokens / seconds / 1e6:.1f}M",
                     mib(peaks.get("driver", 0)), mib(peaks.get("driver JVM", 0)) if run.startswith(
                         "spark") else "", len(workers), " / ".join(mib(w) for w in workers[-4:]),
                     "yes" if digest == want else "NO"])
    print_table("seqpack pack by runner (peak RSS in MiB; executors: JVM + its Python workers)",
                ["run", "wall s", "tokens/s", "driver", "driver JVM", "workers / executors",
                 "their peaks (largest 4)", "bytes = local"], rows)
    for run, ran in shuffles.items():
        print_table(f"{run}: the stages (Spark's event log; the shuffle's bytes as written, "
                    "compressed)", ["stage", "what", "tasks", "seconds", "task seconds",
                                    "shuffle MiB", "bytes per token"],
                    [[k, what, n, f"{sec:.1f}", f"{cpu:.1f}", mib(w), f"{w / tokens:.2f}"]
                     for k, what, n, sec, cpu, w in ran])
    if small is not None and "spark2" in results:
        seconds, peaks, n_small = small
        big = results["spark2"][1]
        table = []
        for role in ("driver", "driver JVM"):
            grow = big.get(role, 0) - peaks.get(role, 0)
            table.append([role, mib(peaks.get(role, 0)), mib(big.get(role, 0)),
                          f"{grow / max(1, n - n_small):.1f}"])
        print_table(f"the driver's memory per example: spark, 2 executors, {args.small_k}x "
                    f"({n_small:,} examples, {seconds:.1f} s) against {args.k}x ({n:,})",
                    ["process", f"peak {args.small_k}x MiB", f"peak {args.k}x MiB",
                     "bytes per added example"], table)


if __name__ == "__main__":
    main()
