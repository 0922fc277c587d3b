"""JSON Lines example source with random access: one JSON object per line, token ids in a field.

On construction every file is scanned once (numpy search for newlines) to build a line index, so
`source[i]` seeks straight to its line. Blank lines are skipped and do not count as records.

Example (file ``a.jsonl``)::

    {"tokens": [101, 7592, 102], "id": 3}
    {"tokens": [101, 102]}

    JsonlSource("a.jsonl")[1]     # {"tokens": array([101, 102], dtype=int32)}

A line that is not a JSON object, lacks the field, or holds anything but a list of non-negative
integers raises ValueError naming the file, the 1-based line number and the record index.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from seqpack.pipelines.datasets.sources import as_path_list, locate, norm_index


def _line_index(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start, end, line number) of the non-blank lines of a file; i64[n] each."""
    size = os.path.getsize(path)
    if size == 0:
        z = np.zeros(0, np.int64)
        return z, z, z
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        data = np.frombuffer(mm, np.uint8)
        newlines = np.flatnonzero(data == ord("\n"))
        del data
    starts = np.concatenate([[0], newlines + 1])
    ends = np.concatenate([newlines, [size]])
    line_no = np.arange(1, starts.size + 1, dtype=np.int64)
    keep = ends > starts
    return starts[keep], ends[keep], line_no[keep]


class JsonlSource(grain.MapDataset):
    """Examples from JSON Lines files; element = {feature: int array, **extra fields}.

    paths:        one file or a list of files (records numbered across files in order).
    field:        the JSON key holding the token ids (a list of ints).
    feature:      the element key for them (default: `field`).
    dtype:        the token array dtype; ids must fit it.
    extra_fields: further JSON keys copied into the element (scalars or lists become arrays).
    """

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        field: str = "tokens",
        feature: str | None = None,
        dtype: Any = np.int32,
        extra_fields: Sequence[str] = (),
    ):
        super().__init__()
        self._paths = as_path_list(paths, name="JsonlSource")
        self._field = field
        self._feature = feature or field
        self._dtype = np.dtype(dtype)
        if self._dtype.kind not in "iu":
            raise ValueError(f"dtype={self._dtype} must be an integer dtype, e.g. np.int32")
        self._extra = tuple(extra_fields)
        self._index = [_line_index(p) for p in self._paths]
        counts = [idx[0].size for idx in self._index]
        self._cum = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._fds: dict[int, int] = {}
        self._pid = os.getpid()

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_fds"] = {}  # file descriptors do not cross processes
        return state

    def __len__(self) -> int:
        return int(self._cum[-1])

    def __str__(self) -> str:
        return f"JsonlSource({len(self._paths)} files, {len(self)} records)"

    def _fd(self, f: int) -> int:
        if self._pid != os.getpid():
            self._fds, self._pid = {}, os.getpid()
        fd = self._fds.get(f)
        if fd is None:
            fd = self._fds[f] = os.open(self._paths[f], os.O_RDONLY)
        return fd

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        index = norm_index(index, len(self), str(self))
        f, j = locate(self._cum, index)
        starts, ends, line_no = self._index[f]
        start, end = int(starts[j]), int(ends[j])
        raw = os.pread(self._fd(f), end - start, start)
        where = f"{self._paths[f]} line {int(line_no[j])} (record {index})"
        return self._parse(raw, where)

    def _parse(self, raw: bytes, where: str) -> dict[str, Any]:
        try:
            record = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"{where}: not valid JSON ({e}); fix or remove the line") from None
        if not isinstance(record, dict):
            raise ValueError(
                f"{where}: expected a JSON object, got {type(record).__name__}; "
                f"write one object per line with a {self._field!r} list"
            )
        if self._field not in record:
            raise ValueError(
                f"{where}: field {self._field!r} is missing (keys: {sorted(record)[:8]}); "
                "pass field=... naming the token list"
            )
        out = {self._feature: self._tokens(record[self._field], where)}
        for key in self._extra:
            if key not in record:
                raise ValueError(f"{where}: extra field {key!r} is missing")
            out[key] = np.asarray(record[key])
        return out

    def _tokens(self, value: Any, where: str) -> np.ndarray:
        field = self._field
        if not isinstance(value, list):
            raise ValueError(
                f"{where}: field {field!r} must be a list of token ids, got "
                f"{type(value).__name__}"
            )
        if not value:
            return np.zeros(0, self._dtype)
        for k, t in enumerate(value):
            if type(t) is not int:  # bool, float, str, None, nested list: all rejected
                raise ValueError(f"{where}: {field}[{k}]={t!r} is not an integer token id")
        arr = np.asarray(value)
        if arr.dtype.kind not in "iu":  # ints beyond 64 bits
            arr = np.asarray([min(max(t, -1), 2**63 - 1) for t in value])
        info = np.iinfo(self._dtype)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or lo < info.min or hi > info.max:
            k = int(np.argmax((arr < 0) | (arr < info.min) | (arr > info.max)))
            raise ValueError(
                f"{where}: {field}[{k}]={value[k]} is not a valid token id for "
                f"{self._dtype} (ids must be in [0, {info.max}])"
            )
        return arr.astype(self._dtype)

    def __del__(self):
        for fd in getattr(self, "_fds", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass
