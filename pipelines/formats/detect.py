"""Tells an input's format from its name, else from its first bytes; opens compressed streams.

Names (case-insensitive; a compression suffix ``.gz`` / ``.zst`` / ``.zstd`` is looked through)::

    .jsonl .ndjson .json          jsonl
    .parquet                      parquet
    .arrow                        arrow (Arrow IPC: HF datasets' save_to_disk shards)
    .arrayrecord .array_record    arrayrecord (also sharded: x.array_record-00000-of-00008)
    .npz / .npy                   npz / npy (token arrays, `formats.arrays`)
    .idx, .bin beside an .idx     megatron (Megatron-LM's indexed dataset: the pair)
    .txt                          text

Content, where the name does not say (first 64 bytes; a compressed file's decompressed head)::

    b"PAR1"                           parquet
    b"ARROW1", or ff ff ff ff first   arrow (the IPC file, or the stream format)
    the Riegeli file signature        arrayrecord
    b"PK\x03\x04" / b"\x93NUMPY"       npz (a zip of arrays) / npy
    b"MMIDIDX"                        megatron (its .idx)
    1f 8b (gzip), 28 b5 2f fd (zstd)  compressed: its decompressed head decides (JSONL or text)
    "{" first (after blanks)          jsonl
    UTF-8 text without NUL bytes      text
    anything else                     refused: InputError naming the file and --input-format

so nothing is packed as bytes by accident; ``bytes`` (an explicit input format) packs any file's
raw bytes. JSONL and text may be compressed (gzip from the standard library; zstd through
pyarrow, a core dependency), whatever their name; `open_stream` decompresses while
reading. Parquet and ArrayRecord need random access: compressed, they are refused.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import re
from collections.abc import Iterator
from typing import Any, Protocol

from seqpack.pipelines.errors import InputError, require

FORMATS = ("jsonl", "parquet", "arrow", "arrayrecord", "npz", "npy", "megatron", "text",
           "bytes")
ARRAYS = ("npz", "npy", "megatron")  # token arrays, memory-mapped (`formats.arrays`)
AUTO = "auto"  # a format that only the content can tell (a URL is sniffed after download)

_BY_EXTENSION = {
    ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet",
    ".arrow": "arrow",
    ".arrayrecord": "arrayrecord", ".array_record": "arrayrecord", ".txt": "text",
    ".npz": "npz", ".npy": "npy", ".idx": "megatron",
}
_COMPRESSED_EXTENSIONS = (".gz", ".zst", ".zstd")
_SHARDED = re.compile(r"(\.[a-z_]+)-\d+-of-\d+$")  # TFDS / Beam shard names
_PARQUET = b"PAR1"
_ARROW = (b"ARROW1", b"\xff\xff\xff\xff")  # an IPC file; a stream's first message
_RIEGELI = bytes.fromhex(  # the first 64 bytes of every Riegeli (ArrayRecord) file
    "83af70d10d884a3f00000000000000004000000000000000"
    "91bac23c9287e1a90000000000000000e19f13c0e9b1c372"
    "73000000000000000000000000000000")
_GZIP, _ZSTD = b"\x1f\x8b", b"\x28\xb5\x2f\xfd"
_NPZ, _NPY, _MEGATRON = b"PK\x03\x04", b"\x93NUMPY", b"MMIDIDX\x00\x00"


class Readable(Protocol):
    """What `open_stream` yields: a binary stream to read from."""

    def read(self, size: int = -1, /) -> bytes: ...


_HINT = ("pass input_format= (jsonl, parquet, arrow, arrayrecord, npz, npy, megatron, text; "
         "bytes packs its raw bytes)")


def format_by_name(path: str) -> str | None:
    """The format a file's name says (see the module docstring), or None."""
    name = os.path.basename(os.fspath(path).rstrip("/")).lower()
    for ext in _COMPRESSED_EXTENSIONS:
        if name.endswith(ext):
            name = name[: -len(ext)]
            break
    m = _SHARDED.search(name)
    ext = m.group(1) if m else os.path.splitext(name)[1]
    if ext == ".bin":  # a Megatron dataset's tokens only beside its index (local paths)
        local = "://" not in os.fspath(path)
        return "megatron" if local and os.path.isfile(os.path.splitext(path)[0] + ".idx") \
            else None
    return _BY_EXTENSION.get(ext)


