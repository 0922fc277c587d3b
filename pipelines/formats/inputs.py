"""Reads raw inputs for the offline CLI into one ragged corpus (flat token ids + example offsets).

No grain, no jax: JSONL, Parquet, ArrayRecord (SQP1 records, see `pipelines.records`) and text
files are read straight into the Arrow list layout the packer takes. Every file also gets a
fingerprint for the manifest, so `verify` and `--resume` can tell whether an input changed.

Formats (``--input-format``, or picked from the file extension):

    jsonl        one JSON object per line, token ids in a field:  {"tokens": [101, 7592, 102]}
    parquet      a list<int> column, read with pyarrow into values + offsets (no per-token Python)
    arrayrecord  SQP1 records holding a 1-D integer array under the column name
    text         UTF-8 text; one example per file, line or paragraph (text_unit), tokenized
                 with a `tokenizers` tokenizer.json, or byte-tokenized (ids 0..255) without one

Fingerprint (documented contract, stored per input in manifest.json)::

    {"path": absolute path, "size": bytes,
     "sha256_head_tail": sha256(size as u64 LE + first MiB + last MiB)}

It is O(1) in the file size; `verify` still re-reads every token and compares it to the rows.

Every bad input raises `InputError` (a ValueError) with one line naming the file and the line
(JSONL, text) or record (Parquet, ArrayRecord).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import re
import sysconfig
from collections.abc import Sequence

import numpy as np

FORMATS = ("jsonl", "parquet", "arrayrecord", "text")
_EXTENSIONS = {
    ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet",
    ".arrayrecord": "arrayrecord", ".array_record": "arrayrecord",
}
_MIB = 1 << 20


class InputError(ValueError):
    """A bad input file: the message names the file and the line or record."""


TEXT_UNITS = ("file", "line", "paragraph")


@dataclasses.dataclass(frozen=True)
class ReadOptions:
    """How raw inputs are read; stored in the manifest so `verify` reads them the same way."""

    input_format: str | None = None  # None: from each file's extension
    column: str = "tokens"  # JSONL field / Parquet column / ArrayRecord array name
    tokenizer: str | None = None  # tokenizer.json for text; None: bytes are the tokens
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
    """{"path", "size", "sha256_head_tail"} of a file (see the module docstring)."""
    size = os.path.getsize(path)
    h = hashlib.sha256(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        h.update(f.read(_MIB))
        if size > _MIB:
            f.seek(max(_MIB, size - _MIB))
            h.update(f.read(_MIB))
    return {"path": os.path.abspath(path), "size": size, "sha256_head_tail": h.hexdigest()}


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
    tokenizer = _load_tokenizer(options.tokenizer) if options.tokenizer else None
    parts, files = [], []
    for path in paths:
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise InputError(f"{path}: no such file")
        fmt = detect_format(path, options.input_format)
        if fmt == "jsonl":
            values, offsets = read_jsonl(path, options.column)
        elif fmt == "parquet":
            values, offsets = read_parquet(path, options.column)
        elif fmt == "arrayrecord":
            values, offsets = read_arrayrecord(path, options.column)
        else:
            values, offsets = read_text(path, tokenizer, options.text_unit)
        info = fingerprint(path)
        info.update(format=fmt, num_examples=int(offsets.size - 1),
                    num_tokens=int(offsets[-1] - offsets[0]))
        parts.append((values, offsets))
        files.append(info)
    return Corpus(*_concat(parts), files)


def _concat(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    if len(parts) == 1 and parts[0][1][0] == 0:
        return parts[0]
    dtype = np.result_type(*[v.dtype for v, _ in parts])
    values = np.concatenate([v[o[0] : o[-1]] for v, o in parts]).astype(dtype, copy=False)
    lengths = np.concatenate([np.diff(o) for _, o in parts])
    offsets = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return values, offsets


def _as_tokens(arr: np.ndarray, where: str) -> np.ndarray:
    """Integer token ids, >= 0, in the smallest of the input dtype and int32 that holds them."""
    if arr.size == 0:
        return arr.astype(np.int32)
    if arr.dtype.kind == "i":
        lo = int(arr.min())
        if lo < 0:
            raise InputError(f"{where}: token id {lo} is negative; ids must be >= 0")
        if arr.dtype.itemsize > 4 and int(arr.max()) <= np.iinfo(np.int32).max:
            return arr.astype(np.int32)
    return arr


# -- JSONL ---------------------------------------------------------------------------------------


def read_jsonl(path: str, field: str) -> tuple[np.ndarray, np.ndarray]:
    """Token lists from one JSONL file: pyarrow's parser, or Python's to locate a bad line."""
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.json as pj
    except ImportError:
        return _read_jsonl_python(path, field)
    schema = pa.schema([(field, pa.list_(pa.int64()))])
    opts = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    try:
        col = pj.read_json(path, parse_options=opts).column(0).combine_chunks()
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return _read_jsonl_python(path, field)  # finds and names the bad line
    if col.null_count or (len(col.values) and pc.min(col.values).as_py() < 0):
        return _read_jsonl_python(path, field)
    values = _numpy_view(col.values)
    offsets = _numpy_view(col.offsets).astype(np.int64)
    return _as_tokens(values, path), offsets


def _read_jsonl_python(path: str, field: str) -> tuple[np.ndarray, np.ndarray]:
    seqs: list[list[int]] = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            seqs.append(_parse_line(raw, field, f"{path}:{line_no}"))
    lengths = np.fromiter((len(s) for s in seqs), np.int64, len(seqs))
    offsets = np.zeros(len(seqs) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.fromiter((t for s in seqs for t in s), np.int64, int(offsets[-1]))
    return _as_tokens(flat, path), offsets


def _parse_line(raw: bytes, field: str, where: str) -> list[int]:
    try:
        record = json.loads(raw)
    except ValueError as e:
        raise InputError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if field not in record:
        raise InputError(f"{where}: field {field!r} is missing (keys: {sorted(record)[:8]}); "
                         "pass --column naming the token list")
    value = record[field]
    if not isinstance(value, list):
        raise InputError(f"{where}: field {field!r} must be a list of token ids, "
                         f"got {type(value).__name__}")
    for k, t in enumerate(value):
        if type(t) is not int or not 0 <= t < 2**63:
            raise InputError(f"{where}: {field}[{k}]={t!r} is not a non-negative integer token id")
    return value


# -- Parquet -------------------------------------------------------------------------------------


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError("reading Parquet needs pyarrow: pip install 'seqpack[io]'") from None
    return pa, pq


def read_parquet(path: str, column: str) -> tuple[np.ndarray, np.ndarray]:
    """The list<int> column of one Parquet file as (values, offsets), through Arrow buffers."""
    pa, pq = _pyarrow()
    try:
        pf = pq.ParquetFile(path)  # not read_table: that loads pyarrow.dataset (and pandas)
        schema = pf.schema_arrow
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"{path}: not a readable Parquet file ({e})") from None
    if column not in schema.names:
        raise InputError(f"{path}: column {column!r} is missing (columns: {schema.names[:8]}); "
                         "pass --column naming the token list")
    t = schema.field(column).type
    is_list = pa.types.is_list(t) or pa.types.is_large_list(t)
    if not (is_list and pa.types.is_integer(t.value_type)):
        raise InputError(f"{path}: column {column!r} has type {t}; it must be a list of integer "
                         "token ids (list<int32> or list<int64>)")
    try:
        col = pf.read(columns=[column]).column(0)
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"{path}: cannot read column {column!r} ({e})") from None
    col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if col.null_count:
        i = int(np.argmax(col.is_null().to_numpy(zero_copy_only=False)))
        raise InputError(f"{path} record {i}: column {column!r} is null; "
                         "write an empty list for an empty example")
    offsets = _numpy_view(col.offsets).astype(np.int64)
    child = col.values
    if child.null_count:
        pos = int(np.argmax(child.is_null().to_numpy(zero_copy_only=False)))
        i = int(np.searchsorted(offsets, pos, side="right")) - 1
        raise InputError(f"{path} record {i}: a token id is null")
    return _as_tokens(_numpy_view(child), path), offsets


def _numpy_view(arr) -> np.ndarray:
    """A primitive integer Arrow array as a numpy view (Array.to_numpy would import pandas)."""
    dtype = np.dtype(str(arr.type))
    return np.frombuffer(arr.buffers()[1], dtype, len(arr) + arr.offset)[arr.offset :]


# -- ArrayRecord ---------------------------------------------------------------------------------


def read_arrayrecord(path: str, column: str) -> tuple[np.ndarray, np.ndarray]:
    """The 1-D integer array `column` of every SQP1 record in one ArrayRecord file."""
    from seqpack.pipelines.formats.records import decode_row

    reader = open_arrayrecord(path)
    try:
        raws = reader.read_all()
    except RuntimeError as e:
        raise InputError(f"{path}: corrupt ArrayRecord file ({first_line(e)})") from None
    finally:
        close_quietly(reader)
    seqs = []
    for i, raw in enumerate(raws):
        try:
            row = decode_row(raw)
        except ValueError as e:
            raise InputError(f"{path} record {i}: {e}") from None
        arr = row.get(column)
        if arr is None:
            raise InputError(f"{path} record {i}: array {column!r} is missing (has {sorted(row)}); "
                             "pass --column")
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise InputError(f"{path} record {i}: {column!r} is {arr.dtype}{list(arr.shape)}, "
                             "not a 1-D integer array of token ids")
        seqs.append(arr)
    lengths = np.fromiter((s.size for s in seqs), np.int64, len(seqs))
    offsets = np.zeros(len(seqs) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    dtype = np.result_type(*[s.dtype for s in seqs]) if seqs else np.int32
    values = np.concatenate(seqs).astype(dtype, copy=False) if seqs else np.zeros(0, np.int32)
    return _as_tokens(values, path), offsets


def open_arrayrecord(path: str):
    """An ArrayRecordReader for random access; InputError if it cannot be opened."""
    try:
        from array_record.python.array_record_module import ArrayRecordReader
    except ImportError:
        raise InputError("ArrayRecord files need array-record: pip install 'seqpack[io]'") from None
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such file")
    try:
        return ArrayRecordReader(path, "readahead_buffer_size:0,max_parallelism:0")
    except RuntimeError as e:
        raise InputError(f"{path}: corrupt ArrayRecord file ({first_line(e)})") from None


def close_quietly(reader) -> None:
    """Closes an ArrayRecordReader; a reader that hit a corrupt file raises again on close."""
    try:
        reader.close()
    except RuntimeError:
        pass


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else f"{type(e).__name__} with no message"


# -- Text ----------------------------------------------------------------------------------------


def _load_tokenizer(path: str):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        msg = "--tokenizer needs the tokenizers package: pip install tokenizers"
        raise InputError(msg) from None
    if not os.path.isfile(path):
        raise InputError(f"{path}: tokenizer file does not exist")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises its own Exception subclass
        raise InputError(f"{path}: not a readable tokenizer.json ({first_line(e)})") from None


def tokenizer_fingerprint(path: str | None) -> dict | None:
    return fingerprint(path) if path else None


_PARAGRAPH = re.compile(rb"(?:[^\n]*\S[^\n]*(?:\n|$))+")


def read_text(path: str, tokenizer, text_unit: str) -> tuple[np.ndarray, np.ndarray]:
    """One example per file, non-blank line or paragraph (lines between blank lines): tokenizer
    ids, or UTF-8 bytes as ids."""
    with open(path, "rb") as f:
        data = f.read()
    if text_unit == "line":
        numbered = [(k, line) for k, line in enumerate(data.split(b"\n"), 1) if line.strip()]
    elif text_unit == "paragraph":  # runs of non-blank lines, numbered by their first line
        numbered, line_no, pos = [], 1, 0
        for m in _PARAGRAPH.finditer(data):
            line_no += data.count(b"\n", pos, m.start())
            pos = m.start()
            numbered.append((line_no, m.group().rstrip(b"\n")))
    else:
        numbered = [(0, data)]
    chunks = [c for _, c in numbered]
    if tokenizer is None:
        lengths = np.fromiter((len(c) for c in chunks), np.int64, len(chunks))
        values = np.frombuffer(b"".join(chunks), np.uint8)
    else:
        texts = []
        for line_no, c in numbered:
            try:
                texts.append(c.decode("utf-8"))
            except UnicodeDecodeError as e:
                where = f"{path}:{line_no}" if line_no else path
                msg = f"{where}: not UTF-8 text ({e.reason} at byte {e.start})"
                raise InputError(msg) from None
        ids = [np.asarray(enc.ids, np.int64) for enc in tokenizer.encode_batch(texts)]
        lengths = np.fromiter((a.size for a in ids), np.int64, len(ids))
        values = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        values = _as_tokens(values, path)
    offsets = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return values, offsets
