"""The Beam / Spark route step on one large input: peak memory and seconds, against a revision.

    python -m benchmarks.route_bench [--baseline REV] [--examples 2000000] [--mu 1.6]
        [--format parquet]

One input of --examples lognormal examples (log-lengths mean --mu, sigma 1: median 5 tokens at
1.6, 400 at 6; up to 4,000; int32 ids) is
planned in this process as a runner plans it (`offline.steps`: scan, blocks, plan, split), at
L=2048 / S=256; then `steps.route_file` re-reads it and cuts its pieces' tokens into the parts
each shard receives, in a child process of its own per revision (peak RSS counted from just
before the route, the plan already held; each part the step gives is written to a file as it
comes, as a runner's shuffle takes it): this tree's, and the baseline revision's
`pipelines/offline/steps.py` loaded from git into the same seqpack. "same parts" compares a
digest of every shard's pieces in plan order (`steps.plan_parts`).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

from benchmarks.common import file_at, print_table

ROOT = pathlib.Path(__file__).resolve().parents[1]

_CHILD = r"""
import hashlib, importlib.util, json, os, pickle, shutil, sys, tempfile, time
import numpy as np
from seqpack.packer import PackConfig
from seqpack.pipelines.formats.inputs import ReadOptions
from seqpack.pipelines.offline import PackJob, steps
src, path, out = sys.argv[1:4]
spec = importlib.util.spec_from_file_location("steps_under_test", src)
route = sys.modules["steps_under_test"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(route)
config, read = PackConfig(2048, max_segments=256, overflow="split"), ReadOptions()
job = PackJob([path], out, config)
scan = steps.scan_file(0, path, read)
files = [steps.summarize_file(scan, config)]
plans = [steps.plan_block_slices(b, [s], files, job)
         for b, s in steps.cut_blocks(scan, files, job.block_size)]
del scan
summary = steps.summarize_plan(files, [p.summary for p in plans], job)
tables = [t for p in plans for _, t in steps.split_block(p, summary, files)]
file_job = steps.file_job(0, tables, files)
del plans, tables
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
before = rss()
open("/proc/self/clear_refs", "w").write("5")
t0 = time.perf_counter()
sent = tempfile.mkdtemp()
for n, element in enumerate(route.route_file(file_job, read, summary.shard_rows,
                                             summary.row_dtype)):
    with open(f"{sent}/{n}", "wb") as f:  # sent on, as a runner's shuffle takes them
        pickle.dump(element, f)
    del element
seconds = time.perf_counter() - t0
peak = int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) / 1024
digest = hashlib.sha1()
by_shard = {}
for name in sorted(os.listdir(sent), key=int):
    with open(f"{sent}/{name}", "rb") as f:
        k, part = pickle.load(f)
    by_shard.setdefault(k, []).append(part)
shutil.rmtree(sent)
for k in sorted(by_shard):
    _, pieces, _ = steps.plan_parts(k, by_shard[k], summary, config)
    for p in pieces:
        digest.update(np.asarray(p, np.int64).tobytes())
print(json.dumps({"s": seconds, "before": before, "peak": peak, "shards": len(by_shard),
                  "pieces": int(file_job.pieces.shape[1]), "digest": digest.hexdigest()}))
"""


def _write(path: pathlib.Path, n: int, mu: float, fmt: str) -> int:
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(mu, 1.0, n).astype(np.int64), 1, 4000)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    tokens = rng.integers(0, 30000, int(offsets[-1]), dtype=np.int32)
    if fmt == "npz":
        np.savez(path, tokens=tokens, offsets=offsets)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        column = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(tokens))
        pq.write_table(pa.table({"tokens": column}), path, row_group_size=65536)
    return int(offsets[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="HEAD", help="git revision compared against")
    ap.add_argument("--examples", type=int, default=2_000_000)
    ap.add_argument("--mu", type=float, default=1.6)
    ap.add_argument("--format", choices=["parquet", "npz"], default="parquet")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        base = file_at(args.baseline, "pipelines/offline/steps.py", tmp / "steps_base.py")
        path = tmp / f"input.{args.format}"
        tokens = _write(path, args.examples, args.mu, args.format)
        rows, results = [], {}
        for name, src in ((args.baseline, base), ("this tree", ROOT / "pipelines" / "offline" /
                                                  "steps.py")):
            out = subprocess.run([sys.executable, "-c", _CHILD, str(src), str(path),
                                  str(tmp / "out")], cwd=ROOT, capture_output=True, text=True,
                                 check=True)
            r = results[name] = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append([name, f"{r['pieces']:,}", r["shards"], f"{r['before']:.0f}",
                         f"{r['peak'] - r['before']:.0f}", f"{r['s']:.1f}"])
        same = len({r["digest"] for r in results.values()}) == 1
    print_table(f"route_file on one {args.format} input: {args.examples:,} examples (mu "
                f"{args.mu}), "
                f"{tokens:,} tokens (same parts: {'yes' if same else 'NO'})",
                ["revision", "pieces", "shards", "held before MiB", "route's peak over it MiB",
                 "seconds"], rows)


if __name__ == "__main__":
    main()
