"""Parquet for the encodings that write it: list columns from row arrays and back, one writer.

Every Parquet shard is written by `write_parquet`: row groups of `ROW_GROUP_ROWS` rows (a random
read decodes one group: the Grain source, `inspect`, Megatron-Bridge's reader), no statistics,
dictionary pages only where asked (segment ids and positions, a few distinct values a row),
and the run's compression. The bytes depend only on the rows and the pyarrow version, so every
runner and worker count writes the same file. Columns are `list<T>` (`large_list` past 2**31
values in a shard), which pyarrow, pandas, HF `datasets`, DuckDB and Spark all read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from seqpack.pipelines.errors import InputError, require
from seqpack.pipelines.formats.chunks import numpy_view
from seqpack.pipelines.formats.encodings.base import Encoding, Layout, ShardReader, check_count

ROW_GROUP_ROWS = 8  # rows per row group: a random read decodes this many rows
_COMPRESSION = {"none": ("NONE", None), "snappy": ("SNAPPY", None), "zstd": ("ZSTD", 3)}

Decode = Callable[[Any, str, int], dict[str, np.ndarray]]  # (table, path, first row) -> rows


def modules() -> tuple[Any, Any]:
    """(pyarrow, pyarrow.parquet)."""
    return require("pyarrow", "Parquet shards"), require("pyarrow.parquet", "Parquet shards")


def list_array(values: np.ndarray, offsets: np.ndarray) -> Any:
    """A `list<T>` array (`large_list` past 2**31 values): row i is
    `values[offsets[i]:offsets[i + 1]]`."""
    pa, _ = modules()
    offsets = np.asarray(offsets, np.int64)
    if offsets[-1] < 2**31:
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values))
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))


def padded(rows: np.ndarray) -> Any:
    """The `[R, W]` array `rows` as a list column of R lists of W values."""
    R, W = rows.shape
    return list_array(np.ascontiguousarray(rows).reshape(-1), np.arange(R + 1) * W)


def kept(rows: np.ndarray, keep: np.ndarray) -> Any:
    """A list column holding, per row of `rows` `[R, W]`, its values where `keep` is set."""
    counts = keep.sum(axis=1, dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(counts)))
    return list_array(np.asarray(rows)[keep], offsets)


def write_parquet(path: str, columns: Mapping[str, Any], layout: Layout, *,
                  dictionary: Sequence[str] = ()) -> None:
    """One shard: `columns` (name -> Arrow array, in order) as a Parquet file at `path`."""
    pa, pq = modules()
    codec, level = _COMPRESSION[layout.compression]
    pq.write_table(pa.table(dict(columns)), path, row_group_size=ROW_GROUP_ROWS,
                   compression=codec, compression_level=level,
                   use_dictionary=list(dictionary) or False, write_statistics=False,
                   write_page_checksum=True)  # a flipped byte is an error when read, not a token


def writer_options(layout: Layout) -> str:
    """The manifest's `writer_options` of a Parquet shard."""
    return f"parquet:row_group_size={ROW_GROUP_ROWS},compression={layout.compression}"


def open_file(path: str, names: Sequence[str]) -> Any:
    """A ParquetFile holding columns `names`; InputError naming the file otherwise."""
    pa, pq = modules()
    try:
        pf = pq.ParquetFile(path, pre_buffer=False,  # random reads: only what a row needs
                            page_checksum_verification=True)  # pages written with a CRC
        have = pf.schema_arrow.names
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"{path}: not a readable Parquet shard ({e})") from None
    missing = [n for n in names if n not in have]
    if missing:
        raise InputError(f"{path}: lacks the columns {missing} its manifest says every row "
                         f"holds (has {have})")
    return pf


def read_parquet(path: str, names: Sequence[str], decode: Decode,
                 num_rows: int | None = None) -> dict[str, np.ndarray]:
    """Every row of a Parquet shard, decoded by the encoding's `decode`."""
    pa, _ = modules()
    pf = open_file(path, names)
    check_count(path, pf.metadata.num_rows, num_rows)
    try:
        table = pf.read(columns=list(names), use_threads=False)
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"{path}: corrupt shard ({e})") from None
    return decode(table, path, 0)


