"""Token arrays read memory-mapped: Megatron-LM's indexed datasets and NumPy files.

    megatron   ``x.bin`` (every sequence's tokens back to back) with ``x.idx`` (Megatron-LM's
               `MMapIndexedDataset` index: ``MMIDIDX\\0\\0``, version 1, the dtype code, the
               sequence and document counts, then each sequence's length (i32) and byte
               offset (i64) and the document indices); an example is a sequence. Either file,
               or the prefix both share, names the pair; the manifest fingerprints both.
    npz        the token ids as one 1-D array (`column`, "tokens" by default) with
               ``offsets`` (n + 1, from 0) or ``lengths`` (n) giving the examples (the layout
               of seqpack's benchmark corpora), and each extra column (labels, masks) as a
               1-D array as long as the tokens under its name. Arrays stored uncompressed
               (`np.savez`) are memory-mapped in place; compressed ones (`np.savez_compressed`)
               are read whole into memory.
    npy        a 2-D integer array [N, T]: N examples of T tokens each (fixed-length chunks).

Every example's tokens are a view of the mapping: scanning an input for its lengths touches
only the index (and one pass over the ids, for their range), and a row stored by reference
reads just its examples' bytes (`TokenArrays.examples`). Checked, with `InputError` naming the
file (and record): the index or the arrays are well formed and agree with each other, ids are
integers >= 0.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from seqpack.pipelines import storage
from seqpack.pipelines.errors import InputError
from seqpack.pipelines.formats.chunks import Chunk, check_aligned, record_of

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
# Megatron-LM's DType codes (megatron/core/datasets/indexed_dataset.py)
_MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                    6: np.float64, 7: np.float32, 8: np.uint16}
BATCH_ROWS = 4096  # records per chunk when a file is read in order


def megatron_pair(path: str) -> tuple[str, str]:
    """(``.bin``, ``.idx``) of a Megatron indexed dataset named by either file or its prefix."""
    stem, ext = os.path.splitext(path)
    if ext.lower() not in (".bin", ".idx"):
        stem = path
    return stem + ".bin", stem + ".idx"


def megatron_prefix(path: str) -> str:
    """The ``.bin`` of the local Megatron pair that `path` is the shared prefix of (``x`` for
    ``x.bin`` and ``x.idx``); any other path as it is."""
    if os.path.exists(path) or not all(os.path.isfile(p) for p in megatron_pair(path)):
        return path
    return megatron_pair(path)[0]


def companion(path: str) -> str:
    """The other file of the Megatron pair that ``.bin`` or ``.idx`` file `path` belongs to."""
    bin_path, idx_path = megatron_pair(path)
    return idx_path if os.path.splitext(path)[1].lower() == ".bin" else bin_path


def read_megatron_index(path: str) -> tuple[np.dtype, np.ndarray, np.ndarray]:
    """(token dtype, sequence lengths i64[n], byte offsets i64[n]) of a Megatron ``.idx``."""
    try:
        with open(path, "rb") as f:
            head = f.read(9 + 8 + 1 + 8 + 8)
    except OSError as e:
        raise InputError(f"{path}: cannot read the Megatron index ({e})") from None
    if len(head) < 34 or head[:9] != MEGATRON_MAGIC:
        raise InputError(f"{path}: not a Megatron-LM index (.idx starting with MMIDIDX); an "
                         "indexed dataset is a .bin with its .idx beside it")
    version, = struct.unpack("<Q", head[9:17])
    code = head[17]
    count, docs = struct.unpack("<QQ", head[18:34])
    if version != 1 or code not in _MEGATRON_DTYPES:
        raise InputError(f"{path}: Megatron index version {version}, dtype code {code}: only "
                         "version 1 with codes 1-8 is known")
    dtype = np.dtype(_MEGATRON_DTYPES[code])
    if dtype.kind == "f":
        raise InputError(f"{path}: the indexed dataset holds {dtype} values, not integer token "
                         "ids")
    need = 34 + count * 12 + docs * 8
    if os.path.getsize(path) < need:
        raise InputError(f"{path}: truncated Megatron index ({os.path.getsize(path)} bytes, "
                         f"{count} sequences need {need})")
    sizes = np.memmap(path, np.int32, "r", 34, (count,)) if count else np.zeros(0, np.int32)
    pointers = np.memmap(path, np.int64, "r", 34 + count * 4, (count,)) if count else \
        np.zeros(0, np.int64)
    return dtype, np.asarray(sizes, np.int64), np.asarray(pointers, np.int64)


def _npz_member(path: str, z: zipfile.ZipFile, name: str) -> np.ndarray:
    """Array `name` of an open ``.npz``: a read-only memory map where it is stored
    uncompressed, else read into memory."""
    info = z.getinfo(name + ".npy")
    if info.compress_type == zipfile.ZIP_STORED:
        with open(path, "rb") as f:
            f.seek(info.header_offset)
            local = f.read(30)
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            f.seek(info.header_offset + 30 + name_len + extra_len)
            version = np.lib.format.read_magic(f)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read_header(f)
            if dtype.hasobject or fortran and len(shape) > 1:
                raise InputError(f"{path}: array {name!r} is not a plain C-ordered array")
            at = f.tell()
        if not int(np.prod(shape)):
            return np.zeros(shape, dtype)
        return np.memmap(path, dtype, "r", at, shape)
    with z.open(info) as f:
        return np.lib.format.read_array(f, allow_pickle=False)


class TokenArrays:
    """One token-array input (see the module docstring): `values` and `offsets` (i64[n + 1])
    as in a `Chunk`, each aligned column's values in `aligned`."""

    def __init__(self, path: str, fmt: str, column: str = "tokens",
                 aligned_columns: Sequence[str] = (), *, pair: tuple[str, str] | None = None):
        """`pair`: a Megatron dataset's (.bin, .idx) where they are not side by side (local
        copies of objects)."""
        self.path, self.fmt, self.column, self.pair = path, fmt, column, pair
        self.aligned: dict[str, np.ndarray] = {}
        self.values: np.ndarray
        self.offsets: np.ndarray
        names = tuple(aligned_columns)
        if fmt == "megatron":
            self._megatron(names)
        elif fmt == "npz":
            self._npz(names)
        elif fmt == "npy":
            self._npy(names)
        else:
            raise ValueError(f"not a token-array format: {fmt!r}")
        if self.values.dtype.kind not in "iu":
            raise InputError(f"{self.path}: the token ids are {self.values.dtype}, not integers")
        # plain views of the mapping (the memmap stays their base): slicing a memmap subclass
        # costs more than reading a short example
        self.values = self.values.view(np.ndarray)
        self.aligned = {n: v.view(np.ndarray) for n, v in self.aligned.items()}

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "fmt": self.fmt, "column": self.column,
                "names": tuple(self.aligned), "pair": self.pair}

    def __setstate__(self, state: dict[str, Any]) -> None:  # mapped again where it lands
        self.__init__(state["path"], state["fmt"], state["column"],  # type: ignore[misc]
                      state["names"], pair=state["pair"])

    def _no_columns(self, names: tuple[str, ...], what: str) -> None:
        if names:
            raise InputError(f"{self.path}: {what} holds token ids only; extra columns "
                             f"{list(names)} need an .npz, Parquet, Arrow, JSONL or ArrayRecord "
                             "input")

    def _megatron(self, names: tuple[str, ...]) -> None:
        bin_path, idx_path = self.pair or megatron_pair(self.path)
        self._no_columns(names, "a Megatron indexed dataset")
        for p in (bin_path, idx_path):
            if not os.path.isfile(p):
                raise InputError(f"{self.path}: a Megatron indexed dataset needs {p} beside it "
                                 "(a .bin of other bytes: pass input_format='bytes')")
        dtype, sizes, pointers = read_megatron_index(idx_path)
        itemsize = dtype.itemsize
        offsets = np.zeros(sizes.size + 1, np.int64)
        np.cumsum(sizes, out=offsets[1:])
        if sizes.size and (sizes.min() < 0 or not np.array_equal(pointers, offsets[:-1] *
                                                                  itemsize)):
            bad = int(np.argmax((sizes < 0) | (pointers != offsets[:-1] * itemsize)))
            raise InputError(f"{idx_path} record {bad}: its length or byte offset does not "
                             "follow the sequences before it (sequences must lie back to back "
                             "in the .bin)")
        total = int(offsets[-1]) * itemsize
        if os.path.getsize(bin_path) != total:
            raise InputError(f"{bin_path}: {os.path.getsize(bin_path)} bytes, its index "
                             f"{idx_path} says {total}; the pair does not belong together")
        self.values = np.memmap(bin_path, dtype, "r") if total else np.zeros(0, dtype)
        self.offsets = offsets

    def _npz(self, names: tuple[str, ...]) -> None:
        try:
            with zipfile.ZipFile(self.path) as z:
                held = {n[:-4] for n in z.namelist() if n.endswith(".npy")}
                for need in (self.column, *names):
                    if need not in held:
                        raise InputError(f"{self.path}: no array {need!r} (arrays: "
                                         f"{sorted(held)[:8]}); pass column= naming the token "
                                         "ids")
                arrays = {n: _npz_member(self.path, z, n)
                          for n in (self.column, *names, "offsets", "lengths") if n in held}
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            raise InputError(f"{self.path}: not a readable .npz ({e})") from None
        values = arrays[self.column]
        if values.ndim != 1:
            raise InputError(f"{self.path}: {self.column!r} has shape {values.shape}; the "
                             "token ids are one 1-D array, with offsets or lengths")
        if "offsets" in arrays:
            offsets = np.asarray(arrays["offsets"], np.int64)
            if offsets.ndim != 1 or not offsets.size or offsets[0] != 0 or \
                    offsets[-1] != values.size or (np.diff(offsets) < 0).any():
                down = np.flatnonzero(np.diff(offsets) < 0) if offsets.ndim == 1 else \
                    np.zeros(0, np.int64)
                at = f" (record {down[0]}: offsets[{down[0] + 1}] = {offsets[down[0] + 1]} < " \
                     f"offsets[{down[0]}] = {offsets[down[0]]})" if len(down) else \
                     f" (they run from {offsets[0]} to {offsets[-1]})" if offsets.ndim == 1 \
                     and offsets.size else ""
                raise InputError(f"{self.path}: 'offsets' must run from 0 to the {values.size} "
                                 f"token ids, never decreasing{at}")
            if "lengths" in arrays and not np.array_equal(arrays["lengths"], np.diff(offsets)):
                raise InputError(f"{self.path}: holds both 'offsets' and 'lengths', and they "
                                 "disagree; keep the one that is right")
        elif "lengths" in arrays:
            lengths = np.asarray(arrays["lengths"], np.int64)
            if lengths.ndim != 1 or (lengths < 0).any() or lengths.sum() != values.size:
                raise InputError(f"{self.path}: 'lengths' must be >= 0 and add up to the "
                                 f"{values.size} token ids")
            offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        else:
            raise InputError(f"{self.path}: no 'offsets' (n + 1) or 'lengths' (n) array; one "
                             "says where each example's token ids are")
        for n in names:
            if arrays[n].ndim != 1 or arrays[n].dtype.kind not in "iu":
                raise InputError(f"{self.path}: extra column {n!r} must be a 1-D integer "
                                 f"array, one value per token (has {arrays[n].dtype}, "
                                 f"{arrays[n].shape})")
            if arrays[n].size != values.size:
                check_aligned(f"{self.path} (all records)", self.column, values.size, n,
                              arrays[n].size)
            self.aligned[n] = arrays[n]
        self.values, self.offsets = values, offsets

    def _npy(self, names: tuple[str, ...]) -> None:
        self._no_columns(names, "an .npy array")
        try:
            arr = np.load(self.path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise InputError(f"{self.path}: not a readable .npy ({e})") from None
        if arr.ndim != 2:
            raise InputError(f"{self.path}: shape {arr.shape}; an .npy input is [examples, "
                             "tokens] (2-D); save variable-length examples as an .npz of "
                             "tokens with offsets")
        n, t = arr.shape
        self.values = np.asarray(arr).reshape(-1) if arr.size else np.zeros(0, arr.dtype)
        self.offsets = np.arange(n + 1, dtype=np.int64) * t

    @property
    def num_records(self) -> int:
        return int(self.offsets.size - 1)

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def chunk(self, a: int, b: int) -> Chunk:
        """Records [a, b), checked (ids >= 0), as views of the mapping."""
        offsets = self.offsets[a : b + 1]
        lo, hi = int(offsets[0]), int(offsets[-1])
        values = self.values[lo:hi]
        if values.dtype.kind == "i" and hi > lo:
            neg = np.flatnonzero(values < 0)
            if neg.size:
                raise InputError(f"{self.path} record {a + record_of(offsets - lo, int(neg[0]))}"
                                 f": token id {int(values[neg[0]])} is negative; ids must be "
                                 ">= 0")
        return Chunk(values, offsets - lo, a,
                     extra_values={n: v[lo:hi] for n, v in self.aligned.items()})

    def chunks(self, batch_rows: int = BATCH_ROWS) -> Iterator[Chunk]:
        """Every record, in order, `batch_rows` at a time (at least one chunk), checked."""
        n = self.num_records
        for a in range(0, max(n, 1), batch_rows):
            yield self.chunk(a, min(a + batch_rows, n))

    def examples(self, index: np.ndarray) -> list[tuple[np.ndarray, dict[str, np.ndarray]]]:
        """(tokens, aligned columns) of each record of `index`, views of the mapping."""
        out = []
        for i in np.asarray(index, np.int64).tolist():
            a, b = int(self.offsets[i]), int(self.offsets[i + 1])
            out.append((self.values[a:b], {n: v[a:b] for n, v in self.aligned.items()}))
        return out


RANGED = ("megatron", "npy")  # token arrays an example of which is one byte range
_NPY_HEAD = 1 << 16  # bytes read for an .npy header (NumPy writes a few hundred)


class RangedArrays:
    """A Megatron ``.bin`` or a 2-D ``.npy`` object read by byte range: each example's bytes
    fetched on their own (`storage.read_ranges`, concurrently), no copy of the object; a
    Megatron ``.idx`` is read from `idx_local` (a local copy). `examples` as `TokenArrays`'."""

    def __init__(self, url: str, fmt: str, size: int, idx_local: str | None = None):
        """`size`: the bytes of the object `url` names (its manifest entry's; an .npy's header
        is read within them)."""
        self.url, self.fmt, self.size, self.idx_local = url, fmt, size, idx_local
        if fmt == "megatron":
            assert idx_local is not None
            self.dtype, sizes, self.starts = read_megatron_index(idx_local)
            self.stops = self.starts + sizes * self.dtype.itemsize
            self.url = megatron_pair(url)[0]
        elif fmt == "npy":
            self._npy_header()
        else:
            raise ValueError(f"not a token-array format read by range: {fmt!r}")

    def _npy_header(self) -> None:
        head = io.BytesIO(storage.read_ranges(self.url, [0], [min(self.size, _NPY_HEAD)])[0])
        fmt = np.lib.format
        try:
            read = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}.get(
                fmt.read_magic(head), fmt.read_array_header_2_0)
            shape, fortran, dtype = read(head)
        except ValueError as e:
            raise InputError(f"{self.url}: not a readable .npy ({e})") from None
        if len(shape) != 2 or fortran or dtype.kind not in "iu":
            raise InputError(f"{self.url}: a {dtype} array of shape {shape}"
                             f"{' in Fortran order' if fortran else ''}; an .npy input is "
                             "[examples, tokens] of integers in C order")
        row = shape[1] * dtype.itemsize
        self.dtype = dtype
        self.starts = head.tell() + np.arange(shape[0], dtype=np.int64) * row
        self.stops = self.starts + row

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "fmt": self.fmt, "size": self.size, "idx_local": self.idx_local}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    @property
    def num_records(self) -> int:
        return int(self.starts.size)

    def examples(self, index: np.ndarray) -> list[tuple[np.ndarray, dict[str, np.ndarray]]]:
        """(tokens, {}) of each record of `index`, every range fetched in one call."""
        return RangedArrays.fetch([(self, index)])

    @staticmethod
    def fetch(wanted: Sequence[tuple[RangedArrays, np.ndarray]]
              ) -> list[tuple[np.ndarray, dict[str, np.ndarray]]]:
        """(tokens, {}) of each record of each (input, records) pair, in order: every range of
        every input fetched in one call (a row's pieces wait on one round of requests)."""
        urls: list[str] = []
        starts: list[int] = []
        ends: list[int] = []
        sizes = []  # (input, bytes of each record asked)
        for src, index in wanted:
            index = np.asarray(index, np.int64)
            a, b = src.starts[index], src.stops[index]
            live = b > a  # an empty record asks for nothing
            urls += [src.url] * int(live.sum())
            starts += a[live].tolist()
            ends += b[live].tolist()
            sizes.append((src, (b - a).tolist()))
        blobs = iter(storage.read_ranges(urls, starts, ends))
        return [(np.frombuffer(next(blobs), src.dtype) if n else np.zeros(0, src.dtype), {})
                for src, ns in sizes for n in ns]
