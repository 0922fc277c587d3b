"""The packer benchmark's planning runs: `--grid`, `--scan`, `--cell` and `--boundary` of
`benchmarks.packer_bench` (its docstring says what each measures), and the baseline planner
they time against (`--baseline`: a git revision's strategies, loaded into this process).

    python -m benchmarks.packer_bench --grid [--corpus chat_turns] [--baseline REV]
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

from benchmarks.common import print_table
from benchmarks.corpora import lengths as load_lengths
from seqpack.packer import (
    PackConfig,
    StreamPlanner,
    lower_bound,
    plan_rows,
    tight_lower_bound,
)
from seqpack.packer.config import Strategy
from seqpack.packer.plan import apply_overflow
from seqpack.packer.strategies.bfd import repair_target

plan_mod = importlib.import_module("seqpack.packer.plan")
bfd_mod = importlib.import_module("seqpack.packer.strategies.bfd")
schedule_mod = importlib.import_module("seqpack.packer.strategies.bfd.schedule")


# the offline default's module (the newest path first: it moved into the bfd wing)
MAIN_BFD = ("packer/strategies/bfd/schedule.py", "packer/strategies/best_fit_decreasing.py")


BASELINE = "f002f8b"  # the packer before the two-dimensional planner (plain BFD + worst fit)
MAIN_STREAM = ("packer/online/stream.py", "packer/stream.py")


_STRATEGY_IMPORT = re.compile(r"from seqpack\.packer\.strategies((?:\.\w+)*) import")


def _baseline_module(rev: str, paths: str | tuple[str, ...], name: str):
    """The module at `paths` (the first that exists) as of git revision `rev`, loaded into this
    process (or None). Its imports from `seqpack.packer.strategies` (modules and packages) are
    of `rev` too, loaded the same way (once per revision and module), so a baseline planner is
    the whole of its strategies (its two-pool pass, repair, fill and sieve), not its entry
    module over this checkout's; the rest of seqpack (bounds, plan, config) is this
    checkout's."""
    src = None
    for path in (paths,) if isinstance(paths, str) else paths:
        try:
            src = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True,
                                 text=True, check=True).stdout
            break
        except (OSError, subprocess.CalledProcessError):
            continue
    if src is None:
        return None

    def at_rev(m: re.Match) -> str:
        dotted = m.group(1)  # "", ".bfd", ".refine.repair", ...
        dep = f"_seqpack_{rev}_strategies{dotted.replace('.', '_')}"
        where = f"packer/strategies{dotted.replace('.', '/')}"
        if dep not in sys.modules and _baseline_module(
                rev, (f"{where}.py", f"{where}/__init__.py"), dep) is None:
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
        saved = schedule_mod._SAMPLE_MODES
        schedule_mod._SAMPLE_MODES = ()
        try:
            t0, rows0 = _time_plan(lengths, cfg, assign, repeats=1)
        finally:
            schedule_mod._SAMPLE_MODES = saved
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


def parts_bound(lengths: np.ndarray, L: int, S: int, parts: int) -> int:
    """The tight bound of each of `parts` equal runs of the corpus in its order, summed: no plan
    whose rows each hold pieces of one run only (a planner that sees the corpus a run at a time)
    has fewer rows. Where the corpus drifts, a run binds in slots and another in tokens, and
    this is above the whole corpus's bound."""
    size = -(-lengths.size // parts)
    return sum(tight_lower_bound(_split_sizes(lengths[a : a + size], L), L, S)
               for a in range(0, lengths.size, size))


BOUNDARY_PARTS = (2, 8)  # parts_bound's runs for the corpus-order cells above the target


def run_boundary(args) -> None:
    """`--boundary`: the cells where slots and tokens bind alike, S = f * L / (mean piece) for
    f in `BOUNDARY_F` (the grid's S step over them): the offline default against its target
    (0.1%) and `StreamPlanner` in corpus order and shuffled against the online one (0.3%).
    For the corpus-order cells above it, `parts_bound` over halves and eighths of the corpus:
    where the stream is below the eighths' (it carries rows across windows), the rows it lacks
    are the corpus's drift, which only a plan across the whole corpus removes."""
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
                        note = ""
                        if key == "corpus order":
                            note = " (" + ", ".join(
                                f"{k} parts {_over(parts_bound(lengths, L, S, k), tight)}"
                                for k in BOUNDARY_PARTS) + ")"
                        above[key].append(f"{cell} {_over(got, tight)}{note}")
                table.append([L, S, f"{L / (S * mean):.2f}", tight, _over(rows, tight),
                              _over(order, tight), _over(mixed, tight), f"{t * 1e3:.0f}"])
        print_table(f"{name}: rows over the tight bound where slots meet tokens",
                    ["L", "S", "L / (S x mean)", "tight bound", "best_fit_decreasing",
                     "StreamPlanner", "StreamPlanner shuffled", "plan ms"], table)
    for key, cells_above in above.items():
        print(f"{key}: {cells - len(cells_above)} of {cells} cells within the target; above: "
              f"{', '.join(cells_above) or 'none'}")
