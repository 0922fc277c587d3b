"""Grain datasets: packing `IterDataset`s with exact resume, drop-ins for Grain's packers, sources.

The only part of seqpack that imports grain (and so jax):

- `PackIterDataset`: checkpointable streaming packer (best fit decreasing over windows).
- `FirstFitPackIterDataset`, `BestFitPackIterDataset`: Grain's rows, faster, plus segment
  lengths/offsets (`segment_metadata=False`: exactly Grain's keys).
- Sources (`grain.MapDataset`s with random access): `ArraySource`, `JsonlSource`,
  `ParquetSource`, `ArrayRecordSource`, `TokenArraySource` (Megatron .bin/.idx, .npz, .npy),
  `PackedArrayRecordSource` (alias `PackedSource`: the output of `seqpack pack` in any
  `--format`); `SequentialIterDataset` walks one in order.
- `Mixture`: several datasets as one stream, weighted in tokens, loss tokens or examples
  (docs/mixing.md); every row then carries `segment_dataset_id`.
- `make_training_pipeline`: a seeded global order dealt to hosts and worker processes, pack,
  batch, prefetch; or, over packed rows, shuffle per epoch, deal global steps to hosts, batch
  (balanced datasets by whole steps): either state restores on any number of hosts (online:
  from every host's state, `read_host_states`, `ElasticCheckpointHandler`; the `elastic`
  wing). Its options come in
  frozen dataclasses: `packer.PackConfig`, `Batching`, `Columns`, `Balance`, `Window`,
  `Prefetch` (docs/training.md); `Batching(context_parallel=C)` emits rows in the load-balanced
  layout of C context-parallel ranks (`ContextParallelLayout`).
- Columns packed with the tokens (`Columns`: columns.py) and the loss tokens per row that make
  a packed per-token mean exact (`LossTokens`, loss.py); host batches whose per-device slices
  carry near-equal cost (`BalanceRanks`, `Balance`: balance.py).
"""

from seqpack.pipelines.errors import require

require("grain", "seqpack.pipelines.datasets")  # one message naming the extra, if missing

from seqpack.packer.contract import IGNORE_INDEX  # noqa: E402
from seqpack.pipelines.datasets import elastic  # noqa: E402
from seqpack.pipelines.datasets.balance import Balance, BalanceRanks  # noqa: E402
from seqpack.pipelines.datasets.columns import Columns  # noqa: E402
from seqpack.pipelines.datasets.dropin import BestFitPackIterDataset, FirstFitPackIterDataset  # noqa: E402
from seqpack.pipelines.datasets.elastic import (  # noqa: E402
    ElasticCheckpointHandler,
    read_host_states,
)
from seqpack.pipelines.datasets.files import (  # noqa: E402
    ArrayRecordSource,
    JsonlSource,
    PackedArrayRecordSource,
    PackedSource,
    ParquetSource,
    TokenArraySource,
)
from seqpack.pipelines.datasets.loss import LossTokens  # noqa: E402
from seqpack.pipelines.datasets.mixing import Mixture  # noqa: E402
from seqpack.pipelines.datasets.pack import PackIterator, PackIterDataset, Window  # noqa: E402
from seqpack.pipelines.datasets.sources import ArraySource, SequentialIterDataset  # noqa: E402
from seqpack.pipelines.datasets.training import (  # noqa: E402
    Batching,
    ContextParallelLayout,
    Prefetch,
    make_training_pipeline,
)

__all__ = [
    "IGNORE_INDEX",
    "ArrayRecordSource",
    "ArraySource",
    "Balance",
    "BalanceRanks",
    "Batching",
    "BestFitPackIterDataset",
    "Columns",
    "ContextParallelLayout",
    "ElasticCheckpointHandler",
    "FirstFitPackIterDataset",
    "JsonlSource",
    "LossTokens",
    "Mixture",
    "PackIterDataset",
    "PackIterator",
    "PackedArrayRecordSource",
    "PackedSource",
    "ParquetSource",
    "Prefetch",
    "SequentialIterDataset",
    "TokenArraySource",
    "Window",
    "elastic",
    "make_training_pipeline",
    "read_host_states",
]
