"""The offline default on seeded lognormal corpora it was not tuned on, against a revision's.

    python -m benchmarks.packer_bench --synthetic 36 [--seed 0] [--baseline REV] [--lp 120]
    python -m benchmarks.packer_bench --synthetic 140 --small [--seed 60] [--baseline REV]

N lognormal corpora (seeded: mu in [3.5, 7], sigma in [0.3, 1.5], 5k to 40k examples), L in
{2k, 8k, 32k} x S = f * L / (mean piece) for f in {0.8, 1, 1.25, 3}: cells of the offline
default within its target (`bfd.repair_target` of the tight bound), against the
`--baseline` revision's best_fit_decreasing, and plan time (both timed alternately, in this
process). With `--lp SECONDS`, every cell above the target also gets the configuration LP bound
(`benchmarks/lp_bound.py`, seeded with the plan's rows, at most SECONDS): where the tight bound
is loose the plan is measured against the better of the two, and the table counts the cells
within the target of it.

`--small`: corpora of 500 to 3,000 lengths instead (the "one row on small corpora" end of the
target, where a plan is a few hundred rows and every row counts): per seed K (K = --seed ..
--seed + N - 1) three of them, L=512 with mu in [3.5, 4.5], L=2048 with mu in [5, 6.5] and
L=8192 with mu in [6, 7.5] (sigma in [0.3, 1], lengths clipped to L), each at S in {8, 12, 16,
24, 32} (`small_cells`, by `corpora.small_lognormal`, which the tests' seeded corpora use too).
"""

from __future__ import annotations

import numpy as np

from benchmarks.common import print_table
from benchmarks.corpora import small_lognormal
from benchmarks.lp_bound import lp_bound
from benchmarks.packer_cells import _split_sizes, _time_plan, baseline_bfd, bfd_mod, plan_mod
from seqpack.packer import PackConfig, tight_lower_bound
from seqpack.packer.config import Strategy
from seqpack.packer.strategies.bfd import repair_target

_F = (0.8, 1.0, 1.25, 3.0)  # S = f * L / (mean piece)
_L = (2048, 8192, 32768)


def lognormal_corpora(count: int, seed: int):
    """(mu, sigma, lengths) of `count` seeded lognormal corpora."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        mu, sigma, n = rng.uniform(3.5, 7.0), rng.uniform(0.3, 1.5), int(rng.integers(5000, 40000))
        yield mu, sigma, np.maximum(1, np.round(rng.lognormal(mu, sigma, n))).astype(np.int64)


_SMALL = ((512, (3.5, 4.5)), (2048, (5.0, 6.5)), (8192, (6.0, 7.5)))  # (L, mu range)
_SMALL_S = (8, 12, 16, 24, 32)


def small_cells(count: int, seed: int):
    """(label, lengths, L, S) of the `--small` cells (module docstring)."""
    for k in range(seed, seed + count):
        for L, mu in _SMALL:
            m, sigma, lengths = small_lognormal(k, L, mu)
            for S in _SMALL_S:
                yield f"seed {k}: lognormal({m:.2f}, {sigma:.2f}) x{lengths.size}", lengths, L, S


def _cells(args):
    """(label, lengths, L, S) of every cell: `--small`, or the corpora of `lognormal_corpora`
    at L in _L and S = f * L / (mean piece) for f in _F."""
    if args.small:
        yield from small_cells(args.synthetic, args.seed)
        return
    for mu, sigma, lengths in lognormal_corpora(args.synthetic, args.seed):
        for L in _L:
            mean = float(_split_sizes(lengths, L).mean())
            for f in _F:
                S = int(min(4096, max(2, round(f * L / mean))))
                yield f"lognormal({mu:.2f}, {sigma:.2f}) x{lengths.size}", lengths, L, S


def run_synthetic(args) -> None:
    """`--synthetic N`: the offline default and the baseline's on N seeded lognormal corpora."""
    old = baseline_bfd(args.baseline)
    new = plan_mod._ASSIGN[Strategy.BEST_FIT_DECREASING]
    within = {"new": 0, "old": 0}
    times = {"new": 0.0, "old": 0.0}
    lp_within, lp_seconds = 0, 0.0
    above, cells = [], 0
    for label, lengths, L, S in _cells(args):
        sizes = _split_sizes(lengths, L)
        cfg = PackConfig(L, max_segments=S, overflow="split")
        tight = tight_lower_bound(sizes, L, S)
        target = repair_target(tight)
        cells += 1
        for key, assign in (("new", new), ("old", old)):
            if assign is None:
                continue
            t, rows = _time_plan(lengths, cfg, assign, repeats=1)
            times[key] += t
            within[key] += rows <= target
            if key != "new" or rows <= target:
                continue
            note = f"+{rows - tight} (target +{target - tight})"
            if args.lp:
                got, n = bfd_mod.assign_best_fit_decreasing(sizes, L, S)
                lp = lp_bound(sizes, L, S, rows=got, seconds=args.lp)
                lp_seconds += lp.seconds
                best = max(tight, lp.bound)
                lp_within += rows <= repair_target(best)
                note += (f", LP bound {lp.bound}{'' if lp.converged else ' (so far)'}: "
                         f"+{rows - best} (target +{repair_target(best) - best})")
            above.append(f"{label} {L}/{S} {note}")
    header = ["", "cells within the target", "plan s"]
    table = [["this checkout", within["new"], f"{times['new']:.1f}"],
             [args.baseline, within["old"] if old else "-", f"{times['old']:.1f}"]]
    if args.lp:
        header.append("within the target of the better bound (tight, LP)")
        table[0].append(f"{within['new'] + lp_within} (LP {lp_seconds:.0f} s)")
        table[1].append("")
    kind = "small lognormal corpora, 3 a seed" if args.small else "lognormal corpora"
    print_table(f"offline default on {args.synthetic} {kind} (seed {args.seed}), "
                f"{cells} cells", header, table)
    print("above the target:", "; ".join(above) or "none")
