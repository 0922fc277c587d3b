"""ArrayRecord files of SQP1 records: open, read and decode with errors naming file and record.

One reader for the offline CLI (example inputs: a 1-D integer array per record, read in chunks,
with further arrays as long as it, such as labels; packed shards in `offline.verify`) and the
Grain `ArrayRecordSource` / `PackedArrayRecordSource` (random access). A file that cannot be
opened, a corrupt chunk and a record that does not decode raise `InputError` naming the file
and the record.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from seqpack.packer.inputs import check_range, common_id_dtype
from seqpack.pipelines.errors import InputError, require
from seqpack.pipelines.formats.chunks import Chunk, check_aligned, ragged
from seqpack.pipelines.formats.records import decode_row

_CHUNK_RECORDS = 4096


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else f"{type(e).__name__} with no message"


def open_reader(path: str, options: str = "readahead_buffer_size:0,max_parallelism:0") -> Any:
    """An ArrayRecordReader for random access; InputError if the file cannot be opened."""
    module = require("array_record.python.array_record_module", "reading ArrayRecord files")
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such file")
    try:
        return module.ArrayRecordReader(path, options)
    except RuntimeError as e:
        raise InputError(f"{path}: corrupt ArrayRecord file ({first_line(e)})") from None


def close_quietly(reader: Any) -> None:
    """Closes an ArrayRecordReader; a reader that hit a corrupt file raises again on close."""
    try:
        reader.close()
    except RuntimeError:
        pass


def num_records(reader: Any, path: str, expected: int | None = None) -> int:
    """Records in an open file, checked: a file that is no ArrayRecord (it reads as 0 records)
    or that holds another count than `expected` (the manifest's) raises `InputError`."""
    try:
        n = reader.num_records()
        if not n and os.path.getsize(path):
            reader.read_all()  # raises for a file that is no ArrayRecord at all
    except RuntimeError as e:
        raise InputError(f"{path}: corrupt ArrayRecord file ({first_line(e)})") from None
    if expected is not None and n != expected:
        raise InputError(f"{path}: holds {n} records, the manifest says {expected}; the shard "
                         "is incomplete or replaced")
    return n


def read_raw(reader: Any, path: str, indices: list[int]) -> list[bytes]:
    """Records `indices` of an open file; InputError naming the file and first record."""
    try:
        return reader.read(indices)
    except (RuntimeError, IndexError) as e:
        raise InputError(f"{path}: corrupt shard, cannot read record {indices[0]} "
                         f"({first_line(e)})") from None


def decode(raw: bytes, path: str, index: int, *, restore: bool = True
           ) -> dict[str, np.ndarray]:
    """One SQP1 record; InputError naming the file and record if it does not decode.
    `restore=False` leaves out the derived segment ids / positions (see `decode_row`)."""
    try:
        return decode_row(raw, restore=restore)
    except ValueError as e:
        raise InputError(f"{path} record {index}: {e}") from None


def example_chunks(path: str, column: str, *, aligned_columns: Sequence[str] = ()
                   ) -> Iterator[Chunk]:
    """The 1-D integer array `column` of every record, `_CHUNK_RECORDS` records per chunk;
    `aligned_columns`: further 1-D integer arrays (any sign, as long as `column`'s) of each
    record, as `Chunk.extra_values` in the records' common dtype."""
    reader = open_reader(path)
    try:
        n = num_records(reader, path)
        for first in range(0, n, _CHUNK_RECORDS):
            yield records_chunk(reader, path, first, min(_CHUNK_RECORDS, n - first), column,
                                aligned_columns=aligned_columns)
    finally:
        close_quietly(reader)


def read_records(reader: Any, path: str, indices: list[int], column: str, *,
                 aligned_columns: Sequence[str] = ()) -> list[dict[str, np.ndarray]]:
    """Records `indices` of an open file (random access, one read), each checked as
    `example_chunks` checks it: {column: token ids, aligned column: values}."""
    out = []
    for i, raw in zip(indices, read_raw(reader, path, indices)):
        row = decode(raw, path, i)
        seq = _example(row, column, path, i)
        rec = {column: seq}
        for name in aligned_columns:
            arr = _example(row, name, path, i, token_ids=False)
            check_aligned(f"{path} record {i}", column, seq.size, name, arr.size)
            rec[name] = arr
        out.append(rec)
    return out


def records_chunk(reader: Any, path: str, first: int, count: int, column: str, *,
                  aligned_columns: Sequence[str] = ()) -> Chunk:
    """Records [first, first + count) of an open file as a checked `Chunk` (as
    `example_chunks` reads them; random access: one record is `count=1`)."""
    try:
        raws = reader.read(list(range(first, first + count)))
    except (RuntimeError, IndexError) as e:
        raise InputError(f"{path}: corrupt ArrayRecord file, or no record {first} "
                         f"({first_line(e)})") from None
    rows = [decode(raw, path, first + i) for i, raw in enumerate(raws)]
    seqs = [_example(row, column, path, first + i) for i, row in enumerate(rows)]
    dtype = common_id_dtype([s.dtype for s in seqs])  # ids checked >= 0 above
    values, offsets = ragged(seqs, dtype)
    extra = {name: _aligned(rows, seqs, column, name, path, first) for name in aligned_columns}
    return Chunk(values, offsets, first, extra_values=extra)


def _aligned(rows: list[dict[str, np.ndarray]], seqs: list[np.ndarray], column: str, name: str,
             path: str, first: int) -> np.ndarray:
    """Array `name` of every record, checked against its tokens, back to back."""
    cols = []
    for i, (row, seq) in enumerate(zip(rows, seqs)):
        arr = _example(row, name, path, first + i, token_ids=False)
        check_aligned(f"{path} record {first + i}", column, seq.size, name, arr.size)
        cols.append(arr)
    dtypes = [c.dtype for c in cols]
    dtype = np.result_type(*dtypes) if dtypes else np.dtype(np.int32)
    if dtype.kind == "f":  # uint64 with signed arrays: int64 if every value fits it
        dtype = np.dtype(np.int64)
        cols = [check_range(c, dtype, functools.partial(_where, path, first + i, name),
                            token_ids=False) for i, c in enumerate(cols)]
    return ragged(cols, dtype)[0]


def _where(path: str, index: int, name: str, k: int) -> str:
    return f"{path} record {index}: {name}[{k}]"


def _example(row: dict[str, np.ndarray], column: str, path: str, index: int, *,
             token_ids: bool = True) -> np.ndarray:
    arr = row.get(column)
    if f"{column}_segment_lengths" in row or f"{column}_segment_ids" in row:
        raise InputError(f"{path} record {index}: a packed row (it holds {column!r}'s segment "
                         "metadata), not an example: it is a shard of a seqpack output; pack "
                         "the inputs the output was packed from, or train from the output")
    if arr is None:
        raise InputError(f"{path} record {index}: array {column!r} is missing (has "
                         f"{sorted(row)}); pass column= naming arrays the records hold")
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        what = "token ids" if token_ids else "integers"
        raise InputError(f"{path} record {index}: {column!r} is {arr.dtype}{list(arr.shape)}, "
                         f"not a 1-D integer array of {what}")
    if token_ids and arr.size and arr.dtype.kind == "i" and int(arr.min()) < 0:
        k = int(np.argmax(arr < 0))
        raise InputError(f"{path} record {index}: {column}[{k}]={int(arr[k])} is a negative "
                         "token id; ids must be >= 0")
    return arr
