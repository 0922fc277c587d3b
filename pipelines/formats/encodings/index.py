"""`--format index`: each shard holds its rows as references into the inputs, not their tokens.

A shard file (``.index``, a NumPy ``.npz``) is the shard's plan: every piece of every row as
(corpus example, start, length, row), the corpus being the inputs back to back in the
manifest's order, each column in the narrowest integer type that holds it; and the rows'
token dtype. The manifest lists every input with its fingerprint (size, sha256) and, for rows
by reference, its modification stamp. Reading resolves the references: the rows' plan is made
again from the table (`packer.order_pieces`, as the writer made it), each piece's tokens and
extra columns are read from its input at random (`InputReader`), and `shard_batch` assembles
the rows: bit for bit those `--format arrayrecord` stores for the same plan.

    table    example  start  length  row        (a 2-row shard of L = 8)
             0        0      5       0          input 0's example 0, tokens [0, 5)
             7        0      3       0
             3        8      2       1          the second piece of a split example
"""

from __future__ import annotations

import json
import os
import time
import zipfile
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from seqpack.packer import Counters, PackPlan, Strategy
from seqpack.packer.plan import order_pieces
from seqpack.pipelines import storage
from seqpack.pipelines.errors import InputError
from seqpack.pipelines.formats import arrays
from seqpack.pipelines.formats.detect import ARRAYS
from seqpack.pipelines.formats.encodings import groups
from seqpack.pipelines.formats.encodings.base import (
    Encoding,
    Layout,
    ShardReader,
    check_count,
    shard_batch,
)
from seqpack.pipelines.formats.paths import entry_files

RANDOM_ACCESS = ("parquet", "arrow", "arrayrecord", *ARRAYS)  # input formats read at random
_COLUMNS = ("example", "start", "length", "row")
RECHECK_S = 1.0  # seconds after its last check an open local input's stamp is checked again


def _narrow(values: np.ndarray) -> np.ndarray:
    values = np.asarray(values, np.int64)
    low, high = (int(values.min()), int(values.max())) if values.size else (0, 0)
    for dtype in (np.uint8, np.uint16, np.uint32, np.int32, np.int64):
        info = np.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return values.astype(dtype)
    return values


class IndexRows(Encoding):
    name, suffix, record_encoding = "index", ".index", "seqpack-index-1"
    by_reference = True

    def check(self, layout: Layout) -> None:
        if Strategy(layout.config.strategy) is Strategy.CONCAT_SPLIT:
            raise ValueError("format='index' stores rows by reference to whole examples' "
                             "pieces; strategy='concat_split' is written with the tokens")

    def writer_options(self, layout: Layout) -> str:
        return "npz,deflate"

    def stored_keys(self, layout: Layout) -> list[str]:
        return list(_COLUMNS)

    def decoded_keys(self, layout: Layout) -> list[str]:
        """What `read` gives: the rows `--format arrayrecord` stores (no segment ids or
        positions: readers rebuild them)."""
        k = layout.config.keys()
        return [n for n in k.roles().values() if n not in k.derived] + \
            layout.sources()[2:] + layout.names()

    def wants_derived(self, layout: Layout) -> bool:
        return False

    def write(self, path: str, batch: Mapping[str, np.ndarray], layout: Layout) -> None:
        raise ValueError("format='index' writes a shard's plan (write_refs), not its rows")

    def write_refs(self, path: str, p: PackPlan, layout: Layout, dtype: Any) -> None:
        """The shard of plan `p` (pieces in (row, example) order, `example` a corpus example)."""
        meta = {"num_rows": int(p.num_rows), "row_dtype": np.dtype(dtype).str}
        with open(path, "wb") as f:
            np.savez_compressed(f, example=_narrow(p.example), start=_narrow(p.start),
                                length=_narrow(p.length), row=_narrow(p.row),
                                meta=np.frombuffer(json.dumps(meta).encode(), np.uint8))

    def read(self, path: str, layout: Layout, num_rows: int | None = None
             ) -> dict[str, np.ndarray]:
        reader = _Reader(path, layout)
        check_count(path, reader.num_rows, num_rows)
        return reader.rows(np.arange(reader.num_rows), derived=False)

    def reader(self, path: str, layout: Layout) -> ShardReader:
        return _Reader(path, layout)


