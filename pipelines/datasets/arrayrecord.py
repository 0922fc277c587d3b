"""ArrayRecord sources: SQP1-encoded records (examples or packed rows) with random access.

`ArrayRecordSource` decodes every record with `records.decode_row` (zero-copy views).
`PackedArrayRecordSource` reads the packed rows the offline writer produces: a list of shard
files, or a directory holding ``manifest.json``::

    {"format": "seqpack-rows", "shards": ["rows-00000.arrayrecord", ...],
     "seq_len": 2048, "max_segments": 64, "feature": "tokens", ...}

(`shards` is required and relative to the directory; without a manifest every ``*.arrayrecord``
file in the directory is read in name order.) Each row is checked for the contract keys of its
feature; `make_training_pipeline` batches such a source without packing it again.

Example::

    rows = PackedArrayRecordSource("out/packed")       # directory with manifest.json
    rows[0]["tokens_segment_lengths"]                  # i32[S]

A corrupt or truncated record raises ValueError naming the file and the record index.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from seqpack.pipelines.datasets.sources import as_path_list, locate, norm_index
from seqpack.pipelines.formats.records import decode_row

MANIFEST = "manifest.json"
_ROW_KEYS_L = ("", "_segment_ids", "_positions")
_ROW_KEYS_S = ("_segment_lengths", "_segment_offsets")
_SOURCE_KEYS = ("segment_source_index", "segment_source_start")


def _reader(path: str):
    try:
        from array_record.python.array_record_module import ArrayRecordReader
    except ImportError as e:  # pragma: no cover - array-record is in the grain extra
        raise ImportError("ArrayRecord sources need array-record: pip install array-record") from e
    if not os.path.exists(path):
        raise ValueError(f"{path}: ArrayRecord file does not exist")
    return ArrayRecordReader(path, "readahead_buffer_size:0")


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """Loads ``directory/manifest.json``; its `shards` become absolute paths."""
    path = os.path.join(os.fspath(directory), MANIFEST)
    with open(path) as f:
        try:
            manifest = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
    shards = manifest.get("shards") if isinstance(manifest, dict) else None
    if not isinstance(shards, list) or not all(isinstance(s, str) for s in shards):
        raise ValueError(f"{path}: needs a 'shards' list of file names")
    manifest["shards"] = [os.path.join(os.fspath(directory), s) for s in shards]
    return manifest


def shard_paths(paths: Any) -> tuple[list[str], dict[str, Any]]:
    """Shard files (and the manifest, if any) from a directory, one file or a list of files."""
    if isinstance(paths, (str, os.PathLike)) and os.path.isdir(paths):
        if os.path.exists(os.path.join(os.fspath(paths), MANIFEST)):
            manifest = read_manifest(paths)
            return manifest["shards"], manifest
        found = sorted(
            os.path.join(os.fspath(paths), n)
            for n in os.listdir(paths)
            if n.endswith((".arrayrecord", ".array_record"))
        )
        if not found:
            raise ValueError(f"{paths}: no manifest.json and no *.arrayrecord files")
        return found, {}
    return as_path_list(paths, name="ArrayRecord source"), {}


class ArrayRecordSource(grain.MapDataset):
    """SQP1 records from ArrayRecord files, decoded to name -> numpy array dicts."""

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike]):
        super().__init__()
        self._paths, self.manifest = shard_paths(paths)
        counts = []
        for path in self._paths:
            reader = _reader(path)
            counts.append(reader.num_records())
            reader.close()
        self._cum = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._readers: dict[int, Any] = {}
        self._pid = os.getpid()

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_readers"] = {}  # readers do not cross processes
        return state

    @property
    def paths(self) -> list[str]:
        return list(self._paths)

    def __len__(self) -> int:
        return int(self._cum[-1])

    def __str__(self) -> str:
        return f"{type(self).__name__}({len(self._paths)} files, {len(self)} records)"

    def _read(self, f: int, j: int) -> bytes:
        if self._pid != os.getpid():
            self._readers, self._pid = {}, os.getpid()
        reader = self._readers.get(f)
        if reader is None:
            reader = self._readers[f] = _reader(self._paths[f])
        return reader.read([j])[0]

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        index = norm_index(index, len(self), str(self))
        f, j = locate(self._cum, index)
        try:
            raw = self._read(f, j)
            row = decode_row(raw)
            self._check(row)
        except ValueError as e:
            raise ValueError(f"{self._paths[f]} record {j}: {e}") from None
        return row

    def _check(self, row: dict[str, np.ndarray]) -> None:
        """Hook for subclasses: raise ValueError if a decoded record is malformed."""


class PackedArrayRecordSource(ArrayRecordSource):
    """Packed rows (contract keys of `feature`, `[L]` and `[S]` arrays) from ArrayRecord shards.

    feature: the packed feature; defaults to the manifest's `feature`, else "tokens".
    """

    is_packed = True

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        feature: str | None = None,
    ):
        super().__init__(paths)
        self.feature = feature or self.manifest.get("feature", "tokens")
        self.seq_len = self.manifest.get("seq_len")
        self.max_segments = self.manifest.get("max_segments")

    def _check(self, row: dict[str, np.ndarray]) -> None:
        f = self.feature
        keys = [f + s for s in _ROW_KEYS_L] + [f + s for s in _ROW_KEYS_S]
        missing = [k for k in keys if k not in row]
        if missing:
            raise ValueError(
                f"packed row lacks {missing} (has {sorted(row)}); is this a shard of packed rows "
                f"of feature {f!r}? pass feature=..."
            )
        L = row[f].shape[0] if row[f].ndim else -1
        S = row[keys[3]].shape[0] if row[keys[3]].ndim else -1
        for k in keys[:3]:
            if row[k].ndim != 1 or row[k].shape[0] != L:
                raise ValueError(f"packed row: {k} has shape {row[k].shape}, expected ({L},)")
        for k in keys[3:] + [k for k in _SOURCE_KEYS if k in row]:
            if row[k].ndim != 1 or row[k].shape[0] != S:
                raise ValueError(f"packed row: {k} has shape {row[k].shape}, expected ({S},)")
        if self.seq_len is not None and L != self.seq_len:
            raise ValueError(f"packed row has L={L}, manifest says seq_len={self.seq_len}")
        if self.max_segments is not None and S != self.max_segments:
            raise ValueError(f"packed row has S={S}, manifest says {self.max_segments=}")
