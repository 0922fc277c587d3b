"""Parquet example source with random access: token ids in a list<int> column, read via pyarrow.

A row group is read on first access and kept (a few at a time); its list column is taken apart
into the Arrow buffers (flat values + offsets) with no per-token Python work, and every element
is a numpy view into them.

Example (column ``tokens: list<int32>``)::

    src = ParquetSource(["part-0.parquet", "part-1.parquet"], column="tokens")
    len(src)                      # rows of both files
    src[0]                        # {"tokens": array([101, 7592, 102], dtype=int32)}

A missing column, a column that is not a list of integers, a null list, a null token or a
negative id raises ValueError naming the file and the record index (row in that file).
"""

from __future__ import annotations

import collections
import os
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from seqpack.pipelines.datasets.sources import as_path_list, locate, norm_index


def _pa():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:  # pragma: no cover - pyarrow is in the grain extra
        raise ImportError("ParquetSource needs pyarrow: pip install 'seqpack[grain]'") from e
    return pa, pq


class ParquetSource(grain.MapDataset):
    """Examples from Parquet files; element = {feature: int array, **extra columns}.

    paths:         one file or a list of files (records numbered across files in order).
    column:        the list<int> column holding the token ids.
    feature:       the element key for them (default: `column`).
    extra_columns: further columns copied into each element (numeric scalars or lists).
    cache_row_groups: how many decoded row groups to keep in memory.
    """

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        column: str = "tokens",
        feature: str | None = None,
        extra_columns: Sequence[str] = (),
        cache_row_groups: int = 4,
    ):
        super().__init__()
        pa, pq = _pa()
        self._paths = as_path_list(paths, name="ParquetSource")
        self._column = column
        self._feature = feature or column
        self._extra = tuple(extra_columns)
        self._cache_size = max(1, int(cache_row_groups))
        group_rows: list[list[int]] = []
        for path in self._paths:
            pf = pq.ParquetFile(path)
            self._check_schema(pa, pf.schema_arrow, path)
            meta = pf.metadata
            group_rows.append([meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
        # Global record -> (file, row group): cumulative counts over all row groups.
        self._groups = [(f, g) for f, rows in enumerate(group_rows) for g in range(len(rows))]
        flat = [r for rows in group_rows for r in rows]
        self._group_cum = np.concatenate([[0], np.cumsum(flat)]).astype(np.int64)
        file_counts = [sum(rows) for rows in group_rows]
        self._file_cum = np.concatenate([[0], np.cumsum(file_counts)]).astype(np.int64)
        self._cache: collections.OrderedDict = collections.OrderedDict()

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_cache"] = collections.OrderedDict()
        return state

    def _check_schema(self, pa, schema, path: str) -> None:
        names = schema.names
        for name in (self._column, *self._extra):
            if name not in names:
                raise ValueError(
                    f"{path} record 0: column {name!r} is missing (columns: {names[:8]}); "
                    "pass column=... naming the token list"
                )
        t = schema.field(self._column).type
        is_list = pa.types.is_list(t) or pa.types.is_large_list(t)
        if is_list and pa.types.is_integer(t.value_type):
            return
        if is_list and pa.types.is_floating(t.value_type):
            self._report_float_tokens(path)
        raise ValueError(
            f"{path} record 0: column {self._column!r} has type {t}, every record must be "
            "a list of integer token ids (list<int32> or list<int64>)"
        )

    def _report_float_tokens(self, path: str) -> None:
        _, pq = _pa()
        col = pq.read_table(path, columns=[self._column]).column(0).combine_chunks()
        values = col.values.to_numpy(zero_copy_only=False)
        offsets = col.offsets.to_numpy()
        bad = np.flatnonzero(~np.isfinite(values) | (values != np.round(values)))
        first = int(bad[0]) if bad.size else int(offsets[np.argmax(np.diff(offsets) > 0)])
        record = int(np.searchsorted(offsets, first, side="right")) - 1
        raise ValueError(
            f"{path} record {record}: token {values[first].item()!r} in column "
            f"{self._column!r} is not an integer id; store token ids as list<int32>"
        )

    def __len__(self) -> int:
        return int(self._group_cum[-1])

    def __str__(self) -> str:
        return f"ParquetSource({len(self._paths)} files, {len(self)} records)"

    def _load(self, k: int):
        """Decodes row group k into (values, offsets, extra columns), checked."""
        cached = self._cache.get(k)
        if cached is not None:
            self._cache.move_to_end(k)
            return cached
        _, pq = _pa()
        f, g = self._groups[k]
        path = self._paths[f]
        first = int(self._group_cum[k] - self._file_cum[f])  # record index in the file
        table = pq.ParquetFile(path).read_row_group(g, columns=[self._column, *self._extra])
        col = table.column(self._column).combine_chunks()
        if col.null_count:
            i = int(np.argmax(col.is_null().to_numpy(zero_copy_only=False)))
            raise ValueError(
                f"{path} record {first + i}: column {self._column!r} is null; "
                "write an empty list for an empty example"
            )
        offsets = col.offsets.to_numpy().astype(np.int64, copy=False)
        child = col.values
        if child.null_count:
            pos = int(np.argmax(child.is_null().to_numpy(zero_copy_only=False)))
            i = int(np.searchsorted(offsets, pos, side="right")) - 1
            raise ValueError(f"{path} record {first + i}: a token id is null")
        values = child.to_numpy()
        lo, hi = int(offsets[0]), int(offsets[-1])
        if hi > lo and np.issubdtype(values.dtype, np.signedinteger):
            neg = np.flatnonzero(values[lo:hi] < 0)
            if neg.size:
                i = int(np.searchsorted(offsets, lo + neg[0], side="right")) - 1
                raise ValueError(
                    f"{path} record {first + i}: token id {int(values[lo + neg[0]])} is "
                    "negative; ids must be >= 0"
                )
        extra = {}
        for name in self._extra:
            c = table.column(name).combine_chunks()
            extra[name] = c.to_numpy(zero_copy_only=False)
        entry = (values, offsets.tolist(), extra)
        self._cache[k] = entry
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return entry

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        index = norm_index(index, len(self), str(self))
        k, j = locate(self._group_cum, index)
        values, offsets, extra = self._load(k)
        out: dict[str, Any] = {self._feature: values[offsets[j] : offsets[j + 1]]}
        for name, col in extra.items():
            v = col[j]
            out[name] = np.asarray(v) if isinstance(v, (list, np.ndarray)) else v
        return out
