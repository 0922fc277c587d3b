"""Parquet and Arrow IPC: token ids in a list<int> column, read a part at a time through Arrow
buffers.

One reader for the offline CLI (`ParquetTokens.chunks()`, every record in order, streamed) and the
Grain `ParquetSource` (`read_group(g)`, random access, cached there). A row group's list column is
taken apart into its Arrow buffers (flat values + offsets) with no per-token Python work.

`ArrowTokens` reads Arrow IPC files and streams the same way (HF `datasets`' ``*.arrow``: its
`save_to_disk` shards and cache files), record batch by record batch from a memory map.

With a tokenizer (`--tokenizer`) the column holds text (string / large_string) instead, tokenized
here, one row group at a time.

Checked, with `InputError` naming the file (and the record, i.e. the row in that file): the file
is readable Parquet, the column exists and is a list of integers (a float column names its first
non-integer token), no list and no token is null, no id is negative.

Aligned columns (`aligned_columns`: labels, masks) are list<int> columns of any integer type,
kept as it is, any sign, one value per token: null lists or values and a record whose list is
not as long as its token list are refused the same way. They come back as
`Chunk.extra_values`; `extra_columns` (the Grain source's per-record extras) as `Chunk.extra`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from seqpack.pipelines.errors import InputError, require
from seqpack.pipelines.formats.chunks import Chunk, check_aligned, numpy_view, record_of
from seqpack.pipelines.formats.text import encode


def _pyarrow() -> tuple[Any, Any]:
    return require("pyarrow", "reading Parquet"), require("pyarrow.parquet", "reading Parquet")


BATCH_ROWS = 4096  # records per chunk when a file is streamed


def _array(col: Any) -> Any:
    """A table column (chunked) or a record batch column as one Arrow array."""
    return col.combine_chunks() if hasattr(col, "num_chunks") else col


class ParquetTokens:
    """The token column (and optional extra columns) of one Parquet file."""

    def __init__(self, path: str | os.PathLike, column: str, *,
                 extra_columns: Sequence[str] = (), tokenizer: Any = None,
                 aligned_columns: Sequence[str] = ()):
        self.path, self.column, self.extra = os.fspath(path), column, tuple(extra_columns)
        self.aligned = tuple(aligned_columns)
        self.tokenizer = tokenizer
        if tokenizer is not None and self.aligned:
            raise InputError(f"{self.path}: extra columns cannot be read with tokenizer= (the "
                             "tokenized lengths would not match them)")
        if not os.path.isfile(self.path):
            raise InputError(f"{self.path}: no such file")
        self._check_schema(self._open())
        self.group_rows = self._group_rows()

    def _open(self) -> Any:
        """Opens the file; its Arrow schema."""
        pa, pq = _pyarrow()
        try:
            self._file = pq.ParquetFile(self.path)  # not read_table: that loads pandas
            return self._file.schema_arrow
        except (pa.ArrowException, OSError) as e:
            raise InputError(f"{self.path}: not a readable Parquet file ({e})") from None

    def _group_rows(self) -> list[int]:
        meta = self._file.metadata
        return [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]

    def _whole(self, columns: list[str]) -> Any:
        """Columns `columns` of every record, as one table."""
        return self._file.read(columns=columns)

    def _check_schema(self, schema: Any) -> None:
        """InputError naming the file when a column is missing or of a type it cannot read."""
        pa, _ = _pyarrow()
        column, tokenizer = self.column, self.tokenizer
        for name in (column, *self.extra, *self.aligned):
            if name not in schema.names:
                what = ("column= naming the token list" if name == column else
                        "extra_columns= naming columns the file holds")
                raise InputError(f"{self.path}: column {name!r} is missing (columns: "
                                 f"{schema.names[:8]}); pass {what}")
        for name in self.aligned:
            t = schema.field(name).type
            if not ((pa.types.is_list(t) or pa.types.is_large_list(t))
                    and pa.types.is_integer(t.value_type)):
                raise InputError(f"{self.path}: column {name!r} has type {t}; an extra column "
                                 "must be a list of integers per record (cast bools or floats "
                                 "to int8 / int32)")
        t = schema.field(column).type
        is_list = pa.types.is_list(t) or pa.types.is_large_list(t)
        v = t.value_type if pa.types.is_dictionary(t) else t  # text written from categories
        is_text = pa.types.is_string(v) or pa.types.is_large_string(v)
        if tokenizer is not None and not is_text:
            raise InputError(f"{self.path}: column {column!r} has type {t}, not text; tokenizer= "
                             "tokenizes a text column (drop tokenizer= for token ids, or point "
                             "column= at the text)")
        if tokenizer is None and is_text:
            raise InputError(f"{self.path}: column {column!r} has type {t}, text: name the "
                             "token ids with column=, or tokenize the text (seqpack pack: "
                             "tokenizer='tokenizer.json'; a Grain source: map it through a "
                             "tokenizer before packing)")
        if tokenizer is None and not (is_list and pa.types.is_integer(t.value_type)):
            where = self._first_non_integer() if is_list and pa.types.is_floating(
                t.value_type) else ""
            raise InputError(f"{self.path}: column {column!r} has type {t}; every record must "
                             f"be a list of integer token ids (list<int32> or list<int64>){where}")

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_file"] = None  # reopened on first use after unpickling
        return state

    @property
    def num_records(self) -> int:
        return sum(self.group_rows)

    def _pf(self) -> Any:
        if self._file is None:
            _, pq = _pyarrow()
            self._file = pq.ParquetFile(self.path)
        return self._file

    def _first_non_integer(self) -> str:
        col = self._whole([self.column]).column(0).combine_chunks()
        values = col.values.to_numpy(zero_copy_only=False)
        bad = np.flatnonzero(~np.isfinite(values) | (values != np.round(values)))
        if not bad.size:
            return ""
        pos = int(bad[0])
        return (f"; {self.path} record {record_of(col.offsets.to_numpy(), pos)}: "
                f"token {values[pos].item()!r} is not an integer id")

    def chunks(self, batch_rows: int = BATCH_ROWS) -> Iterator[Chunk]:
        """Every record, in order, `batch_rows` at a time, checked.

        Streams the file: memory is bounded by the batch, not the row group (reading a whole
        row group of 47 MB of tokens takes about 220 MB, 4096 records about 60 MB).
        """
        pa, pq = _pyarrow()
        columns = [self.column, *self.extra, *self.aligned]
        first = g = 0
        where = "records from 0 on"
        try:
            pf = pq.ParquetFile(self.path, pre_buffer=False, buffer_size=1 << 20)
            for g in range(pf.num_row_groups):  # a group at a time: an error names its group
                size = pf.metadata.row_group(g).num_rows
                where = f"row group {g} (records {first} to {first + size - 1})"
                for batch in pf.iter_batches(batch_size=batch_rows, row_groups=[g],
                                             columns=columns, use_threads=False):
                    chunk = self._checked(batch, first)
                    first += batch.num_rows
                    yield chunk
        except (pa.ArrowException, OSError) as e:
            raise InputError(f"{self.path}: cannot read {where} ({e})") from None

    def read_group(self, g: int) -> Chunk:
        """Row group g, checked; `extra` holds the extra columns as numpy arrays."""
        pa, _ = _pyarrow()
        first = sum(self.group_rows[:g])
        try:
            table = self._pf().read_row_group(g, columns=[self.column, *self.extra,
                                                          *self.aligned])
        except (pa.ArrowException, OSError) as e:
            raise InputError(f"{self.path}: cannot read row group {g} ({e})") from None
        return self._checked(table, first)

    def _checked(self, table: Any, first: int) -> Chunk:
        """The records of a table or record batch whose first record is `first`, checked."""
        col = table.column(self.column)
        col = col.chunk(0) if getattr(col, "num_chunks", 0) == 1 else _array(col)
        extra = {name: _array(table.column(name)).to_numpy(zero_copy_only=False)
                 for name in self.extra}
        if self.tokenizer is not None:
            texts = col.to_pylist()
            if col.null_count:
                i = texts.index(None)
                raise InputError(f"{self.path} record {first + i}: column {self.column!r} is "
                                 "null; write an empty string for an empty example")
            values, offsets = encode(self.tokenizer, texts)
            return Chunk(values, offsets, first, extra)
        offsets, values = self._list(col, self.column, first)
        lo, hi = int(offsets[0]), int(offsets[-1])
        if hi > lo and values.dtype.kind == "i":
            neg = np.flatnonzero(values[lo:hi] < 0)
            if neg.size:
                pos = lo + int(neg[0])
                raise InputError(f"{self.path} record {first + record_of(offsets, pos)}: token "
                                 f"id {int(values[pos])} is negative; ids must be >= 0")
        aligned = {}
        for name in self.aligned:
            other, aligned[name] = self._list(_array(table.column(name)), name, first)
            lengths, others = np.diff(offsets), np.diff(other)
            if not np.array_equal(lengths, others):
                i = int(np.argmax(lengths != others))
                check_aligned(f"{self.path} record {first + i}", self.column, int(lengths[i]),
                              name, int(others[i]))
            shift, vals = int(other[0]) - lo, aligned[name]  # to share the token offsets:
            if shift:
                aligned[name] = (vals[shift:] if shift > 0 else
                                 np.concatenate([np.zeros(-shift, vals.dtype), vals]))
        return Chunk(values, offsets, first, extra, extra_values=aligned)

    def _list(self, col: Any, name: str, first: int) -> tuple[np.ndarray, np.ndarray]:
        """(offsets i64[n + 1], flat values) of a list column, refusing nulls by record."""
        if col.null_count:
            i = int(np.argmax(col.is_null().to_numpy(zero_copy_only=False)))
            raise InputError(f"{self.path} record {first + i}: column {name!r} is null; "
                             "write an empty list for an empty example")
        offsets = numpy_view(col.offsets).astype(np.int64)
        lo, hi = int(offsets[0]), int(offsets[-1])
        child = col.values.slice(lo, hi - lo)  # .values ignores the list's own slicing
        if child.null_count:
            pos = lo + int(np.argmax(child.is_null().to_numpy(zero_copy_only=False)))
            what = "a token id" if name == self.column else f"a value of column {name!r}"
            raise InputError(f"{self.path} record {first + record_of(offsets, pos)}: "
                             f"{what} is null")
        return offsets, numpy_view(col.values)


class ArrowTokens(ParquetTokens):
    """The token column (and aligned columns) of an Arrow IPC file or stream: what HF
    `datasets` writes (`save_to_disk`'s ``data-00000-of-00001.arrow``, its cache files),
    memory-mapped and read record batch by record batch, checked as Parquet is."""

    def _open(self) -> Any:
        pa, _ = _pyarrow()
        try:
            with self._reader() as reader:
                return reader.schema
        except (pa.ArrowException, OSError) as e:
            raise InputError(f"{self.path}: not a readable Arrow IPC file or stream ({e})") \
                from None

    @contextlib.contextmanager
    def _reader(self) -> Iterator[Any]:
        pa, _ = _pyarrow()
        with pa.memory_map(self.path) as source:
            try:
                reader = pa.ipc.open_file(source)  # the IPC file format (random access)
            except pa.ArrowInvalid:
                source.seek(0)
                reader = pa.ipc.open_stream(source)  # the stream format (HF datasets)
            yield reader

    def _batches(self, columns: list[str]) -> Iterator[Any]:
        with self._reader() as reader:
            if hasattr(reader, "num_record_batches"):
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            else:
                batches = iter(reader)
            for batch in batches:
                yield batch.select(columns)

    def _group_rows(self) -> list[int]:
        return []  # read in order (`chunks`), or at random by `open_groups`

    def open_groups(self) -> list[int]:
        """Opens the file for random access by record batch (memory-mapped: the batches are
        views); returns and sets `group_rows`, each batch's records, for `read_group`."""
        pa, _ = _pyarrow()
        columns = [self.column, *self.extra, *self.aligned]
        try:
            source = pa.memory_map(self.path)
            try:
                reader: Any = pa.ipc.open_file(source)
                batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
            except pa.ArrowInvalid:
                source.seek(0)
                batches = list(pa.ipc.open_stream(source))
        except (pa.ArrowException, OSError) as e:
            raise InputError(f"{self.path}: not a readable Arrow IPC file or stream ({e})") \
                from None
        self._open_batches = [b.select(columns) for b in batches]
        self.group_rows = [b.num_rows for b in self._open_batches]
        return self.group_rows

    def read_group(self, g: int) -> Chunk:
        """Record batch g (`open_groups` first), checked."""
        return self._checked(self._open_batches[g], sum(self.group_rows[:g]))

    def _whole(self, columns: list[str]) -> Any:
        pa, _ = _pyarrow()
        return pa.Table.from_batches(list(self._batches(columns)))

    def chunks(self, batch_rows: int = BATCH_ROWS) -> Iterator[Chunk]:
        """Every record, in order, at most `batch_rows` at a time, checked."""
        pa, _ = _pyarrow()
        first = 0
        try:
            for batch in self._batches([self.column, *self.extra, *self.aligned]):
                for at in range(0, batch.num_rows, batch_rows):
                    part = batch.slice(at, batch_rows)
                    chunk = self._checked(part, first)
                    first += part.num_rows
                    yield chunk
        except (pa.ArrowException, OSError) as e:
            raise InputError(f"{self.path}: cannot read records from {first} on ({e})") from None
