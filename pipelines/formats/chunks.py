"""What every format reader yields: a chunk of consecutive records as ragged token ids.

A file is read as a sequence of chunks (a Parquet row group, a range of ArrayRecord records, a
block of JSONL lines, a text file), each in the Arrow list layout: record `first + i` of the file is
``values[offsets[i]:offsets[i + 1]]``. Readers check every chunk (names file and record on bad
data); consumers concatenate chunks (the offline CLI) or cache them (the Grain sources).

Extra columns read with the tokens (labels, masks: `ReadOptions.extra_columns`) travel as flat
values sharing the token offsets: ``extra_values[name][offsets[i]:offsets[i + 1]]`` is record
`first + i`'s column `name`, as long as its tokens (checked by the readers, `check_aligned`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from seqpack.packer.inputs import InputError, common_id_dtype


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Records [first, first + n) of one file."""

    values: np.ndarray  # X[N] token ids, >= 0
    offsets: np.ndarray  # i64[n + 1]; need not start at 0
    first: int  # index of the chunk's first record in its file
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # name -> per-record column
    # name -> X[N] an extra column's values (any integers), sharing `offsets` with `values`
    extra_values: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    @property
    def num_records(self) -> int:
        return int(self.offsets.size - 1)

    def tokens(self) -> np.ndarray:
        """The chunk's tokens back to back (a view)."""
        return self.values[int(self.offsets[0]) : int(self.offsets[-1])]

    def column(self, name: str) -> np.ndarray:
        """Extra column `name`'s values back to back (a view), as many as `tokens()`."""
        return self.extra_values[name][int(self.offsets[0]) : int(self.offsets[-1])]


def check_aligned(where: str, column: str, length: int, name: str, other: int) -> None:
    """InputError naming `where` (file and record) unless column `name` of a record holds as
    many values (`other`) as its token column (`length`)."""
    if other != length:
        raise InputError(f"{where}: {name!r} holds {other} values but {column!r} holds "
                         f"{length}; every column of a record must be as long as its tokens")


def numpy_view(arr: Any) -> np.ndarray:
    """A primitive integer Arrow array as a numpy view (Array.to_numpy would import pandas)."""
    dtype = np.dtype(str(arr.type))
    return np.frombuffer(arr.buffers()[1], dtype, len(arr) + arr.offset)[arr.offset :]


def ragged(seqs: Sequence[np.ndarray], dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets) of a list of 1-D arrays."""
    lengths = np.fromiter((s.size for s in seqs), np.int64, len(seqs))
    offsets = np.zeros(len(seqs) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if not seqs:
        return np.zeros(0, dtype), offsets
    # Each cast first: np.concatenate itself would promote uint64 with int64 to float64.
    return np.concatenate([s.astype(dtype, copy=False) for s in seqs]), offsets


def concat(chunks: Sequence[Chunk]) -> tuple[np.ndarray, np.ndarray]:
    """All chunks' records back to back: (values, offsets from 0)."""
    if len(chunks) == 1 and chunks[0].offsets[0] == 0:
        return chunks[0].values, chunks[0].offsets
    if not chunks:
        return np.zeros(0, np.int32), np.zeros(1, np.int64)
    dtype = common_id_dtype([c.values.dtype for c in chunks])  # ids checked >= 0 by readers
    values = np.concatenate([c.tokens().astype(dtype, copy=False) for c in chunks])
    lengths = np.concatenate([np.diff(c.offsets) for c in chunks])
    offsets = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return values, offsets


def record_of(offsets: np.ndarray, position: int) -> int:
    """The record (index into `offsets`) holding flat token `position`."""
    return int(np.searchsorted(offsets, position, side="right")) - 1