def read_plan(path: str, config: Any) -> tuple[PackPlan, np.dtype]:
    """(the shard's plan, its rows' token dtype) from an index shard file; InputError naming
    the file when it is not one."""
    try:
        with np.load(path) as z:
            cols = {name: z[name].astype(np.int64) for name in _COLUMNS}
            meta = json.loads(bytes(z["meta"]).decode())
    except (OSError, ValueError, KeyError, EOFError, NotImplementedError, zipfile.BadZipFile,
            zlib.error) as e:
        raise InputError(f"{path}: not a seqpack index shard ({e})") from None
    p = order_pieces(cols["example"], cols["start"], cols["length"], cols["row"],
                     int(meta["num_rows"]), Counters(), config)
    return p, np.dtype(meta["row_dtype"])


class _Reader(ShardReader):
    """Rows of one index shard, resolved against the run's inputs (`InputReader`)."""

    def __init__(self, path: str, layout: Layout):
        if layout.inputs is None:
            raise InputError(f"{path}: rows stored by reference need the manifest's inputs; "
                             "read the shard through its output directory")
        self.path, self.layout = path, layout
        self.plan, self.dtype = read_plan(path, layout.config)
        self.num_rows = self.plan.num_rows
        self.bounds = self.plan.row_slices()
        self.inputs = input_reader(layout.inputs, layout.cache_dir)

    def rows(self, rows: np.ndarray, *, derived: bool) -> dict[str, np.ndarray]:
        """Rows `rows` of the shard, as the writer assembled them."""
        p, bounds, layout = self.plan, self.bounds, self.layout
        sel = np.concatenate([np.zeros(0, np.int64),
                              *(np.arange(bounds[r], bounds[r + 1]) for r in rows)])
        counts = bounds[np.asarray(rows) + 1] - bounds[np.asarray(rows)]
        sub = PackPlan(p.example[sel], p.start[sel], p.length[sel],
                       np.repeat(np.arange(len(rows)), counts), p.slot[sel], p.offset[sel],
                       len(rows), Counters())
        L = layout.config.seq_len
        dst = sub.row * L + sub.offset
        values = np.full(len(rows) * L, layout.config.pad_id, self.dtype)
        columns = {c["name"]: np.full(len(rows) * L, int(c["pad"]), np.dtype(c["dtype"]))
                   for c in layout.columns}
        examples = self.inputs.examples(sub.example)
        for at, (tokens, extra), s, n in zip(dst.tolist(), examples, sub.start.tolist(),
                                             sub.length.tolist()):
            values[at:at + n] = tokens[s:s + n]
            for name, col in columns.items():
                col[at:at + n] = extra[name][s:s + n]
        return shard_batch(sub, layout, dtype=self.dtype, derived=derived,
                           values=values.reshape(len(rows), L),
                           columns={k: v.reshape(len(rows), L) for k, v in columns.items()})

    def row(self, j: int) -> dict[str, np.ndarray]:
        if not 0 <= j < self.num_rows:
            raise IndexError(f"{self.path}: row {j} of {self.num_rows}")
        return {k: v[0] for k, v in self.rows(np.array([j]), derived=True).items()}


# (id(inputs), cache_dir) -> (inputs, its reader)
_READERS: dict[tuple[int, str | None], tuple[Any, InputReader]] = {}


def input_reader(inputs: Mapping[str, Any], cache_dir: str | None = None) -> InputReader:
    """The one `InputReader` of a run's `inputs` record (and cache directory) in this process
    (every shard of an output reads through it: each input opened once)."""
    key = (id(inputs), cache_dir)
    held = _READERS.get(key)
    if held is None or held[0] is not inputs or held[1].pid != os.getpid():
        held = _READERS[key] = (inputs, InputReader(inputs, cache_dir))
    return held[1]


