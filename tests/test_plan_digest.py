"""The planners' plans, pinned row for row: seeded corpora whose plans together run every pass,
deal and refine step of the offline default (its repair in groups and its block-keyed pools
included) and of `StreamPlanner`, each plan's digest as it was before the strategies' move into
`packer/strategies/bfd/`. A change that moves pieces between rows fails here; one that means
to must say so and pin the new digests. (`python -m benchmarks.plan_digest --check
benchmarks/plan_digests.json` does the same over the grid of the four corpora.)"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.corpora import small_lognormal
from benchmarks.plan_digest import offline_digest, stream_digest
from seqpack.packer import PackConfig

_SMALL_MU = {512: (3.5, 4.5), 2048: (5.0, 6.5), 8192: (6.0, 7.5)}


def _mid(k: int) -> np.ndarray:
    """The k-th of a seeded sequence of lognormal corpora of 2,000 to 8,000 lengths."""
    rng = np.random.default_rng(5)
    for _ in range(k + 1):
        mu, sigma, n = rng.uniform(3.5, 7.0), rng.uniform(0.3, 1.5), int(rng.integers(2000, 8000))
        lengths = np.maximum(1, np.round(rng.lognormal(mu, sigma, n))).astype(np.int64)
    return lengths


def _lengths(corpus: str, k: int, L: int) -> np.ndarray:
    if corpus == "small":
        return small_lognormal(k, L, _SMALL_MU[L])[2]
    if corpus == "mid":
        return _mid(k)
    rng = np.random.default_rng(1)  # "many": 80,000 short lengths, a plan of > 8,192 rows
    return np.clip(rng.lognormal(4.0, 0.8, 80_000).astype(np.int64), 1, L)


# (corpus, seed, L, S, planner): digest of the plan
PINNED = {
    ("small", 23, 2048, 12, "stream"): "637b7d50bca70ccc:121",
    ("small", 0, 512, 256, "stream"): "6c5081fdd58ea5ba:230",
    ("small", 22, 512, 12, "offline"): "20bfaf888134e81c:204",
    ("small", 20, 512, 3, "stream"): "5a267ca921d731d7:910",
    ("small", 8, 8192, 12, "stream"): "b593714b74fd6137:566",
    ("mid", 6, 2048, 4, "offline"): "2d67d8daa9f52770:4105",
    ("small", 6, 2048, 8, "stream"): "55592c5e36c56b28:232",
    ("small", 23, 512, 5, "offline"): "86ea450160deb1f8:118",
    ("mid", 0, 2048, 2, "stream"): "b695a41dbb964674:3894",
    ("small", 4, 512, 64, "stream"): "74f56950a520cd03:387",
    ("small", 5, 8192, 5, "offline"): "184c01623631de83:452",
    ("small", 8, 512, 12, "stream"): "402228fb3c6bcc73:452",
    ("small", 20, 512, 16, "offline"): "124b504192c997a5:293",
    ("mid", 0, 2048, 5, "stream"): "8ff1330decdd74fc:2994",
    ("small", 7, 8192, 24, "stream"): "09cb56617eedfbf7:727",
    ("small", 21, 8192, 16, "stream"): "030b220d9e5d5bad:207",
    ("mid", 5, 2048, 3, "offline"): "38636b21c03da2b0:5317",
    ("many", 0, 256, 8, "offline"): "b781a8e87f67908d:22355",
}


def digest_of(corpus: str, seed: int, L: int, S: int, planner: str) -> str:
    lengths = _lengths(corpus, seed, L)
    config = PackConfig(L, max_segments=S, overflow="split")
    if planner == "offline":
        return offline_digest(lengths, config)
    return stream_digest(lengths, config, window=256)


@pytest.mark.parametrize("cell", sorted(PINNED), ids=lambda c: "/".join(map(str, c)))
def test_plans_are_as_pinned(cell):
    assert digest_of(*cell) == PINNED[cell]
