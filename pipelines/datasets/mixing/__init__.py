"""Mixtures of datasets: `Mixture` (weights in tokens, loss tokens or examples, by largest
shortfall; state by positions, never a replay) and the (dataset, index) references the packer
checkpoints (`RefTable`). docs/mixing.md."""

from seqpack.pipelines.datasets.mixing.mixture import Mixture, MixtureIterator
from seqpack.pipelines.datasets.mixing.refs import RefTable, decode_refs

__all__ = ["Mixture", "MixtureIterator", "RefTable", "decode_refs"]
