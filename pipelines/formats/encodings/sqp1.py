"""`--format arrayrecord` (the default): one SQP1 record per packed row in an ArrayRecord file.

Every row of a run has the same layout, so `RowEncoder` computes the record header once and
joins each row's arrays around it (the bytes of `formats.records.encode_row`, row by row). The
segment ids / positions are left out unless `Layout.store_derived`: readers rebuild them from the
`[S]` metadata (`packer.contract.restore_derived`) and the shards are about a third of the size.
ArrayRecord chunks hold one record each (`group_size:1`: random access reads one record),
uncompressed, snappy or zstd.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from seqpack.pipelines.errors import InputError, require
from seqpack.pipelines.formats import arrayrecord
from seqpack.pipelines.formats.encodings.base import Encoding, Layout, ShardReader
from seqpack.pipelines.formats.records import decode_batch, decode_row, encode_row

COMPRESSION = {"none": "uncompressed", "snappy": "snappy", "zstd": "zstd:3"}


class RowEncoder:
    """SQP1 records for the rows of a batch; same bytes as `encode_row` row by row."""

    def __init__(self, batch: Mapping[str, np.ndarray]):
        self.keys = list(batch)
        template = encode_row({k: batch[k][0] for k in self.keys})
        views = decode_row(template, restore=False)
        base = np.frombuffer(template, np.uint8).ctypes.data
        self.parts: list = []
        self.slots: list[int] = []
        pos = 0
        for k in self.keys:
            start = views[k].ctypes.data - base
            assert views[k].nbytes and start >= pos, k
            self.parts.append(template[pos:start])
            self.slots.append(len(self.parts))
            self.parts.append(b"")
            pos = start + views[k].nbytes
        self.parts.append(template[pos:])
        self.fast = sys.byteorder == "little"

    def records(self, batch: Mapping[str, np.ndarray]) -> Iterator[bytes]:
        """Yields the record of each row in order."""
        arrays = [np.ascontiguousarray(batch[k]) for k in self.keys]
        num_rows = arrays[0].shape[0]
        if not self.fast:  # pragma: no cover - big-endian hosts
            for r in range(num_rows):
                yield encode_row({k: a[r] for k, a in zip(self.keys, arrays)})
            return
        parts, slots = list(self.parts), self.slots
        for r in range(num_rows):
            for slot, a in zip(slots, arrays):
                parts[slot] = a[r].data
            yield b"".join(parts)


class _Reader(ShardReader):
    def __init__(self, path: str):
        self.path = path
        self.handle = arrayrecord.open_reader(path, "readahead_buffer_size:0")
        self.num_rows = arrayrecord.num_records(self.handle, path)

    def row(self, j: int) -> dict[str, np.ndarray]:
        return arrayrecord.decode(arrayrecord.read_raw(self.handle, self.path, [j])[0],
                                  self.path, j)

    def close(self) -> None:
        arrayrecord.close_quietly(self.handle)


class Sqp1(Encoding):
    name, suffix, record_encoding = "arrayrecord", ".arrayrecord", "SQP1"

    def writer_options(self, layout: Layout) -> str:
        return f"group_size:1,{COMPRESSION[layout.compression]}"

    def stored_keys(self, layout: Layout) -> list[str]:
        k = layout.config.keys()
        derived = () if layout.store_derived else k.derived
        return [n for n in k.roles().values() if n not in derived] + \
            layout.sources()[2:] + layout.names()

    def wants_derived(self, layout: Layout) -> bool:
        return layout.store_derived

    def open_writer(self, path: str, options: str) -> Any:
        module = require("array_record.python.array_record_module", "writing shards")
        return module.ArrayRecordWriter(path, options)

    def write(self, path: str, batch: Mapping[str, np.ndarray], layout: Layout) -> None:
        writer = self.open_writer(path, self.writer_options(layout))
        try:
            for record in RowEncoder(batch).records(batch):
                writer.write(record)
        finally:
            writer.close()  # raises what a failed write left (RuntimeError naming the cause)

    def read(self, path: str, layout: Layout, num_rows: int | None = None
             ) -> dict[str, np.ndarray]:
        reader = arrayrecord.open_reader(path)
        try:
            try:
                n = reader.num_records()
                if num_rows is not None and n != num_rows:
                    raise InputError(f"{path}: holds {n} rows, the manifest says {num_rows}; "
                                     "the shard is incomplete or replaced")
                raws = reader.read_all()
            except RuntimeError as e:
                raise InputError(f"{path}: corrupt shard ({arrayrecord.first_line(e)})") \
                    from None
        finally:
            arrayrecord.close_quietly(reader)
        try:
            return decode_batch(raws)  # every row of a run has one layout: one pass
        except ValueError:
            for j, raw in enumerate(raws):  # the record that does not decode, by name
                arrayrecord.decode(raw, path, j, restore=False)
            raise InputError(f"{path}: rows have different keys or shapes") from None

    def reader(self, path: str, layout: Layout) -> ShardReader:
        return _Reader(path)

