"""Reads raw inputs for the offline CLI into one ragged corpus (flat token ids + example offsets).

No grain, no jax: each format's reader (`jsonl`, `parquet`, `arrayrecord`, `text` beside this
module, shared with the Grain sources) yields checked chunks in the Arrow list layout the packer
takes; `read_corpus` puts them back to back, `scan_file` streams one file chunk by chunk (its
lengths for the plan, its tokens to a sink), holding one chunk at a time. Every file also gets a
fingerprint for the manifest, so `verify` and `--resume` can tell whether an input changed.

Formats (``--input-format``, or picked from the file extension):

    jsonl        one JSON object per line, token ids in a field:  {"tokens": [101, 7592, 102]}
    parquet      a list<int> column, read with pyarrow into values + offsets (no per-token Python)
    arrayrecord  SQP1 records holding a 1-D integer array under the column name
    text         UTF-8 text; one example per file, line or paragraph (text_unit), tokenized
                 with a `tokenizers` tokenizer.json, or byte-tokenized (ids 0..255) without one

Fingerprint (documented contract, stored per input in manifest.json)::

    {"path": absolute path or URL, "size": bytes, "sha256": sha256 of the whole content}

Inputs may be URLs (gs://, s3://, any fsspec protocol; `pipelines.storage`): each is downloaded
to a local temporary file (one at a time per process, streamed in blocks, removed after it is
read) and read like a local file; its manifest entry keeps the URL as `path`, and the size and
sha256 of the object's bytes, so `verify` and `--resume` treat it like a file. Errors name the
URL, not the temporary file.

A file edited in place (same size, any byte) gets another fingerprint; `--resume` and `verify`
refuse it.

Every bad input raises `InputError` (a ValueError) with one line naming the file and the line
(JSONL, text) or record (Parquet, ArrayRecord).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import os
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from seqpack.pipelines import storage
from seqpack.pipelines.errors import InputError
from seqpack.pipelines.formats import arrayrecord, jsonl, parquet, text
from seqpack.pipelines.formats.chunks import Chunk, concat

__all__ = ["Corpus", "InputError", "ReadOptions", "fingerprint", "read_corpus", "sample_files"]

FORMATS = ("jsonl", "parquet", "arrayrecord", "text")
_EXTENSIONS = {
    ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet",
    ".arrayrecord": "arrayrecord", ".array_record": "arrayrecord",
}


TEXT_UNITS = ("file", "line", "paragraph")


@dataclasses.dataclass(frozen=True)
class ReadOptions:
    """How raw inputs are read; stored in the manifest so `verify` reads them the same way."""

    input_format: str | None = None  # None: from each file's extension
    column: str = "tokens"  # JSONL field / Parquet column / ArrayRecord array name
    tokenizer: str | None = None  # tokenizer.json for text files / JSONL fields / Parquet
    # columns of text (padding and truncation switched off); None: token ids, text as bytes
    text_unit: str = "file"  # text: one example per "file", "line" or "paragraph"

    def __post_init__(self) -> None:
        if self.input_format is not None and self.input_format not in FORMATS:
            raise InputError(f"input format {self.input_format!r} is not one of {FORMATS}")
        if self.text_unit not in TEXT_UNITS:
            raise InputError(f"text_unit={self.text_unit!r} must be one of {TEXT_UNITS}")


@dataclasses.dataclass(frozen=True)
class Corpus:
    """All examples back to back: example i is values[offsets[i]:offsets[i + 1]]."""

    values: np.ndarray  # X[N] non-negative token ids
    offsets: np.ndarray  # i64[n + 1]
    files: list[dict]  # per input: fingerprint + format, num_examples, num_tokens

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def fingerprint(path: str) -> dict:
    """{"path", "size", "sha256"} of a file or an object (see the module docstring)."""
    with local_input(path) as local:
        with open(local, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
            size = f.tell()
    return {"path": fingerprint_path(path), "size": size, "sha256": digest}


@contextlib.contextmanager
def local_input(path: str) -> Iterator[str]:
    """A local file to read `path` from: the path itself, or a URL's temporary download
    (removed on exit). InputError if it is missing; an InputError raised while reading the
    download names the URL, not the temporary file."""
    if not storage.is_url(path):
        if not os.path.isfile(path):
            raise InputError(f"{path}: no such file")
        yield path
        return
    with storage.local_copy(path) as local, storage.named(local, path):
        yield local


def detect_format(path: str, input_format: str | None) -> str:
    if input_format:
        return input_format
    return _EXTENSIONS.get(os.path.splitext(path)[1].lower(), "text")


def sample_files() -> list[str]:
    """The built-in sample corpus: the top-level .py files of Python's standard library."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))
    if not files:
        raise InputError(f"no .py files under {stdlib}: this Python has no stdlib sources")
    return files


def read_corpus(paths: Sequence[str], options: ReadOptions) -> Corpus:
    """Reads every input (in order) into one corpus; raises InputError naming the bad file."""
    if not paths:
        raise InputError("no input files given")
    tokenizer = text.load_tokenizer(options.tokenizer) if options.tokenizer else None
    parts, files = [], []
    for path in paths:
        path = os.fspath(path)
        fmt = detect_format(path, options.input_format)
        with local_input(path) as local:
            values, offsets = read_file(local, fmt, options, tokenizer)
            info = fingerprint(local)
        info["path"] = fingerprint_path(path)
        info.update(format=fmt, num_examples=int(offsets.size - 1),
                    num_tokens=int(offsets[-1] - offsets[0]),
                    lengths_sha256=lengths_sha256(np.diff(offsets)))
        parts.append((values, offsets))
        files.append(info)
    values, offsets = concat([Chunk(v, o, 0) for v, o in parts])
    return Corpus(values, offsets, files)


