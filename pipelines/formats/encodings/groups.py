"""Random access to the examples of record-oriented inputs for rows by reference
(`index.InputReader`): ArrayRecord by record, Parquet by row group (decoded groups kept in a
per-process cache, or on local disk), Arrow IPC by record batch."""

from __future__ import annotations

import collections
import os
import secrets
import threading
from typing import Any

import numpy as np

from seqpack.pipelines import storage
from seqpack.pipelines.formats import arrayrecord, arrays, parquet
from seqpack.pipelines.formats.chunks import Chunk

# Decoded Parquet row groups a process keeps, all inputs together (least recently used out)
CACHE_BYTES = int(os.environ.get("SEQPACK_INDEX_CACHE_MB", "256")) << 20


class Records:
    """An ArrayRecord input's records, read by index."""

    def __init__(self, path: str, column: str, extra: tuple[str, ...]):
        self.path, self.column, self.extra = path, column, extra
        self.reader = arrayrecord.open_reader(path)

    def examples(self, index: np.ndarray) -> list[tuple[np.ndarray, dict[str, np.ndarray]]]:
        records = arrayrecord.read_records(self.reader, self.path, index.tolist(), self.column,
                                           aligned_columns=self.extra)
        return [(r[self.column], {n: r[n] for n in self.extra}) for r in records]


class _GroupCache:
    """Decoded row groups of every Parquet input of this process, least recently used out past
    `CACHE_BYTES` (a random row's pieces come from anywhere: the larger the share of the
    corpus held, the fewer groups decoded again)."""

    def __init__(self) -> None:
        self.groups: collections.OrderedDict = collections.OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()  # rows read by threads (`Prefetch.read_threads`)

    def get(self, key: tuple[str, int], load: Any) -> Any:
        """The chunk of `key` (a local input's path, its group), loaded by `load()` if not held."""
        with self.lock:
            entry = self.groups.get(key)
            if entry is not None:
                self.groups.move_to_end(key)
                return entry[0]
        chunk = load()
        size = int(chunk.values.nbytes) + sum(int(v.nbytes) for v in chunk.extra_values.values())
        with self.lock:
            held = self.groups.pop(key, None)  # loaded by another thread meanwhile
            self.bytes += size - (held[1] if held else 0)
            self.groups[key] = (chunk, size)
            while self.bytes > CACHE_BYTES and len(self.groups) > 1:
                _, (_, dropped) = self.groups.popitem(last=False)
                self.bytes -= dropped
        return chunk


_CACHE = _GroupCache()


def disk_cache_dir() -> str | None:
    """Where decoded Parquet row groups are kept on local disk (`SEQPACK_INDEX_DISK_CACHE`: a
    directory, or "1" for the cache directory's ``index-groups``), or None: in memory only."""
    where = os.environ.get("SEQPACK_INDEX_DISK_CACHE", "")
    if where in ("", "0"):
        return None
    return os.path.join(storage.cache_root(), "index-groups") if where == "1" else where


class Groups:
    """A Parquet input's row groups (decoded into `_CACHE`; with a disk cache, decoded once
    into an uncompressed .npz there, keyed by the input's sha256, and mapped by every process),
    or an Arrow input's record batches (views of its memory map, each checked once and kept)."""

    def __init__(self, path: str, fmt: str, column: str, extra: tuple[str, ...],
                 sha256: str = ""):
        root = None if fmt == "arrow" else disk_cache_dir()
        self.disk = None if root is None else os.path.join(root, sha256 or "unknown")
        # groups kept whole by this reader: Arrow's (views of its map), those mapped from disk
        self.mapped: dict[int, Any] | None = {} if fmt == "arrow" or self.disk else None
        if fmt == "arrow":
            arrow = parquet.ArrowTokens(path, column, aligned_columns=extra)
            arrow.open_groups()
            self.file: parquet.ParquetTokens = arrow
        else:
            self.file = parquet.ParquetTokens(path, column, aligned_columns=extra)
        self.cum = np.concatenate(([0], np.cumsum(self.file.group_rows))).astype(np.int64)
        self.extra = extra

    def examples(self, index: np.ndarray) -> list[tuple[np.ndarray, dict[str, np.ndarray]]]:
        return [self.example(i) for i in index.tolist()]

    def _group(self, g: int) -> Any:
        if self.mapped is None:
            return _CACHE.get((self.file.path, g), lambda: self.file.read_group(g))
        chunk = self.mapped.get(g)
        if chunk is None:
            chunk = self.mapped[g] = self._on_disk(g) if self.disk else self.file.read_group(g)
        return chunk

    def _on_disk(self, g: int) -> Chunk:
        """Row group g mapped from the disk cache, decoded and written there first if absent
        (a temporary name, then a rename: a process never maps a partial file)."""
        assert self.disk is not None
        path = os.path.join(self.disk, f"{g}.npz")
        names = [f"extra_{j}" for j in range(len(self.extra))]
        if not os.path.exists(path):
            chunk = self.file.read_group(g)
            lo, hi = int(chunk.offsets[0]), int(chunk.offsets[-1])
            os.makedirs(self.disk, exist_ok=True)
            tmp = f"{path}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
            held: dict[str, Any] = {"values": chunk.values[lo:hi], "offsets": chunk.offsets - lo}
            held.update((k, chunk.extra_values[n][lo:hi]) for k, n in zip(names, self.extra))
            save: Any = np.savez  # uncompressed: mapped in place
            with open(tmp, "wb") as f:
                save(f, **held)
            os.replace(tmp, path)
        mapped = arrays.TokenArrays(path, "npz", "values", names)
        return Chunk(mapped.values, mapped.offsets, 0,
                     extra_values={n: mapped.aligned[k] for k, n in zip(names, self.extra)})

    def example(self, i: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        g = int(np.searchsorted(self.cum, i, side="right")) - 1
        chunk = self._group(g)
        j = i - int(self.cum[g])
        a, b = int(chunk.offsets[j]), int(chunk.offsets[j + 1])
        return chunk.values[a:b], {n: chunk.extra_values[n][a:b] for n in self.extra}
