"""Grain sources over files: JSONL, Parquet, ArrayRecord and token arrays, random access.

Each is a `grain.MapDataset` over the format readers in `pipelines.formats` (the same checks and
errors as the offline CLI: `InputError` naming the file and the line or record).

    JsonlSource("a.jsonl")[1]                        # {"tokens": array([101, 102], dtype=int32)}
    ParquetSource(["p0.parquet", "p1.parquet"], column="tokens")
    ArrayRecordSource("examples.arrayrecord")        # SQP1 records, decoded zero-copy
    TokenArraySource("corpus_text_document.bin")     # Megatron .bin/.idx, .npz, .npy: mapped
    PackedArrayRecordSource("out/packed")            # a `seqpack pack` directory (manifest.json)

Paths may be URLs (gs://, s3://, any fsspec protocol; needs ``seqpack[cloud]``): each object is
downloaded once into a local cache (`cache_dir=`, default ``$SEQPACK_CACHE_DIR``, else
``$XDG_CACHE_HOME/seqpack`` or ``~/.cache/seqpack``; `pipelines.storage.cached_copy`) and read
from there, since the readers need local files. The cost: one download per file, disk for all of
them. For ``PackedArrayRecordSource("gs://bucket/packed/")`` the manifest is read and checked
remotely (its own digest, shard names, shard sizes) and every shard is checked against the
manifest's size and sha256 as it is downloaded: a damaged remote shard is refused, named. Errors
name the URL, not the cached copy.

Records are numbered across files in order. `PackedArrayRecordSource` reads the packed rows the
offline writer produces (a directory holding ``manifest.json``, or shard files) and checks each
row for the contract keys of its feature; `make_training_pipeline` batches it without packing.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from seqpack.packer.contract import keys, restore_derived
from seqpack.pipelines import storage
from seqpack.pipelines.datasets.sources import as_path_list, locate, norm_index
from seqpack.pipelines.errors import InputError
from seqpack.pipelines.formats import arrayrecord, jsonl
from seqpack.pipelines.formats.arrays import TokenArrays, megatron_pair, megatron_prefix
from seqpack.pipelines.formats.detect import ARRAYS, format_by_name
from seqpack.pipelines.formats.encodings import of_manifest, read_threads
from seqpack.pipelines.formats.manifest import (
    INTENT,
    MANIFEST,
    Manifest,
    read_manifest,
)
from seqpack.pipelines.formats.parquet import ParquetTokens

Paths = str | os.PathLike | Sequence[str | os.PathLike]


class _FileSource(grain.MapDataset):
    """Records numbered across files: `_cum` holds cumulative counts per file (or row group).

    Open handles (file descriptors, readers) are per process: they do not cross a fork or a
    pickle.
    """

    _paths: list[str]  # local files, read
    _names: list[str]  # what errors name: the same paths, or the URLs they were copied from
    _cum: np.ndarray  # i64[units + 1]

    def __init__(self) -> None:
        super().__init__()
        self._handles: dict[int, Any] = {}
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_handles"] = {}
        return state

    def _handle(self, f: int, open_fn) -> Any:
        if self._pid != os.getpid():
            self._handles, self._pid = {}, os.getpid()
        handle = self._handles.get(f)
        if handle is None:
            handle = self._handles[f] = open_fn(f)
        return handle

    def __len__(self) -> int:
        return int(self._cum[-1])

    def __str__(self) -> str:
        return f"{type(self).__name__}({len(self._paths)} files, {len(self)} records)"

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        index = norm_index(index, len(self), str(self))
        return self._get(index, *locate(self._cum, index))

    def _get(self, index: int, unit: int, j: int) -> dict[str, Any]:
        """Record `index`: record j of file (or row group) `unit`."""
        raise NotImplementedError


class JsonlSource(_FileSource):
    """Examples from JSON Lines files; element = {feature: int array, **extra fields}.

    paths:        one file or a list of files.
    field:        the JSON key holding the token ids (a list of ints).
    feature:      the element key for them (default: `field`).
    dtype:        the token array dtype; ids must fit it.
    extra_fields: further JSON keys copied into the element (scalars or lists become arrays).
    cache_dir:    where URL inputs are copied (see the module docstring).

    On construction every file is scanned once for its line starts, so `source[i]` reads one line.
    """

    def __init__(self, paths: Paths, *, field: str = "tokens", feature: str | None = None,
                 dtype: Any = np.int32, extra_fields: Sequence[str] = (),
                 cache_dir: str | os.PathLike | None = None):
        super().__init__()
        self._names = as_path_list(paths, name="JsonlSource")
        self._paths = [storage.cached_copy(p, cache_dir=cache_dir) for p in self._names]
        self._field, self._feature = field, feature or field
        self._dtype = np.dtype(dtype)
        if self._dtype.kind not in "iu":
            raise ValueError(f"dtype={self._dtype} must be an integer dtype, e.g. np.int32")
        self._extra = tuple(extra_fields)
        self._index = []
        for local, name in zip(self._paths, self._names):
            with storage.named(local, name):
                self._index.append(jsonl.line_index(local))
        counts = [idx[0].size for idx in self._index]
        self._cum = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    def _get(self, index: int, f: int, j: int) -> dict[str, Any]:
        starts, ends, line_no = self._index[f]
        start, end = int(starts[j]), int(ends[j])
        fd = self._handle(f, lambda f: os.open(self._paths[f], os.O_RDONLY))
        raw = os.pread(fd, end - start, start)
        where = f"{self._names[f]}:{int(line_no[j])} (record {index})"
        record = jsonl.parse_line(raw, self._field, where)
        out = {self._feature: jsonl.tokens(record[self._field], self._field, where, self._dtype)}
        for key in self._extra:
            if key not in record:
                raise InputError(f"{where}: extra field {key!r} is missing")
            out[key] = np.asarray(record[key])
        return out

    def __del__(self):
        for fd in getattr(self, "_handles", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass


class ParquetSource(_FileSource):
    """Examples from Parquet files; element = {feature: int array, **extra columns}.

    paths:            one file or a list of files.
    column:           the list<int> column holding the token ids.
    feature:          the element key for them (default: `column`).
    extra_columns:    further columns copied into each element (numeric scalars or lists).
    cache_row_groups: how many decoded row groups to keep in memory.
    cache_dir:        where URL inputs are copied (see the module docstring).

    A row group is read on first access and kept (a few at a time); every element is a numpy
    view into its Arrow buffers.
    """

    def __init__(self, paths: Paths, *, column: str = "tokens", feature: str | None = None,
                 extra_columns: Sequence[str] = (), cache_row_groups: int = 4,
                 cache_dir: str | os.PathLike | None = None):
        super().__init__()
        self._names = as_path_list(paths, name="ParquetSource")
        self._paths = [storage.cached_copy(p, cache_dir=cache_dir) for p in self._names]
        self._feature = feature or column
        self._files = []
        for local, name in zip(self._paths, self._names):
            with storage.named(local, name):
                self._files.append(ParquetTokens(local, column, extra_columns=extra_columns))
        self._groups = [(f, g) for f, pf in enumerate(self._files)
                        for g in range(len(pf.group_rows))]
        flat = [r for pf in self._files for r in pf.group_rows]
        self._cum = np.concatenate([[0], np.cumsum(flat)]).astype(np.int64)  # per row group
        self._cache_size = max(1, int(cache_row_groups))
        self._cache: collections.OrderedDict = collections.OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_cache"] = collections.OrderedDict()
        return state

    def _load(self, k: int) -> tuple[np.ndarray, list[int], dict[str, Any]]:
        cached = self._cache.get(k)
        if cached is not None:
            self._cache.move_to_end(k)
            return cached
        f, g = self._groups[k]
        with storage.named(self._paths[f], self._names[f]):
            chunk = self._files[f].read_group(g)
        entry = (chunk.values, chunk.offsets.tolist(), chunk.extra)
        self._cache[k] = entry
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return entry

    def _get(self, index: int, k: int, j: int) -> dict[str, Any]:
        values, offsets, extra = self._load(k)
        out: dict[str, Any] = {self._feature: values[offsets[j] : offsets[j + 1]]}
        for name, col in extra.items():
            v = col[j]
            out[name] = np.asarray(v) if isinstance(v, (list, np.ndarray)) else v
        return out


class TokenArraySource(_FileSource):
    """Examples from token arrays (`formats.arrays`: Megatron .bin/.idx, .npz, 2-D .npy),
    memory-mapped; element = {feature: int array view, **aligned columns}.

    paths:           files (a Megatron dataset by its .bin, .idx or prefix) or URLs.
    input_format:    "megatron", "npz" or "npy" (default: from each name).
    column:          the .npz array of token ids; feature: the element key (default `column`).
    aligned_columns: .npz arrays beside the tokens, one value per token (labels, masks).
    """

    def __init__(self, paths: Paths, *, input_format: str | None = None, column: str = "tokens",
                 feature: str | None = None, aligned_columns: Sequence[str] = (),
                 cache_dir: str | os.PathLike | None = None):
        super().__init__()
        self._names = [megatron_prefix(p) for p in as_path_list(paths, name="TokenArraySource")]
        self._paths, self._feature, self._arrays = [], feature or column, []
        for name in self._names:
            fmt = input_format or format_by_name(name)
            if fmt not in ARRAYS:
                raise InputError(f"{name}: not a token array by its name (.bin/.idx, .npz, "
                                 ".npy); pass input_format=")
            pair = None
            if fmt == "megatron" and storage.is_url(name):
                pair = tuple(storage.cached_copy(p, cache_dir=cache_dir)
                             for p in megatron_pair(name))
            local = pair[0] if pair else storage.cached_copy(name, cache_dir=cache_dir)
            with storage.named(local, name):
                self._arrays.append(TokenArrays(local, fmt, column, aligned_columns, pair=pair))
            self._paths.append(local)
        self._cum = np.concatenate([[0], np.cumsum([a.num_records for a in self._arrays])]
                                   ).astype(np.int64)

    def _get(self, index: int, f: int, j: int) -> dict[str, Any]:
        (tokens, extra), = self._arrays[f].examples(np.array([j]))
        return {self._feature: tokens, **extra}


def shard_paths(paths: Any, *, packed: bool = False, cache_dir: str | os.PathLike | None = None
                ) -> tuple[list[str], list[str], Manifest | None]:
    """(local shard files, their names, the manifest if any) from a directory, one file or a
    list of files; URLs are copied into the cache (`storage.cached_copy`).

    A directory of packed rows (`packed`, or one holding a pack's intent file) needs its
    manifest: without one it is an interrupted `seqpack pack` run and is refused with the CLI's
    message; so is a manifest that does not match itself or its shards (`read_manifest`).
    """
    if isinstance(paths, str) and storage.is_url(paths) and not storage.exists(paths):
        return _remote_shards(paths.rstrip("/"), packed=packed, cache_dir=cache_dir)
    if isinstance(paths, (str, os.PathLike)) and os.path.isdir(paths):
        directory = os.fspath(paths)
        if packed or os.path.exists(os.path.join(directory, MANIFEST)) \
                or os.path.exists(os.path.join(directory, INTENT)):
            manifest = read_manifest(directory)  # InputError naming what is missing or wrong
            found = [os.path.join(directory, s) for s in manifest.shards]
            return found, found, manifest
        found = sorted(os.path.join(directory, n) for n in os.listdir(directory)
                       if n.endswith((".arrayrecord", ".array_record")))
        if not found:
            raise InputError(f"{directory}: no manifest.json and no *.arrayrecord files")
        return found, found, None
    names = as_path_list(paths, name="ArrayRecord source")
    for name in names:  # a shard of another format: its directory reads it (the manifest)
        if name.endswith((".parquet", ".index")):
            raise InputError(f"{name}: a {name.rsplit('.', 1)[1]} shard is read through its "
                             "output directory (its manifest says how): pass the directory")
    return [storage.cached_copy(p, cache_dir=cache_dir) for p in names], names, None


def _remote_shards(prefix: str, *, packed: bool, cache_dir: str | os.PathLike | None
                   ) -> tuple[list[str], list[str], Manifest | None]:
    """`shard_paths` for a URL prefix: the manifest read and checked remotely (`read_manifest`),
    each shard downloaded into the cache and checked against its size and sha256."""
    if packed or storage.exists(storage.join(prefix, MANIFEST)) \
            or storage.exists(storage.join(prefix, INTENT)):
        manifest = read_manifest(prefix)  # InputError naming what is missing or wrong
        names = [storage.join(prefix, s) for s in manifest.shards]
        local = [storage.cached_copy(url, cache_dir=cache_dir, expect=(size, sha))
                 for url, size, sha in zip(names, manifest.shard_bytes or [],
                                           manifest.shard_sha256 or [], strict=True)]
        return local, names, manifest
    names = sorted(storage.glob(storage.join(prefix, "*.arrayrecord"))
                   + storage.glob(storage.join(prefix, "*.array_record")))
    if not names:
        raise InputError(f"{prefix}: no manifest.json and no *.arrayrecord objects")
    return [storage.cached_copy(p, cache_dir=cache_dir) for p in names], names, None


class ArrayRecordSource(_FileSource):
    """SQP1 records from ArrayRecord files, decoded to name -> numpy array dicts.

    paths:     a directory (with or without manifest.json), a URL prefix, files or URLs.
    cache_dir: where URLs are copied (see the module docstring).
    """

    _packed = False

    def __init__(self, paths: Paths, *, cache_dir: str | os.PathLike | None = None):
        super().__init__()
        self._paths, self._names, self.manifest = shard_paths(paths, packed=self._packed,
                                                              cache_dir=cache_dir)
        # SQP1 records, or the rows of another encoding (`seqpack pack --format`) by its reader
        self._encoding = of_manifest(self.manifest) if self.manifest is not None \
            and self.manifest.encoding is not None else None
        if self._encoding is not None and cache_dir is not None:  # an index's input copies
            encoding, layout = self._encoding
            self._encoding = encoding, dataclasses.replace(layout, cache_dir=os.fspath(cache_dir))
        expected = self.manifest.shard_num_rows if self.manifest else None
        counts = []
        for f, (path, name) in enumerate(zip(self._paths, self._names)):
            with storage.named(path, name):
                reader = self._open(f)
                try:
                    counts.append(arrayrecord.num_records(reader, path,
                                                          expected[f] if expected else None)
                                  if self._encoding is None else reader.num_rows)
                finally:
                    self._close(reader)
                if self._encoding is not None and expected and counts[-1] != expected[f]:
                    raise InputError(f"{name}: holds {counts[-1]} rows, the manifest says "
                                     f"{expected[f]}; the shard is incomplete or replaced")
        self._cum = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    @property
    def paths(self) -> list[str]:
        return list(self._paths)

    def _open(self, f: int) -> Any:
        if self._encoding is None:
            return arrayrecord.open_reader(self._paths[f], "readahead_buffer_size:0")
        encoding, layout = self._encoding
        return encoding.reader(self._paths[f], layout)

    def _close(self, reader: Any) -> None:
        if self._encoding is None:
            arrayrecord.close_quietly(reader)
        else:
            reader.close()

    def _get(self, index: int, f: int, j: int) -> dict[str, Any]:
        path = self._names[f]  # errors name the URL of a cached copy
        reader = self._handle(f, self._open)
        if self._encoding is None:
            row = arrayrecord.decode(arrayrecord.read_raw(reader, path, [j])[0], path, j)
        else:
            with storage.named(self._paths[f], path):
                row = restore_derived(reader.row(j))
        try:
            self._check(row)
        except ValueError as e:
            raise InputError(f"{path} record {j}: {e}") from None
        return row

    def _check(self, row: dict[str, np.ndarray]) -> None:
        """Hook for subclasses: raise ValueError if a decoded record is malformed."""


class PackedArrayRecordSource(ArrayRecordSource):
    """Packed rows (contract keys of `feature`, `[L]` and `[S]` arrays) from a `seqpack pack`
    output of any `--format` (ArrayRecord shards; Parquet through the encoding's reader, one
    row group decoded and kept at a time), or from ArrayRecord shard files.

    feature:   the packed feature; defaults to the manifest's `feature`, else "tokens".
    cache_dir: where the shards of a URL prefix are copied (see the module docstring), and an
               index's URL inputs.

    Every stored array of a row is in the element (the manifest's `stored_keys`, plus the
    segment ids / positions rebuilt on read); `columns` names the extra columns packed with the
    feature (`Manifest.columns`: labels, masks), each checked to be `[L]`.
    """

    is_packed = True
    _packed = True

    def __init__(self, paths: Paths, *, feature: str | None = None,
                 cache_dir: str | os.PathLike | None = None):
        super().__init__(paths, cache_dir=cache_dir)
        m = self.manifest
        self.feature = feature or (m.feature if m else "tokens")
        self.seq_len = m.seq_len if m else None
        self.max_segments = m.max_segments if m else None
        self.columns = [str(c["name"]) for c in (m.columns or [])] if m else []
        if self._encoding is not None:  # the [L] columns its rows hold (TRL's labels, ...)
            encoding, layout = self._encoding
            contract = {*keys(self.feature).roles().values()}
            self.columns = [k for k in encoding.decoded_keys(layout) if k not in contract]

    @property
    def read_threads(self) -> int:
        """Rows the training pipeline should read at once in each process: more than one
        where each row waits on the store (an index reading its inputs by byte range:
        `encodings.read_threads`), else 0."""
        if self._encoding is None or self._encoding[1].inputs is None:
            return 0
        return read_threads(self._encoding[1].inputs)

    def _check(self, row: dict[str, np.ndarray]) -> None:
        k = keys(self.feature)
        missing = [name for name in (*k.per_token, *k.per_slot) if name not in row]
        if missing:
            raise ValueError(
                f"packed row lacks {missing} (has {sorted(row)}); is this a shard of packed rows "
                f"of feature {self.feature!r}? pass feature=..."
            )
        L = row[k.values].shape[0] if row[k.values].ndim else -1
        lengths = row[k.segment_lengths]
        S = lengths.shape[0] if lengths.ndim else -1
        for name in self.columns:
            if name not in row:
                raise ValueError(f"packed row lacks the column {name!r} its manifest lists")
        for name in (*k.per_token, *self.columns):
            if row[name].ndim != 1 or row[name].shape[0] != L:
                raise ValueError(f"packed row: {name} has shape {row[name].shape}, expected ({L},)")
        for name in (*k.per_slot, *[s for s in (k.source_index, k.source_start) if s in row]):
            if row[name].ndim != 1 or row[name].shape[0] != S:
                raise ValueError(f"packed row: {name} has shape {row[name].shape}, expected ({S},)")
        if self.seq_len is not None and L != self.seq_len:
            raise ValueError(f"packed row has L={L}, manifest says seq_len={self.seq_len}")
        if self.max_segments is not None and S != self.max_segments:
            raise ValueError(f"packed row has S={S}, manifest says {self.max_segments=}")


PackedSource = PackedArrayRecordSource  # the same reader, by a name that does not say a format
