"""Grain datasets: packing `IterDataset`s with exact resume, drop-ins for Grain's packers, sources.

The only part of seqpack that imports grain (and so jax):

- `PackIterDataset`: checkpointable streaming packer (best fit decreasing over windows).
- `FirstFitPackIterDataset`, `BestFitPackIterDataset`: Grain's rows, faster, plus segment
  lengths/offsets.
- Sources (`grain.MapDataset`s with random access): `ArraySource`, `JsonlSource`,
  `ParquetSource`, `ArrayRecordSource`, `PackedArrayRecordSource`; `SequentialIterDataset` walks
  one in order.
- `make_training_pipeline`: shard, shuffle, pack, batch, prefetch.
"""

from seqpack.pipelines.errors import require

require("grain", "seqpack.pipelines.datasets")  # one message naming the extra, if missing

from seqpack.pipelines.datasets.dropin import BestFitPackIterDataset, FirstFitPackIterDataset  # noqa: E402
from seqpack.pipelines.datasets.files import (  # noqa: E402
    ArrayRecordSource,
    JsonlSource,
    PackedArrayRecordSource,
    ParquetSource,
)
from seqpack.pipelines.datasets.pack import PackIterator, PackIterDataset  # noqa: E402
from seqpack.pipelines.datasets.sources import ArraySource, SequentialIterDataset  # noqa: E402
from seqpack.pipelines.datasets.training import make_training_pipeline  # noqa: E402

__all__ = [
    "ArrayRecordSource",
    "ArraySource",
    "BestFitPackIterDataset",
    "FirstFitPackIterDataset",
    "JsonlSource",
    "PackIterDataset",
    "PackIterator",
    "PackedArrayRecordSource",
    "ParquetSource",
    "SequentialIterDataset",
    "make_training_pipeline",
]
