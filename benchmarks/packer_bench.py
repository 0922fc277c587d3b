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
`StreamPlanner` (corpus order and shuffled) against the online one (0.3%, at least one row).

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

One table per corpus (../shared/data/*.npz, or a synthetic lognormal corpus when absent):
strategy, rows, lower bound, efficiency, examples/s, tokens/s. Everything runs in this process on
one core; over-length examples are truncated to seq_len everywhere (as Grain and TRL's "bfd" do).
seqpack and TRL: one warm-up call, then the best of 3; Grain: one pass (it is slow).
Grain and TRL are measured only when installed.
"""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
import time
import types

import numpy as np

from benchmarks.common import best_time, corpora, fmt_rate, pin_one_core, print_table
from benchmarks.corpora import lengths as load_lengths
from seqpack.packer import (
    PackConfig,
    StreamPlanner,
    lower_bound,
    pack_ragged,
    pack_stream,
    plan_rows,
    tight_lower_bound,
)
from seqpack.packer.config import Strategy
from seqpack.packer.plan import apply_overflow
from seqpack.packer.strategies.best_fit_decreasing import repair_target

plan_mod = importlib.import_module("seqpack.packer.plan")
bfd_mod = importlib.import_module("seqpack.packer.strategies.best_fit_decreasing")
improve_mod = importlib.import_module("seqpack.packer.strategies.improve")


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


MAIN_BFD = "packer/strategies/best_fit_decreasing.py"


BASELINE = "f002f8b"  # the packer before the two-dimensional planner (plain BFD + worst fit)
MAIN_STREAM = "packer/stream.py"


_STRATEGY_IMPORT = re.compile(r"from seqpack\.packer\.strategies\.(\w+) import")


def _baseline_module(rev: str, path: str, name: str):
    """The module at `path` as of git revision `rev`, loaded into this process (or None). Its
    imports from `seqpack.packer.strategies` are of `rev` too, loaded the same way (once per
    revision and module), so a baseline planner is the whole of its strategies (its two-pool
    pass, repair, fill and sieve), not its best_fit_decreasing.py over this checkout's; the
    rest of seqpack (bounds, plan, config) is this checkout's."""
    try:
        src = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None

    def at_rev(m: re.Match) -> str:
        dep = f"_seqpack_{rev}_{m.group(1)}"
        if dep not in sys.modules and _baseline_module(
                rev, f"packer/strategies/{m.group(1)}.py", dep) is None:
            return m.group(0)  # not in `rev`: this checkout's
        return f"from {dep} import"

    src = _STRATEGY_IMPORT.sub(at_rev, src)
    mod = types.ModuleType(name)
    sys.modules[name] = mod  # before it runs: a module it imports may import it back
    exec(compile(src, f"{rev}:{path}", "exec"), mod.__dict__)
    return mod


def baseline_bfd(rev: str):
    """assign_best_fit_decreasing as of git revision `rev`, or None outside a git checkout."""
    mod = _baseline_module(rev, MAIN_BFD, f"baseline_best_fit_decreasing_{rev}")
    return None if mod is None else mod.assign_best_fit_decreasing


def stream_rows(lengths: np.ndarray, cfg: PackConfig, window: int = 1024,
                planner_cls=StreamPlanner) -> int:
    planner = planner_cls(cfg, window=window)
    rows = 0
    for a in range(0, lengths.size, window):
        rows += planner.add_plan(np.arange(a, min(a + window, lengths.size)),
                                 lengths[a : a + window]).num_rows
    return rows + planner.finish_plan().num_rows


def _time_plan(lengths, cfg, assign, repeats=3):
    """Best time of plan_rows with best_fit_decreasing's assign swapped for `assign`."""
    saved = plan_mod._ASSIGN[Strategy.BEST_FIT_DECREASING]
    plan_mod._ASSIGN[Strategy.BEST_FIT_DECREASING] = assign
    try:
        best, rows = float("inf"), 0
        for _ in range(repeats):
            t0 = time.perf_counter()
            rows = plan_rows(lengths, cfg).num_rows
            best = min(best, time.perf_counter() - t0)
        return best, rows
    finally:
        plan_mod._ASSIGN[Strategy.BEST_FIT_DECREASING] = saved


def _over(rows: int, bound: int) -> str:
    return f"{rows - bound:+d} ({(rows / bound - 1) * 100:+.2f}%)"


def _time_stream(lengths, cfg, planner_cls):
    t0 = time.perf_counter()
    rows = stream_rows(lengths, cfg, planner_cls=planner_cls)
    return time.perf_counter() - t0, rows


def _split_sizes(lengths: np.ndarray, L: int) -> np.ndarray:
    """The pieces overflow split makes of `lengths` at row length L (what the bound is of)."""
    return apply_overflow(lengths, PackConfig(L, overflow="split"))[2]


def grid(name, lengths, Ls, Ss, old, with_stream, old_stream=None):
    table, speed = [], []
    new = plan_mod._ASSIGN[Strategy.BEST_FIT_DECREASING]
    shuffled = np.random.default_rng(0).permutation(lengths)
    for L in Ls:
        sizes = _split_sizes(lengths, L)
        for S in Ss:
            cfg = PackConfig(L, max_segments=S, overflow="split")
            tight = tight_lower_bound(sizes, L, S)
            simple = lower_bound(int(sizes.sum()), sizes.size, L, S)
            # alternate new and old so both see the same machine load
            t_new, r_new = _time_plan(lengths, cfg, new)
            t_old, r_old = _time_plan(lengths, cfg, old) if old else (float("nan"), 0)
            t_new2, _ = _time_plan(lengths, cfg, new)
            t_new = min(t_new, t_new2)
            bf = plan_rows(lengths, PackConfig(L, max_segments=S, overflow="split",
                                               strategy="best_fit")).num_rows
            ff = plan_rows(lengths, PackConfig(L, max_segments=S, overflow="split",
                                               strategy="first_fit")).num_rows
            st = st_old = st_shuffled = "-"
            ts_new = ts_old = float("nan")
            if with_stream:
                ts_new, rows = _time_stream(lengths, cfg, StreamPlanner)
                st = _over(rows, tight)
                st_shuffled = _over(stream_rows(shuffled, cfg), tight)
                if old_stream is not None:
                    ts_old, rows = _time_stream(lengths, cfg, old_stream)
                    st_old = _over(rows, tight)
            table.append([L, S, simple, tight, _over(r_new, tight),
                          _over(r_old, tight) if old else "-", _over(bf, tight),
                          _over(ff, tight), st, st_old, st_shuffled])
            speed.append([L, S, f"{t_new * 1e3:.1f}", f"{t_old * 1e3:.1f}",
                          f"{t_new / t_old:.2f}x" if old else "-",
                          ("yes" if r_old <= repair_target(tight) else "no") if old else "-",
                          f"{ts_new * 1e3:.0f}", f"{ts_old * 1e3:.0f}",
                          f"{ts_new / ts_old:.2f}x"])
    return table, speed


def run_grid(args) -> None:
    """`--grid`: rows over the tight bound per (L, S) and strategy, plan time against main."""
    Ls = args.grid_seq_len or [2048, 8192, 32768, 131072]
    Ss = args.grid_max_segments or [8, 16, 32, 64, 256, 4096]
    old = baseline_bfd(args.baseline)
    mod = _baseline_module(args.baseline, MAIN_STREAM, f"baseline_stream_{args.baseline}")
    old_stream = None if mod is None else mod.StreamPlanner
    for name, lengths in _lengths(args).items():
        table, speed = grid(name, lengths, Ls, Ss, old, not args.no_stream, old_stream)
        print_table(f"{name}: {lengths.size} examples, {int(lengths.sum())} tokens; rows over "
                    "the tight bound", ["L", "S", "simple bound", "tight bound",
                                        "best_fit_decreasing", "baseline BFD", "best_fit",
                                        "first_fit", "StreamPlanner", "baseline stream",
                                        "StreamPlanner shuffled"], table)
        print_table(f"{name}: plan_rows time, best_fit_decreasing, ms (best of 3); "
                    "StreamPlanner ms (one pass)",
                    ["L", "S", "plan", f"plan {args.baseline}", "ratio",
                     "baseline within the target", "stream", f"stream {args.baseline}", "ratio"],
                    speed)
        t_new = sum(float(r[2]) for r in speed)
        t_old = sum(float(r[3]) for r in speed)
        print(f"{name}: total {t_new:.0f} ms against the baseline's {t_old:.0f} ms "
              f"({t_new / t_old:.2f}x)")
        for met in ("yes", "no"):  # same rows' quality, or where the baseline missed it
            part = [r for r in speed if r[5] == met]
            if part and old:
                new_ms, old_ms = sum(float(r[2]) for r in part), sum(float(r[3]) for r in part)
                print(f"  where the baseline is {'within' if met == 'yes' else 'above'} the "
                      f"target ({len(part)} cells): {new_ms:.0f} ms against {old_ms:.0f} ms "
                      f"({new_ms / old_ms:.2f}x)")


SCAN_L = [2048, 4096, 8192, 32768, 131072]
SCAN_S = [8, 12, 16, 24, 32, 48, 64, 128, 256, 1024, 4096]


def _lengths(args) -> dict[str, np.ndarray]:
    """The corpora's lengths; with `--repeat R`, each one R times over, every copy in its own
    seeded order (a corpus R times the size with the same lengths: what a plan does at scale,
    where the sample corpus fits in a few windows)."""
    out = load_lengths(args.corpus)
    if args.repeat > 1:
        out = {name: np.concatenate([np.random.default_rng(seed).permutation(lengths)
                                     for seed in range(args.repeat)])
               for name, lengths in out.items()}
    return out


def run_scan(args) -> None:
    """`--scan`: the offline default only, over a finer grid (`SCAN_L` x `SCAN_S`, or the
    --grid-* lists): rows over the tight bound against the target (`repair_target`: the bound +
    0.1%, at least one row) and plan time; the cells above it are listed at the end."""
    Ls = args.grid_seq_len or SCAN_L
    Ss = args.grid_max_segments or SCAN_S
    above, cells = [], 0
    for name, lengths in _lengths(args).items():
        table = []
        for L in Ls:
            sizes = _split_sizes(lengths, L)
            for S in Ss:
                cfg = PackConfig(L, max_segments=S, overflow="split")
                t, rows = _time_plan(lengths, cfg, plan_mod._ASSIGN[Strategy.BEST_FIT_DECREASING],
                                     repeats=1)
                tight = tight_lower_bound(sizes, L, S)
                target = repair_target(tight)
                cells += 1
                if rows > target:
                    above.append(f"{name} {L}/{S} {_over(rows, tight)}")
                table.append([L, S, tight, _over(rows, tight), f"+{target - tight}",
                              f"{t * 1e3:.0f}"])
        print_table(f"{name}: best_fit_decreasing rows over the tight bound",
                    ["L", "S", "tight bound", "rows over", "target", "plan ms"], table)
    print(f"{cells - len(above)} of {cells} cells within the target; above: "
          f"{', '.join(above) or 'none'}")


def run_cells(args) -> None:
    """`--cell`: the offline default at named cells, with and without the sample fills, and
    the baseline's."""
    table = []
    data = _lengths(argparse.Namespace(corpus=sorted({c.split("/")[0] for c in args.cell}),
                                       repeat=args.repeat))
    assign = plan_mod._ASSIGN[Strategy.BEST_FIT_DECREASING]
    old = baseline_bfd(args.baseline)
    for cell in args.cell:
        name, L, S = cell.split("/")[0], *map(int, cell.split("/")[1:3])
        lengths = data[name]
        cfg = PackConfig(L, max_segments=S, overflow="split")
        tight = tight_lower_bound(_split_sizes(lengths, L), L, S)
        t, rows = _time_plan(lengths, cfg, assign, repeats=1)
        saved = improve_mod._SAMPLE_MODES
        improve_mod._SAMPLE_MODES = ()
        try:
            t0, rows0 = _time_plan(lengths, cfg, assign, repeats=1)
        finally:
            improve_mod._SAMPLE_MODES = saved
        t1, rows1 = _time_plan(lengths, cfg, old, repeats=1) if old else (float("nan"), tight)
        table.append([name, L, S, tight, f"+{repair_target(tight) - tight}", _over(rows, tight),
                      f"{t:.2f}", _over(rows0, tight), f"{t0:.2f}", _over(rows1, tight),
                      f"{t1:.2f}"])
    print_table(f"offline default at named cells (corpora x{args.repeat})",
                ["corpus", "L", "S", "tight bound", "target", "rows over", "plan s",
                 "without sample fills", "plan s", f"{args.baseline} rows over", "plan s"],
                table)


BOUNDARY_L = [2048, 8192, 32768, 131072]
BOUNDARY_F = [0.8, 0.9, 1.0, 1.1, 1.25]  # S = f * L / (mean piece): where slots meet tokens


def online_target(bound: int) -> int:
    """The most rows the online defaults may use: the bound + 0.3%, at least + 1."""
    return bound + max(1, 3 * bound // 1000)


def run_boundary(args) -> None:
    """`--boundary`: the cells where slots and tokens bind alike, S = f * L / (mean piece) for
    f in `BOUNDARY_F` (the grid's S step over them): the offline default against its target
    (0.1%) and `StreamPlanner` in corpus order and shuffled against the online one (0.3%)."""
    Ls = args.grid_seq_len or BOUNDARY_L
    above = {"offline": [], "corpus order": [], "shuffled": []}
    cells = 0
    for name, lengths in _lengths(args).items():
        shuffled = np.random.default_rng(0).permutation(lengths)
        table = []
        for L in Ls:
            sizes = _split_sizes(lengths, L)
            mean = float(sizes.mean())
            Ss = sorted({min(4096, max(2, round(f * L / mean))) for f in BOUNDARY_F})
            for S in Ss:
                cfg = PackConfig(L, max_segments=S, overflow="split")
                tight = tight_lower_bound(sizes, L, S)
                t, rows = _time_plan(lengths, cfg, plan_mod._ASSIGN[Strategy.BEST_FIT_DECREASING],
                                     repeats=1)
                order, mixed = stream_rows(lengths, cfg), stream_rows(shuffled, cfg)
                cells += 1
                cell = f"{name} {L}/{S}"
                for key, got, target in [("offline", rows, repair_target(tight)),
                                         ("corpus order", order, online_target(tight)),
                                         ("shuffled", mixed, online_target(tight))]:
                    if got > target:
                        above[key].append(f"{cell} {_over(got, tight)}")
                table.append([L, S, f"{L / (S * mean):.2f}", tight, _over(rows, tight),
                              _over(order, tight), _over(mixed, tight), f"{t * 1e3:.0f}"])
        print_table(f"{name}: rows over the tight bound where slots meet tokens",
                    ["L", "S", "L / (S x mean)", "tight bound", "best_fit_decreasing",
                     "StreamPlanner", "StreamPlanner shuffled", "plan ms"], table)
    for key, cells_above in above.items():
        print(f"{key}: {cells - len(cells_above)} of {cells} cells within the target; above: "
              f"{', '.join(cells_above) or 'none'}")


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
                    "against its target (see run_scan)")
    ap.add_argument("--boundary", action="store_true", help="offline and online where slots "
                    "and tokens bind alike (see run_boundary)")
    ap.add_argument("--cell", action="append", help="NAME/L/S: the offline default there, with "
                    "and without the sample fills (repeatable; see run_cells)")
    ap.add_argument("--synthetic", type=int, default=0, help="N seeded lognormal corpora, the "
                    "offline default against the baseline (see run_synthetic)")
    ap.add_argument("--seed", type=int, default=0, help="--synthetic: the corpora's seed")
    ap.add_argument("--small", action="store_true", help="--synthetic: corpora of 500 to 3,000 "
                    "lengths, N seeds of three (see small_cells)")
    ap.add_argument("--lp", type=float, default=0.0, help="--synthetic: seconds of the "
                    "configuration LP bound (benchmarks/lp_bound.py) per cell above the target")
    ap.add_argument("--repeat", type=int, default=1, help="--grid, --scan, --boundary, --cell: "
                    "each corpus this many times over, every copy shuffled (see _lengths)")
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
