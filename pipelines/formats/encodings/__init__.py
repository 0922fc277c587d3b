"""Shard encodings: one per `seqpack pack --format`, behind one interface (`Encoding`).

    arrayrecord  SQP1 records in ArrayRecord files (sqp1.py; the default)
    parquet      the row contract as Parquet columns (table.py)
    hf           TRL's padding-free rows: input_ids, labels, seq_lengths, position_ids (trl.py)
    megatron     Megatron-Bridge's packed SFT *.idx.parquet and its metadata (megatron.py)
    index        rows by reference: each piece's input example, start and length, no tokens
                 (index.py; read back from the inputs, which the manifest fingerprints)

The offline job, the manifest, resume, verify and the Grain source take an `Encoding` (by name:
`encoding("parquet")`, or of a manifest: `of_manifest(m)`) and a `Layout` and never branch on
the format; docs/formats.md says what each file holds and who reads it.
"""

from __future__ import annotations

from typing import Any

from seqpack.pipelines.formats.encodings.base import (
    COMPRESSIONS,
    Encoding,
    Layout,
    ShardReader,
    loss_positions,
    next_token_mask,
    shard_batch,
    with_segment_ids,
)
from seqpack.pipelines.formats.encodings.index import (
    RANDOM_ACCESS,
    IndexRows,
    check_stamp,
    read_threads,
)
from seqpack.pipelines.formats.encodings.megatron import METADATA, MegatronRows, metadata_name
from seqpack.pipelines.formats.encodings.sqp1 import RowEncoder, Sqp1
from seqpack.pipelines.formats.encodings.table import ParquetRows
from seqpack.pipelines.formats.encodings.trl import TrlRows

__all__ = ["COMPRESSIONS", "DEFAULT", "ENCODINGS", "FORMATS", "RANDOM_ACCESS", "Encoding",
           "Layout", "check_stamp", "read_threads",
           "RowEncoder", "ShardReader", "encoding", "is_side_file", "layout_of",
           "loss_positions", "metadata_name", "next_token_mask", "of_manifest",
           "shard_batch", "with_segment_ids"]

ENCODINGS: dict[str, Encoding] = {e.name: e for e in (Sqp1(), ParquetRows(), TrlRows(),
                                                         MegatronRows(), IndexRows())}
FORMATS = tuple(ENCODINGS)
DEFAULT = "arrayrecord"


def encoding(name: str | None) -> Encoding:
    """The encoding of `--format name` (None: the default); ValueError naming `format=`."""
    if name is None:
        return ENCODINGS[DEFAULT]
    try:
        return ENCODINGS[name]
    except (KeyError, TypeError):
        raise ValueError(f"format={name!r} must be one of {list(FORMATS)}") from None


def layout_of(manifest: Any) -> Layout:
    """The `Layout` of a manifest's rows (for reading them back)."""
    mixture = getattr(manifest, "mixture", None)
    firsts = tuple(int(d["first_example"]) for d in mixture["datasets"]) if mixture else None
    return Layout(manifest.pack_config(), tuple(manifest.columns or ()), mixed=bool(mixture),
                  firsts=firsts, inputs=getattr(manifest, "inputs", None))


def of_manifest(manifest: Any) -> tuple[Encoding, Layout]:
    """(its encoding, its rows' layout) of a `formats.manifest.Manifest`."""
    return encoding(getattr(manifest, "encoding", None)), layout_of(manifest)


def is_side_file(name: str) -> bool:
    """Whether `name` is a file an encoding writes beside the shards (what an output owns)."""
    return METADATA.match(name) is not None
