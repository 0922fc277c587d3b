"""The swap search's regime: small plans of long examples, against a revision, same process.

    python -m benchmarks.swap_bench [--baseline REV] [--corpora 6]

Seeded corpora of 1,738 lognormal lengths (mu 6.5 or 7, sigma 0.5 or 1, clipped to L = 2048) at
S = 5: plans of 600 to 1,000 rows whose last rows only the swap search
(`packer/strategies/bfd/refine/swap.py`) takes. Per corpus: rows, whether both revisions made
the same rows, and `assign_best_fit_decreasing` seconds (best of 3, the two timed alternately,
in this process; the baseline's strategies loaded from git, `packer_cells.baseline_bfd`).
"""

from __future__ import annotations

import argparse
import hashlib
import time

import numpy as np

from benchmarks.common import print_table
from benchmarks.packer_cells import baseline_bfd, bfd_mod

_CASES = [(7.0, 0.5, 0), (7.0, 0.5, 1), (7.0, 1.0, 0), (7.0, 1.0, 1), (6.5, 0.5, 0),
          (6.5, 0.5, 1)]
L, S = 2048, 5


def _timed(assign, sizes: np.ndarray) -> tuple[float, int, str]:
    """(seconds, rows, digest of the row of every piece) of one plan."""
    t0 = time.perf_counter()
    row, num_rows = assign(sizes, L, S)
    return time.perf_counter() - t0, num_rows, hashlib.sha1(np.asarray(row).tobytes()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="HEAD", help="git revision timed against")
    ap.add_argument("--corpora", type=int, default=len(_CASES))
    args = ap.parse_args()
    old, new = baseline_bfd(args.baseline), bfd_mod.assign_best_fit_decreasing
    rows = []
    for mu, sigma, seed in _CASES[: args.corpora]:
        rng = np.random.default_rng(seed)
        sizes = np.clip(rng.lognormal(mu, sigma, 1738).astype(np.int64), 1, L)
        runs = [(_timed(new, sizes), _timed(old, sizes)) for _ in range(3)]  # alternately
        t_new, t_old = (min(r[k][0] for r in runs) for k in (0, 1))
        (_, n, d_new), (_, _, d_old) = runs[0]
        rows.append([f"{mu} / {sigma} / {seed}", f"{n:,}", "yes" if d_new == d_old else "NO",
                     f"{t_old:.2f}", f"{t_new:.2f}", f"{t_old / t_new:.1f}x"])
    print_table(f"best_fit_decreasing at L={L}, S={S}, 1,738 lognormal lengths (best of 3)",
                ["mu / sigma / seed", "rows", "same rows", f"{args.baseline} s", "this s",
                 "speed-up"], rows)

if __name__ == "__main__":
    main()
