"""Mixtures of datasets: `Mixture` (weights in tokens, loss tokens or examples, by largest
shortfall; state by positions, never a replay) and the (dataset, index) references the packer
checkpoints (`RefTable`; restored by `RestoreRefs`), and the order a window's rows leave in
(`balanced_order`). docs/mixing.md."""

from seqpack.pipelines.datasets.mixing.mixture import Mixture, MixtureIterator
from seqpack.pipelines.datasets.mixing.order import balanced_order
from seqpack.pipelines.datasets.mixing.refs import RefTable, decode_refs
from seqpack.pipelines.datasets.mixing.restore import RestoreRefs

__all__ = ["Mixture", "MixtureIterator", "RefTable", "RestoreRefs", "balanced_order",
           "decode_refs"]
