"""Balance benchmark: how evenly the data-parallel ranks of a step are loaded, per row order.

    python -m benchmarks.balance_bench [--corpus chat_dev] [--seq-len 8192] [--dp 8]

Per corpus, L, D and b: plan the corpus (`packer.plan`, best fit decreasing, overflow split),
then order its rows three ways and report the per-step max/mean of the ranks' costs (mean and
p99 over the full steps) under two measures:

- veRL's 7B model, 24576 * l + l^2 per segment (`CostModel(d_model=2048)`: k = 24576), and
- pure attention, sum of l^2.

Orders: `random` (RowOrder SHUFFLE: steps of random rows), `seqpack` (RowOrder BALANCED with
the measure's model and the rows' segment counts; for sum l^2, `CostModel(d_model=1)`, c(l) =
l + l^2 / 12), and `KK/step`
(random steps of D*b rows, each split among the D ranks by Karmarkar-Karp with b rows a rank,
as veRL's balance_batch does; with b = 1 it cannot move anything). Also rows against the tight
bound and the wall time of each ordering (seqpack: both levels and every plan_rows_at query),
and how far the steps are from random samples: the std over steps of their mean segments per
row, against the random order's (1.00x: as random; steps of like rows spread wider).
"""

from __future__ import annotations

import argparse
import heapq
import time

import numpy as np

from benchmarks.common import pin_one_core, print_table
from benchmarks.corpora import lengths as load_lengths
from seqpack.packer import (
    CostModel,
    PackConfig,
    RowOrder,
    ordered,
    plan,
    step_balance,
    tight_lower_bound,
)

VERL_7B = CostModel(d_model=2048)  # 12 * 2048 = 24576: c(l) = l + l^2 / 24576


def kk_equal(costs: np.ndarray, parts: int) -> list[list[int]]:
    """Karmarkar-Karp into `parts` sets of equal size (veRL's equal_size variant): items in
    chunks of `parts` (sorted), each chunk a state of one item per set; repeatedly merge the two
    states of largest spread, pairing one's heaviest set with the other's lightest."""
    order = np.argsort(costs, kind="stable")
    heap = []
    for k, chunk in enumerate(order.reshape(-1, parts)):
        sets = [[int(i)] for i in chunk]
        sums = [float(costs[i]) for i in chunk]
        heap.append((-(max(sums) - min(sums)), k, sets, sums))
    heapq.heapify(heap)
    tick = len(heap)
    while len(heap) > 1:
        _, _, s1, w1 = heapq.heappop(heap)
        _, _, s2, w2 = heapq.heappop(heap)
        a = sorted(range(parts), key=lambda i: -w1[i])
        b = sorted(range(parts), key=lambda i: w2[i])
        sets = [s1[a[i]] + s2[b[i]] for i in range(parts)]
        sums = [w1[a[i]] + w2[b[i]] for i in range(parts)]
        heapq.heappush(heap, (-(max(sums) - min(sums)), tick, sets, sums))
        tick += 1
    return heap[0][2]


def kk_per_step(row_costs: np.ndarray, D: int, b: int, seed: int) -> np.ndarray:
    """Output order of random steps, each rebalanced among its ranks by KK (plan row ids)."""
    n = row_costs.size
    perm = np.random.default_rng(seed).permutation(n)
    G = D * b
    out = []
    for s in range(n // G):
        step = perm[s * G : (s + 1) * G]
        sets = kk_equal(row_costs[step], D) if b > 1 else [[i] for i in range(D)]
        out.extend(step[i] for rank in sets for i in rank)
    out.extend(perm[(n // G) * G :])
    return np.asarray(out, np.int64)


def _spread(segments_in_order: np.ndarray, G: int) -> float:
    """The std over full steps of their rows' mean segment count (a random sample's is the
    random order's; steps of like rows spread wider)."""
    steps = segments_in_order.size // G
    return float(segments_in_order[: steps * G].reshape(steps, G).mean(axis=1).std())


def _stats(x: np.ndarray) -> str:
    if not x.size:
        return "-"
    return f"{x.mean():.3f} / {np.percentile(x, 99):.3f}"


def bench(lengths: np.ndarray, L: int, D: int, b: int) -> tuple[list[list[object]], str]:
    cfg = PackConfig(L, max_segments=64, overflow="split")
    p = plan(lengths, cfg)
    bound = tight_lower_bound(p.length, L, 64)
    sq = np.bincount(p.row, weights=p.length.astype(np.float64) ** 2, minlength=p.num_rows)
    segments = np.bincount(p.row, minlength=p.num_rows)
    measures = {"veRL 7B": (VERL_7B.row_costs(p.row, p.length, p.num_rows), VERL_7B),
                "sum l^2": (sq, CostModel(d_model=1))}
    rows = []
    for name, (costs, model) in measures.items():
        t0 = time.perf_counter()
        g, _ = ordered([costs], RowOrder(seed=0))
        rnd = g.plan_rows_at(0, g.num_rows)
        t_rnd = time.perf_counter() - t0
        t0 = time.perf_counter()
        g, lays = ordered([costs], RowOrder(mode="balanced", seed=0, data_parallel=D,
                                            batch_size=b, cost=model), [segments])
        bal = g.plan_rows_at(0, g.num_rows, lays)
        t_bal = time.perf_counter() - t0
        t0 = time.perf_counter()
        kk = kk_per_step(costs, D, b, seed=0)
        t_kk = time.perf_counter() - t0
        base = _spread(segments[rnd], D * b)
        for order_name, out, t in [("random", rnd, t_rnd), ("seqpack", bal, t_bal),
                                   ("KK/step", kk, t_kk)]:
            rows.append([name, order_name, _stats(step_balance(costs[out], D, b)),
                         f"{_spread(segments[out], D * b) / base:.2f}x", f"{t * 1e3:.1f}"])
    note = (f"{p.num_rows} rows, tight bound {bound} ({(p.num_rows / bound - 1) * 100:+.2f}%), "
            f"{p.num_rows // (D * b)} full steps")
    return rows, note


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", action="append", help="corpus name (default: chat_dev, "
                    "gsm8k_train, stdlib_source)")
    ap.add_argument("--seq-len", type=int, action="append")
    ap.add_argument("--dp", type=int, action="append", help="data-parallel ranks D")
    ap.add_argument("--batch-sizes", default="1,4", help="rows per rank per step, comma list")
    ap.add_argument("--repeat", type=int, default=1,
                    help="each corpus this many times over, each copy in its own seeded order")
    args = ap.parse_args()
    print(f"seqpack balance benchmark ({pin_one_core()}); cells: max/mean per step, mean / p99")
    header = ["measure", "order", "max/mean mean / p99", "spread of segments / row", "order ms"]
    names = args.corpus or ["chat_dev", "gsm8k_train", "stdlib_source"]
    for name, lengths in load_lengths(names).items():
        if args.repeat > 1:
            lengths = np.concatenate([np.random.default_rng(seed).permutation(lengths)
                                      for seed in range(args.repeat)])
            name = f"{name} x{args.repeat}"
        for L in args.seq_len or [8192, 32768]:
            for D in args.dp or [8, 64]:
                for b in [int(x) for x in args.batch_sizes.split(",")]:
                    rows, note = bench(lengths, L, D, b)
                    print_table(f"{name}, L={L}, S=64, D={D}, b={b}: {note}", header, rows)


if __name__ == "__main__":
    main()