class InputReader:
    """Random access to a run's examples by corpus example (the manifest's `inputs` record:
    its files back to back). Every local input's size and modification stamp are checked
    against the manifest's when it is made, as it opens one, and at a read of one `RECHECK_S`
    after its last check (a stat): a changed input is refused, not read as other tokens.
    Parquet is read by row group, Arrow IPC by record batch (a few decoded ones kept),
    ArrayRecord by record, token arrays memory-mapped; a URL from a local copy (in `cache_dir`,
    default `storage.cache_root()`) or by byte range."""

    def __init__(self, inputs: Mapping[str, Any], cache_dir: str | None = None):
        self.files = list(inputs["files"])
        self.cache_dir = cache_dir
        options = inputs["read_options"]
        self.column = options["column"]
        self.extra = tuple(options.get("extra_columns") or ())
        counts = [int(f["num_examples"]) for f in self.files]
        self.cum = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        self._open: dict[int, Any] = {}
        self._checked: dict[int, float] = {}  # input -> when its stamp was last checked
        self.pid = os.getpid()
        for entry in self.files:
            if not storage.is_url(entry["path"]):
                check_stamp(entry)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_open"] = {}
        return state

    def examples(self, corpus: np.ndarray) -> list[tuple[np.ndarray, dict[str, np.ndarray]]]:
        """(tokens, extra column values) of each corpus example of `corpus` (i64[n]), read
        input by input (an input's records in one read)."""
        if self.pid != os.getpid():
            self._open, self.pid = {}, os.getpid()
        corpus = np.asarray(corpus, np.int64)
        files = np.searchsorted(self.cum, corpus, side="right") - 1
        out: list[Any] = [None] * corpus.size
        ranged: list[tuple[np.ndarray, arrays.RangedArrays, np.ndarray]] = []
        now = time.monotonic()
        for f in np.unique(files).tolist():
            at = np.flatnonzero(files == f)
            if f in self._checked and now - self._checked[f] >= RECHECK_S:  # rewritten since?
                check_stamp(self.files[f])  # (`_checked` holds the open local inputs)
                self._checked[f] = now
            source = self._open.get(f)
            if source is None:
                source = self._open[f] = _open_input(self.files[f], self.column, self.extra,
                                                     self.cache_dir)
                if not storage.is_url(self.files[f]["path"]):
                    self._checked[f] = now
            if isinstance(source, arrays.RangedArrays):  # fetched below, all inputs at once
                ranged.append((at, source, corpus[at] - int(self.cum[f])))
                continue
            for k, got in zip(at.tolist(), source.examples(corpus[at] - int(self.cum[f]))):
                out[k] = got
        for k, got in zip([k for at, _, _ in ranged for k in at.tolist()],
                          arrays.RangedArrays.fetch([(s, i) for _, s, i in ranged])):
            out[k] = got
        return out


def check_stamp(entry: Mapping[str, Any]) -> None:
    """InputError naming the input when it is gone or its size or modification stamp differ
    from the manifest's entry (and its companion's: a Megatron .bin's .idx)."""
    if "companion" in entry:
        check_stamp(entry["companion"])
    path = entry["path"]
    try:
        st = os.stat(path)
    except OSError:
        raise InputError(f"{path}: the input the rows refer to is gone; restore it, or pack "
                         "again") from None
    if st.st_size != int(entry["size"]) or ("mtime_ns" in entry
                                             and st.st_mtime_ns != int(entry["mtime_ns"])):
        raise InputError(f"{path}: changed since it was packed by reference (size or "
                         "modification time differ from the manifest's); its rows would be read "
                         "as other tokens: pack again, or restore the input (`seqpack verify` "
                         "checks its sha256)")


