"""Digests of the planners' plans: pins that a refactoring changes no plan, row for row.

    python -m benchmarks.plan_digest --write benchmarks/plan_digests.json   # before a change
    python -m benchmarks.plan_digest --check benchmarks/plan_digests.json   # after it

Each cell's digest is the sha256 of its rows (the row of every piece, i64, and the row count):

* `grid`: per corpus of `benchmarks.corpora` (the shared dev corpora where present, the
  standard library's files, chat turns), at L in 2048 / 8192 / 32768 / 131072 and S in 8 / 16
  / 32 / 64 / 256 / 4096 (`packer_bench --grid`): the offline default (`plan_rows`, overflow
  split), `StreamPlanner` in corpus order and shuffled, and best fit / first fit;
* `grid_xR` (`--repeat R`): the offline default on each corpus R times over, each copy in its
  own seeded order (plans of many rows: the repair in groups);
* `small`, `lognormal`: the seeded small corpora of `synthetic_bench --small` (seeds 0-11) and the
  seeded lognormal corpora of `synthetic_bench` (seeds 0-3), offline and streamed.

A cell that cannot be computed (a corpus absent here) is left out of both writing and checking;
`--check` fails on every digest that differs and on cells missing from the file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import numpy as np

from benchmarks.corpora import lengths as load_lengths
from benchmarks.synthetic_bench import lognormal_corpora, small_cells
from seqpack.packer import PackConfig, StreamPlanner, plan_rows

GRID_L = (2048, 8192, 32768, 131072)
GRID_S = (8, 16, 32, 64, 256, 4096)
_WINDOW = 1024


def digest(row: np.ndarray, num_rows: int) -> str:
    h = hashlib.sha256(np.asarray(row, np.int64).tobytes())
    h.update(str(int(num_rows)).encode())
    return h.hexdigest()[:16]


def stream_digest(lengths: np.ndarray, cfg: PackConfig, window: int = _WINDOW) -> str:
    """The stream's plans window by window: each emitted plan's (example, start, row)."""
    planner = StreamPlanner(cfg, window=window)
    h = hashlib.sha256()
    rows = 0

    def add(p) -> None:
        for a in (p.example, p.start, p.row):
            h.update(np.asarray(a, np.int64).tobytes())
        h.update(str(p.num_rows).encode())

    for a in range(0, lengths.size, window):
        p = planner.add_plan(np.arange(a, min(a + window, lengths.size)),
                             lengths[a : a + window])
        add(p)
        rows += p.num_rows
    p = planner.finish_plan()
    add(p)
    return h.hexdigest()[:16] + f":{rows + p.num_rows}"


def offline_digest(lengths: np.ndarray, cfg: PackConfig) -> str:
    a = plan_rows(lengths, cfg)
    return digest(a.row, a.num_rows) + f":{a.num_rows}"


def grid_cells(names: list[str] | None, with_stream: bool, repeat: int = 1):
    for name, lengths in load_lengths(names).items():
        shuffled = np.random.default_rng(0).permutation(lengths)
        if repeat > 1:  # as `packer_bench --repeat`: each copy in its own seeded order
            lengths = np.concatenate([np.random.default_rng(seed).permutation(lengths)
                                      for seed in range(repeat)])
        for L in GRID_L:
            for S in GRID_S:
                cfg = PackConfig(L, max_segments=S, overflow="split")
                key = f"grid/{name}/{L}/{S}" if repeat == 1 else f"grid_x{repeat}/{name}/{L}/{S}"
                yield f"{key}/offline", lambda c=cfg, x=lengths: offline_digest(x, c)
                if repeat > 1:
                    continue  # the offline default only (its plans of many rows: groups)
                for strategy in ("best_fit", "first_fit"):
                    other = PackConfig(L, max_segments=S, overflow="split", strategy=strategy)
                    yield f"{key}/{strategy}", lambda c=other, x=lengths: offline_digest(x, c)
                if with_stream:
                    yield f"{key}/stream", lambda c=cfg, x=lengths: stream_digest(x, c)
                    yield f"{key}/stream_shuffled", lambda c=cfg, x=shuffled: stream_digest(x, c)


def synthetic_cells():
    for label, lengths, L, S in small_cells(12, 0):
        key = f"small/{label.split(':')[0].split()[1]}/{L}/{S}"
        cfg = PackConfig(L, max_segments=S, overflow="split")
        yield f"{key}/offline", lambda c=cfg, x=lengths: offline_digest(x, c)
        yield f"{key}/stream", lambda c=cfg, x=lengths: stream_digest(x, c, window=256)
    for k, (_, _, lengths) in enumerate(lognormal_corpora(4, 0)):
        mean = float(lengths.mean())
        for L in (2048, 8192):
            for f in (0.8, 1.0, 1.25, 3.0):
                S = min(4096, max(2, round(f * L / mean)))
                cfg = PackConfig(L, max_segments=S, overflow="split")
                key = f"lognormal/{k}/{L}/{S}"
                yield f"{key}/offline", lambda c=cfg, x=lengths: offline_digest(x, c)
                yield f"{key}/stream", lambda c=cfg, x=lengths: stream_digest(x, c)


def compute(args) -> dict[str, str]:
    cells = list(grid_cells(args.corpus, not args.no_stream)) if not args.synthetic_only else []
    if args.repeat > 1:
        cells += list(grid_cells(args.corpus, False, args.repeat))
    if not args.grid_only:
        cells += list(synthetic_cells())
    out = {}
    t0 = time.perf_counter()
    for i, (key, fn) in enumerate(cells):
        out[key] = fn()
        if args.verbose:
            print(f"[{i + 1}/{len(cells)} {time.perf_counter() - t0:.0f}s] {key} {out[key]}",
                  flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", help="write the digests to this JSON file")
    ap.add_argument("--check", help="compare against this JSON file")
    ap.add_argument("--corpus", action="append", help="grid corpora (default: all available)")
    ap.add_argument("--no-stream", action="store_true")
    ap.add_argument("--repeat", type=int, default=1,
                    help="also the offline default's grid on each corpus this many times over")
    ap.add_argument("--grid-only", action="store_true")
    ap.add_argument("--synthetic-only", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    got = compute(args)
    if args.write:
        with open(args.write, "w") as f:
            json.dump(got, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"{len(got)} digests written to {args.write}")
    if args.check:
        with open(args.check) as f:
            want = json.load(f)
        bad = [k for k in got if k in want and want[k] != got[k]]
        missing = [k for k in got if k not in want]
        for k in bad:
            print(f"DIFFERS {k}: {want[k]} -> {got[k]}")
        for k in missing:
            print(f"NOT PINNED {k}: {got[k]}")
        print(f"{len(got) - len(bad) - len(missing)} of {len(got)} digests as pinned")
        if bad or missing:
            sys.exit(1)


if __name__ == "__main__":
    main()
