"""Grain adapters for seqpack: packing datasets, drop-ins for Grain's packers, sources.

- `PackIterDataset`: checkpointable streaming packer (best fit decreasing over windows).
- `FirstFitPackIterDataset`, `BestFitPackIterDataset`: Grain's rows, faster, plus segment
  lengths/offsets.
- Sources (`grain.MapDataset`s with random access): `ArraySource`, `JsonlSource`,
  `ParquetSource`, `ArrayRecordSource`, `PackedArrayRecordSource`; `SequentialIterDataset` walks
  one in order.
- `make_training_pipeline`: shard, shuffle, pack, batch, prefetch.
- `encode_row` / `decode_row`: the SQP1 record encoding of one row.
"""

from pipelines.arrayrecord import ArrayRecordSource, PackedArrayRecordSource, read_manifest
from pipelines.dropin import BestFitPackIterDataset, FirstFitPackIterDataset
from pipelines.jsonl import JsonlSource
from pipelines.pack import PackIterator, PackIterDataset
from pipelines.parquet import ParquetSource
from pipelines.records import decode_row, encode_row
from pipelines.sources import ArraySource, SequentialIterDataset
from pipelines.training import make_training_pipeline

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
    "decode_row",
    "encode_row",
    "make_training_pipeline",
    "read_manifest",
]
