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

import importlib

# Names are loaded on first use (PEP 562): the Grain datasets import grain (and so jax), which
# the offline modules the CLI uses (readers, writer, verify, report, records) must not pay for.
_EXPORTS = {
    "ArrayRecordSource": "pipelines.arrayrecord",
    "PackedArrayRecordSource": "pipelines.arrayrecord",
    "read_manifest": "pipelines.arrayrecord",
    "BestFitPackIterDataset": "pipelines.dropin",
    "FirstFitPackIterDataset": "pipelines.dropin",
    "JsonlSource": "pipelines.jsonl",
    "PackIterator": "pipelines.pack",
    "PackIterDataset": "pipelines.pack",
    "ParquetSource": "pipelines.parquet",
    "decode_row": "pipelines.records",
    "encode_row": "pipelines.records",
    "ArraySource": "pipelines.sources",
    "SequentialIterDataset": "pipelines.sources",
    "make_training_pipeline": "pipelines.training",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pipelines' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


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