def _open_input(entry: Mapping[str, Any], column: str, extra: tuple[str, ...],
                cache_dir: str | None = None) -> Any:
    fmt, path = entry.get("format"), entry["path"]
    if fmt not in RANDOM_ACCESS:
        raise _not_random(path, fmt)
    pair = None
    if storage.is_url(path) and fmt in arrays.RANGED and _by_range(entry):
        return _ranged(entry, cache_dir)
    if storage.is_url(path):  # a local copy of the packed bytes (cached once)
        local = _cached(entry, cache_dir)
        if "companion" in entry:
            other = _cached(entry["companion"], cache_dir)
            pair = (local, other) if os.path.splitext(path)[1].lower() == ".bin" else \
                (other, local)
    else:
        check_stamp(entry)
        local = path
    with storage.named(local, path):
        if fmt == "arrayrecord":
            return groups.Records(local, column, extra)
        if fmt in ARRAYS:
            return arrays.TokenArrays(local, fmt, column, extra, pair=pair)
        return groups.Groups(local, fmt, column, extra, entry.get("sha256", ""))


ROW_THREADS = 16  # rows in flight per reading process when each waits on the store


def read_threads(inputs: Mapping[str, Any]) -> int:
    """How many rows a reading process should read at once (`Prefetch.read_threads`):
    `ROW_THREADS` when some input is read by byte range (each row waits on the store) and
    every other one is a local token array (mapped), else 0."""
    files = inputs["files"]
    ranged = [storage.is_url(f["path"]) and f.get("format") in arrays.RANGED and _by_range(f)
              for f in files]
    mapped = [not storage.is_url(f["path"]) and f.get("format") in ARRAYS for f in files]
    return ROW_THREADS if any(ranged) and all(r or m for r, m in zip(ranged, mapped)) else 0


def _by_range(entry: Mapping[str, Any]) -> bool:
    """Whether an object's examples are read by byte range (`SEQPACK_INDEX_REMOTE`: "copy",
    the default, or "ranges"): only with the versions its scan read, which vouch for the
    bytes."""
    mode = os.environ.get("SEQPACK_INDEX_REMOTE", "copy")
    if mode not in ("ranges", "copy"):
        raise InputError(f"SEQPACK_INDEX_REMOTE={mode!r} must be 'ranges' or 'copy'")
    return mode == "ranges" and all(e.get("version") for e in entry_files(entry))


def _ranged(entry: Mapping[str, Any], cache_dir: str | None) -> arrays.RangedArrays:
    """An object read by byte range once its version is the scan's (a Megatron `.idx` from a
    cached copy of its packed bytes); InputError naming an object that changed."""
    objects = entry_files(entry)
    for e in objects:
        now = storage.version(e["path"])
        if now != e["version"]:
            raise InputError(f"{e['path']}: changed since it was packed by reference (its "
                             f"version is {now!r}, the manifest's {e['version']!r}): pack "
                             "again, or restore the input")
    idx = next((_cached(e, cache_dir) for e in objects if e["path"].lower().endswith(".idx")),
               None)
    return arrays.RangedArrays(entry["path"], entry["format"], int(entry["size"]), idx)


def _cached(entry: Mapping[str, Any], cache_dir: str | None) -> str:
    """A cached local copy of the object of a manifest entry: the bytes its scan read (by size
    and sha256: a copy already cached is read even if the store now holds others), else
    InputError naming the object."""
    path = entry["path"]
    expect = (int(entry["size"]), entry["sha256"]) if entry.get("sha256") else None
    try:  # with the scan's sha256: a copy of those bytes, whatever the store holds now
        local = storage.cached_copy(path, cache_dir=cache_dir, expect=expect)
    except storage.Replaced:
        raise InputError(f"{path}: changed since it was packed by reference (its bytes are not "
                         "the manifest's size and sha256): pack again, or restore the input"
                         ) from None
    if os.path.getsize(local) != int(entry["size"]):
        raise InputError(f"{path}: changed since it was packed by reference (its size "
                         "differs from the manifest's): pack again, or restore the input")
    return local


def _not_random(path: str, fmt: Any) -> InputError:
    return InputError(f"{path}: a {fmt} input cannot be read at random; rows by reference need "
                      f"inputs in {list(RANDOM_ACCESS)}: pack it with format='arrayrecord'")
