"""Mixtures of datasets: `Mixture` (weights in tokens, loss tokens or examples, by largest
shortfall; state by positions, never a replay) and the order a window's rows leave in
(`balanced_order`). docs/mixing.md."""

from seqpack.pipelines.datasets.mixing.mixture import Mixture, MixtureIterator
from seqpack.pipelines.datasets.mixing.order import balanced_order

__all__ = ["Mixture", "MixtureIterator", "balanced_order"]