def file_chunks(path: str, fmt: str, options: ReadOptions, tokenizer: Any = None
                ) -> Iterator[Chunk]:
    """The checked chunks of one input file in format `fmt`."""
    if fmt == "jsonl":
        return jsonl.read_chunks(path, options.column, tokenizer)
    if fmt == "parquet":
        return parquet.ParquetTokens(path, options.column, tokenizer=tokenizer).chunks()
    if fmt == "arrayrecord":
        if tokenizer is not None:
            raise InputError(f"{path}: ArrayRecord records hold token ids; --tokenizer is for "
                             "text (text files, JSONL text fields, Parquet text columns)")
        return arrayrecord.example_chunks(path, options.column)
    return text.read_chunks(path, tokenizer, options.text_unit)


def read_file(path: str, fmt: str, options: ReadOptions, tokenizer: Any = None
              ) -> tuple[np.ndarray, np.ndarray]:
    """One input file as (values, offsets): its chunks back to back, ids `narrow`-ed."""
    values, offsets = concat(list(file_chunks(path, fmt, options, tokenizer)))
    return narrow(values), offsets


def narrow(values: np.ndarray) -> np.ndarray:
    """Token ids in the smallest of their dtype and int32 that holds them (ids are >= 0)."""
    top = int(values.max()) if values.size else 0
    return values.astype(narrow_dtype(values.dtype, values.size, top), copy=False)


def narrow_dtype(dtype: np.dtype, size: int, top: int) -> np.dtype:
    """`narrow`'s dtype for `size` ids of `dtype` whose largest is `top`."""
    dtype = np.dtype(dtype)
    if size == 0 or dtype.kind == "i" and dtype.itemsize > 4 and top <= np.iinfo(np.int32).max:
        return np.dtype(np.int32)
    return dtype


@dataclasses.dataclass(frozen=True)
class FileScan:
    """One input read chunk by chunk: what the plan and the manifest need from it."""

    info: dict  # fingerprint + format, num_examples, num_tokens, lengths_sha256 (manifest entry)
    lengths: np.ndarray  # i64[n_f] example lengths, in file order
    dtype: np.dtype  # the file's token dtype, as `read_file` gives it


def scan_file(path: str, fmt: str, options: ReadOptions, tokenizer: Any = None,
              sink: Callable[[np.ndarray], None] | None = None) -> FileScan:
    """Reads one input chunk by chunk: lengths, dtype and fingerprint; tokens go to `sink`.

    Holds one chunk at a time (a Parquet row group, a range of records, a JSONL or text file).
    A URL is read from a temporary local copy (see the module docstring).
    """
    with local_input(path) as local:
        scan = _scan_local(local, fmt, options, tokenizer, sink)
    scan.info["path"] = fingerprint_path(path)
    return scan


def fingerprint_path(path: str) -> str:
    """The `path` of an input's manifest entry: its absolute path, or its URL."""
    return path if storage.is_url(path) else os.path.abspath(path)


def _scan_local(path: str, fmt: str, options: ReadOptions, tokenizer: Any,
                sink: Callable[[np.ndarray], None] | None) -> FileScan:
    lengths, dtypes = [], []
    top = num_tokens = 0
    for chunk in file_chunks(path, fmt, options, tokenizer):
        tokens = chunk.tokens()
        lengths.append(np.diff(chunk.offsets))
        dtypes.append(chunk.values.dtype)
        if tokens.size:
            top = max(top, int(tokens.max()))
            num_tokens += tokens.size
            if sink is not None:
                sink(tokens)
    lens = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    dtype = np.result_type(*dtypes) if dtypes else np.dtype(np.int32)
    info = fingerprint(path)
    info.update(format=fmt, num_examples=int(lens.size), num_tokens=num_tokens,
                lengths_sha256=lengths_sha256(lens))
    return FileScan(info, lens.astype(np.int64, copy=False), narrow_dtype(dtype, num_tokens, top))


def lengths_sha256(lengths: np.ndarray) -> str:
    """sha256 of example lengths as little-endian int64: one input's entry in the manifest."""
    return hashlib.sha256(np.ascontiguousarray(lengths, "<i8").tobytes()).hexdigest()


def combined_lengths_sha256(files: Sequence[dict]) -> str:
    """The manifest's digest of every example length, from each input's `lengths_sha256` (in
    input order): computed input by input, so no step needs every length."""
    return hashlib.sha256("".join(f["lengths_sha256"] for f in files).encode()).hexdigest()


def read_lengths(paths: Sequence[str], options: ReadOptions) -> tuple[np.ndarray, list[dict]]:
    """Every input's example lengths back to back (i64), and each file's manifest entry; the
    tokens are read and dropped chunk by chunk (a dry run needs only the lengths)."""
    if not paths:
        raise InputError("no input files given")
    tokenizer = text.load_tokenizer(options.tokenizer) if options.tokenizer else None
    scans = [scan_file(os.fspath(p), detect_format(os.fspath(p), options.input_format), options,
                       tokenizer) for p in paths]
    return np.concatenate([s.lengths for s in scans]), [s.info for s in scans]


def corpus_dtype(dtypes: Sequence[np.dtype]) -> np.dtype:
    """The token dtype of inputs read back to back (as `read_corpus` makes it)."""
    return np.result_type(*dtypes) if dtypes else np.dtype(np.int32)


def tokenizer_fingerprint(path: str | None) -> dict | None:
    return fingerprint(path) if path else None