def ragged(table: Any, name: str, path: str, first: int) -> tuple[np.ndarray, np.ndarray]:
    """(offsets i64[R + 1] from 0, values) of list column `name`; InputError naming the row of
    a null."""
    col = table.column(name)
    col = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    if col.null_count:
        i = int(np.argmax(col.is_null().to_numpy(zero_copy_only=False)))
        raise InputError(f"{path} row {first + i}: {name} is null")
    offsets = numpy_view(col.offsets).astype(np.int64)
    values = col.values
    if values.null_count:
        raise InputError(f"{path}: {name} holds a null value")
    flat = numpy_view(values) if len(values) else np.zeros(0, np.dtype(str(values.type)))
    lo = int(offsets[0])
    return offsets - lo, flat[lo : int(offsets[-1])]


def square(table: Any, name: str, width: int, path: str, first: int) -> np.ndarray:
    """List column `name` as `[R, width]`; InputError naming the first row of another width."""
    offsets, values = ragged(table, name, path, first)
    sizes = np.diff(offsets)
    if (sizes != width).any():
        i = int(np.argmax(sizes != width))
        raise InputError(f"{path} row {first + i}: {name} holds {sizes[i]} values, not "
                         f"{width}")
    return values.reshape(-1, width)


def spread(offsets: np.ndarray, values: np.ndarray, width: int, pad: Any, path: str,
           name: str, first: int) -> np.ndarray:
    """Ragged rows (each at most `width` long) as `[R, width]`, `pad` after each row's values."""
    sizes = np.diff(offsets)
    if (sizes > width).any():
        i = int(np.argmax(sizes > width))
        raise InputError(f"{path} row {first + i}: {name} holds {sizes[i]} values, more than "
                         f"{width}")
    out = np.full((sizes.size, width), pad, values.dtype)
    out[np.arange(width) < sizes[:, None]] = values
    return out


def aligned(table: Any, columns: Sequence[tuple[str, Any]], offsets: np.ndarray, width: int,
            path: str, first: int, what: str) -> dict[str, np.ndarray]:
    """List columns (name, pad) holding one value per value of the list column `what` (whose
    row offsets are `offsets`), each as `[R, width]` with its pad after a row's values."""
    out = {}
    for name, pad in columns:
        got, values = ragged(table, name, path, first)
        if not np.array_equal(got, offsets):
            i = int(np.argmax(np.diff(got) != np.diff(offsets)))
            raise InputError(f"{path} row {first + i}: {name} is not as long as {what}")
        out[name] = spread(got, values, width, pad, path, name, first)
    return out


class ParquetEncoding(Encoding):
    """An encoding whose shards are Parquet files (`write_parquet`), read back by the rows'
    `decoder`: `read` decodes the whole file, `reader` a row group at a time."""

    def writer_options(self, layout: Layout) -> str:
        return writer_options(layout)

    def decoder(self, layout: Layout) -> Decode:
        raise NotImplementedError

    def read(self, path: str, layout: Layout, num_rows: int | None = None
             ) -> dict[str, np.ndarray]:
        return read_parquet(path, self.stored_keys(layout), self.decoder(layout), num_rows)

    def reader(self, path: str, layout: Layout) -> ShardReader:
        return ParquetReader(path, self.stored_keys(layout), self.decoder(layout))


class ParquetReader(ShardReader):
    """Random access to a Parquet shard: a row's whole row group is decoded, the last one kept."""

    def __init__(self, path: str, names: Sequence[str], decode: Decode):
        self.path, self.names, self.decode = path, list(names), decode
        self.file = open_file(path, names)
        meta = self.file.metadata
        self.num_rows = meta.num_rows
        sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        self.starts = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
        self.cached: tuple[int, dict[str, np.ndarray]] | None = None

    def row(self, j: int) -> dict[str, np.ndarray]:
        pa, _ = modules()
        g = int(np.searchsorted(self.starts, j, side="right")) - 1
        if self.cached is None or self.cached[0] != g:
            try:
                table = self.file.read_row_group(g, columns=self.names, use_threads=False)
            except (pa.ArrowException, OSError) as e:
                raise InputError(f"{self.path}: corrupt shard, cannot read row {j} ({e})") \
                    from None
            self.cached = (g, self.decode(table, self.path, int(self.starts[g])))
        at = j - int(self.starts[g])
        return {k: v[at] for k, v in self.cached[1].items()}

    def close(self) -> None:
        self.cached = None