def detect_format(path: str, input_format: str | None) -> str:
    """`input_format` if given, else the format the name says, else `AUTO` (`resolve_format`
    reads the content). Reads nothing: `path` may be a URL not yet downloaded."""
    return input_format or format_by_name(path) or AUTO


def resolve_format(path: str, fmt: str, *, name: str | None = None) -> str:
    """`fmt`, or for `AUTO` the format the content of local file `path` says; InputError
    naming `name` (default `path`) when it says none."""
    return sniff_format(path, name=name) if fmt == AUTO else fmt


def compression(head: bytes) -> str | None:
    """"gzip", "zstd" or None, from a file's first bytes."""
    if head.startswith(_GZIP):
        return "gzip"
    if head.startswith(_ZSTD):
        return "zstd"
    return None


def sniff_format(path: str, *, name: str | None = None) -> str:
    """The format the first bytes of local file `path` say (see the module docstring)."""
    name = name or path
    with open(path, "rb") as f:
        head = f.read(4096)
    kind = compression(head)
    if kind is not None:
        with open_stream(path) as stream:
            head = stream.read(4096)
    binary = {"Parquet": head.startswith(_PARQUET), "ArrayRecord": head.startswith(_RIEGELI),
              "Arrow": head.startswith(_ARROW), "npz": head.startswith(_NPZ),
              "npy": head.startswith(_NPY), "megatron": head.startswith(_MEGATRON)}
    for what, found in binary.items():
        if not found:
            continue
        if kind is not None:
            raise InputError(f"{name}: a {kind}-compressed {what} file; decompress it first "
                             f"({what} is read with random access)")
        return what.lower()
    if head.lstrip()[:1] == b"{":
        return "jsonl"
    if b"\0" not in head and _utf8_prefix(head):
        return "text"
    what = f"{kind}-compressed data" if kind else "content"
    bin_hint = " (a Megatron .bin: name its .idx, or pass input_format='megatron')" \
        if name.lower().endswith(".bin") else ""
    raise InputError(f"{name}: cannot tell the input format from the name or the {what} (not "
                     f"Parquet, Arrow, ArrayRecord, NumPy, a Megatron index, JSONL or UTF-8 "
                     f"text){bin_hint}; {_HINT}")


def _utf8_prefix(head: bytes) -> bool:
    """Whether `head` is UTF-8, except perhaps for a character cut at its end."""
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start >= len(head) - 3 and e.reason == "unexpected end of data"
    return True


@contextlib.contextmanager
def open_stream(path: str) -> Iterator[Readable]:
    """A binary stream of a local file's bytes, decompressed when they are gzip or zstd."""
    with open(path, "rb") as raw:
        kind = compression(raw.read(4))
        raw.seek(0)
        if kind is None:
            yield raw
        elif kind == "gzip":
            with gzip.GzipFile(fileobj=raw, mode="rb") as stream:
                yield _Checked(stream, path)
        else:
            pa = require("pyarrow", "reading zstd-compressed inputs")
            with pa.CompressedInputStream(pa.PythonFile(raw, mode="r"), "zstd") as stream:
                yield _Checked(stream, path)


class _Checked:
    """A decompressing stream whose corrupt or truncated data raises InputError naming it."""

    def __init__(self, stream: Any, path: str):
        self._stream, self._path = stream, path

    def read(self, size: int = -1) -> bytes:
        try:
            return bytes(self._stream.read(size))
        except (OSError, EOFError, ValueError) as e:  # gzip.BadGzipFile, ArrowInvalid
            raise InputError(f"{self._path}: corrupt compressed data ({e})") from None
