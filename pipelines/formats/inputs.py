"""Reads raw inputs for the offline CLI into one ragged corpus (flat token ids + example offsets).

No grain, no jax: each format's reader (`jsonl`, `parquet`, `arrayrecord`, `text` beside this
module, shared with the Grain sources) yields checked chunks in the Arrow list layout the packer
takes; `read_corpus` puts them back to back, `scan_file` streams one file chunk by chunk (its
lengths for the plan, its tokens to a sink), holding one chunk at a time. Every file also gets a
fingerprint for the manifest, so `verify` and `--resume` can tell whether an input changed.

Formats (``--input-format``, else told by the file's name, else by its content; anything
else is refused, see `detect`):

    jsonl        one JSON object per line, token ids in a field:  {"tokens": [101, 7592, 102]}
                 (gzip or zstd compressed too, streamed)
    parquet      a list<int> column, read with pyarrow into values + offsets (no per-token Python)
    arrow        the same in Arrow IPC files or streams: HF `datasets`' ``*.arrow`` (a
                 `save_to_disk` directory reads as its shards, in its state.json order)
    arrayrecord  SQP1 records holding a 1-D integer array under the column name
    text         UTF-8 text; one example per file, line or paragraph (text_unit), tokenized
                 with a `tokenizers` tokenizer.json, or byte-tokenized (ids 0..255) without one;
                 text that is not UTF-8 is refused
    bytes        any file's raw bytes as ids 0..255, split like text (asked for explicitly)

Extra columns (`ReadOptions.extra_columns`: labels, masks) are read with the token column from
JSONL fields, Parquet columns and SQP1 arrays: one value per token of the record (a record whose
columns differ in length is refused), any integers, each column in its own dtype (JSONL: the
narrowest of int32 / int64 that holds the file's values; Parquet and ArrayRecord: as stored).
The token column alone defines the example lengths and is checked as token ids (>= 0).

Inputs as users hold them (`expand_inputs`): files, directories (their files of a known format
by name, sorted), local globs and URL globs; a file given twice is refused.

Fingerprint (documented contract, stored per input in manifest.json)::

    {"path": absolute path or URL, "size": bytes, "sha256": sha256 of the whole content}

A scan also notes a local input's modification stamp (``mtime_ns``) and an object's version
(``version``: generation, ETag, ...) as read (an input that changes while it is read is
refused); only a manifest of rows stored by reference keeps them.

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

import dataclasses
import glob
import os
import sysconfig
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from seqpack.packer.inputs import common_id_dtype
from seqpack.packer.mixing import carries_loss
from seqpack.pipelines import storage
from seqpack.pipelines.errors import InputError
from seqpack.pipelines.formats import arrayrecord, arrays, jsonl, parquet, text
from seqpack.pipelines.formats.chunks import Chunk
from seqpack.pipelines.formats.detect import (
    ARRAYS,
    FORMATS,
    detect_format,
    format_by_name,
    resolve_format,
)
from seqpack.pipelines.formats.paths import (
    check_text_beside_tokens,
    combined_lengths_sha256,
    entry_files,
    expand_inputs,
    file_stamp,
    fingerprint,
    fingerprint_path,
    lengths_sha256,
    local_input,
    unstamped,
)

__all__ = ["Corpus", "FileScan", "InputError", "LossCount", "ReadOptions",
           "check_text_beside_tokens", "combined_lengths_sha256", "detect_format",
           "expand_inputs", "fingerprint", "fingerprint_path", "lengths_sha256", "local_input",
           "read_corpus", "sample_files", "scan_file", "unstamped"]

TEXT_UNITS = ("file", "line", "paragraph")
Sink = Callable[[np.ndarray], None]  # receives a chunk's values back to back
_INT32, _INT64 = np.iinfo(np.int32), np.iinfo(np.int64)


@dataclasses.dataclass(frozen=True)
class ReadOptions:
    """How raw inputs are read; stored in the manifest so `verify` reads them the same way."""

    input_format: str | None = None  # None: from each file's name, else its content
    column: str = "tokens"  # JSONL field / Parquet column / ArrayRecord array name
    tokenizer: str | None = None  # tokenizer.json for text files / JSONL fields / Parquet
    # columns of text (padding and truncation switched off); None: token ids, text as bytes
    text_unit: str = "file"  # text: one example per "file", "line" or "paragraph"
    # further columns read with `column`, one integer per token (labels, masks; any sign)
    extra_columns: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.input_format is not None and self.input_format not in FORMATS:
            raise InputError(f"input format {self.input_format!r} is not one of {FORMATS}")
        if self.text_unit not in TEXT_UNITS:
            raise InputError(f"text_unit={self.text_unit!r} must be one of {TEXT_UNITS}")
        extra = (self.extra_columns,) if isinstance(self.extra_columns, str) else \
            self.extra_columns
        object.__setattr__(self, "extra_columns", tuple(extra))  # a manifest's JSON list
        names = (self.column, *self.extra_columns)
        if not all(isinstance(n, str) and n for n in names) or len(set(names)) < len(names):
            raise InputError(f"columns {list(names)} must be distinct non-empty names (the "
                             "first is the token column)")
        if self.extra_columns and self.tokenizer:
            raise InputError(f"extra columns {list(self.extra_columns)} cannot be read with "
                             "tokenizer= (tokenized lengths would not match them): pack token "
                             "ids with their columns, or the token column alone")
        if self.extra_columns and self.input_format in ("text", "bytes"):
            raise InputError(f"input_format={self.input_format!r} has one column; extra "
                             f"columns {list(self.extra_columns)} need JSONL, Parquet, Arrow or "
                             "ArrayRecord inputs")
        if self.input_format == "bytes" and self.tokenizer:
            raise InputError("input_format='bytes' packs raw bytes; drop tokenizer=, or read "
                             "the files as text")
        if self.tokenizer:  # as the manifest records it: verify and resume run elsewhere
            object.__setattr__(self, "tokenizer", os.path.abspath(self.tokenizer))


@dataclasses.dataclass(frozen=True)
class Corpus:
    """All examples back to back: example i is values[offsets[i]:offsets[i + 1]]."""

    values: np.ndarray  # X[N] non-negative token ids
    offsets: np.ndarray  # i64[n + 1]
    files: list[dict]  # per input: fingerprint + format, num_examples, num_tokens
    extra_values: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # name -> Y[N]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def sample_files() -> list[str]:
    """The built-in sample corpus: the top-level .py files of Python's standard library."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))
    if not files:
        raise InputError(f"no .py files under {stdlib}: this Python has no stdlib sources")
    return files


def read_corpus(paths: Sequence[str], options: ReadOptions) -> Corpus:
    """Reads every input (in order) into one corpus, every column; raises InputError naming
    the bad file."""
    if not paths:
        raise InputError("no input files given")
    tokenizer = text.load_tokenizer(options.tokenizer) if options.tokenizer else None
    scans, parts = [], []
    for path in paths:
        path = os.fspath(path)
        tokens: list[np.ndarray] = []
        cols: dict[str, list[np.ndarray]] = {name: [] for name in options.extra_columns}
        scans.append(scan_file(path, detect_format(path, options.input_format), options,
                               tokenizer, tokens.append,
                               column_sinks={n: c.append for n, c in cols.items()}))
        parts.append((tokens, cols))
    check_text_beside_tokens([(s.info["path"], s.info["format"]) for s in scans],
                             tokenized=bool(options.tokenizer))
    dtype = corpus_dtype([s.dtype for s in scans])
    values = _joined([t for tokens, _ in parts for t in tokens], dtype)
    extra = {name: _joined([v for _, cols in parts for v in cols[name]], col_dtype)
             for name, col_dtype in extra_corpus_dtypes(scans).items()}
    offsets = np.zeros(sum(s.lengths.size for s in scans) + 1, np.int64)
    np.cumsum(np.concatenate([s.lengths for s in scans]), out=offsets[1:])
    return Corpus(values, offsets, [s.info for s in scans], extra)


def _joined(parts: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    """Arrays back to back in `dtype` (each cast first: no float promotion); values fit."""
    if len(parts) == 1 and parts[0].dtype == dtype:
        return parts[0]
    return np.concatenate([np.zeros(0, dtype)] + [p.astype(dtype, copy=False) for p in parts])


def file_chunks(path: str, fmt: str, options: ReadOptions, tokenizer: Any = None
                ) -> Iterator[Chunk]:
    """The checked chunks of local input file `path` in format `fmt` (`detect.AUTO`: told by
    its content), with `options.extra_columns` as `Chunk.extra_values`."""
    fmt = resolve_format(path, fmt)
    extra = options.extra_columns
    if fmt == "jsonl":
        return jsonl.read_chunks(path, options.column, tokenizer, aligned_columns=extra)
    if fmt in ("parquet", "arrow"):
        reader = parquet.ParquetTokens if fmt == "parquet" else parquet.ArrowTokens
        return reader(path, options.column, tokenizer=tokenizer, aligned_columns=extra).chunks()
    if fmt == "arrayrecord":
        if tokenizer is not None:
            raise InputError(f"{path}: ArrayRecord records hold token ids; tokenizer= is for "
                             "text (text files, JSONL text fields, Parquet text columns)")
        return arrayrecord.example_chunks(path, options.column, aligned_columns=extra)
    if fmt in ARRAYS:
        if tokenizer is not None:
            raise InputError(f"{path}: a {fmt} input holds token ids; tokenizer= is for text")
        return arrays.TokenArrays(path, fmt, options.column, extra).chunks()
    if extra:
        raise InputError(f"{path}: a {fmt} input has one column; extra columns {list(extra)} "
                         "need JSONL, Parquet, Arrow or ArrayRecord inputs")
    return text.read_chunks(path, tokenizer, options.text_unit, raw=fmt == "bytes")


def read_file(path: str, fmt: str, options: ReadOptions, tokenizer: Any = None
              ) -> tuple[np.ndarray, np.ndarray]:
    """One local input file as (values, offsets): its chunks back to back, ids `narrow`-ed."""
    tokens: list[np.ndarray] = []
    lengths, dtype, _, _ = _consume(file_chunks(path, fmt, options, tokenizer), fmt, options,
                                 tokens.append, {})
    offsets = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return _joined(tokens, dtype), offsets


def narrow(values: np.ndarray) -> np.ndarray:
    """Token ids in the smallest of their dtype and int32 that holds them (ids are >= 0)."""
    top = int(values.max()) if values.size else 0
    return values.astype(narrow_dtype(values.dtype, values.size, top), copy=False)


def narrow_dtype(dtype: np.dtype, size: int, top: int) -> np.dtype:
    """`narrow`'s dtype for `size` ids of `dtype` whose largest is `top`."""
    dtype = np.dtype(dtype)
    if size == 0 or dtype.kind == "i" and dtype.itemsize > 4 and top <= _INT32.max:
        return np.dtype(np.int32)
    return dtype


@dataclasses.dataclass(frozen=True)
class FileScan:
    """One input read chunk by chunk: what the plan and the manifest need from it."""

    info: dict  # fingerprint + format, num_examples, num_tokens, lengths_sha256 (manifest entry)
    lengths: np.ndarray  # i64[n_f] example lengths, in file order
    dtype: np.dtype  # the file's token dtype, as `read_file` gives it
    # per extra column: its dtype in this file, and (min, max) of its values ((0, 0): none)
    extra_dtypes: dict[str, np.dtype] = dataclasses.field(default_factory=dict)
    extra_ranges: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    # i64[n_f]: each example's loss tokens, when asked for (`scan_file(loss_columns=)`)
    loss_counts: np.ndarray | None = None
    top: int = 0  # its largest token id


@dataclasses.dataclass(frozen=True)
class LossCount:
    """What a scan counts as an example's loss tokens: positions where no labels column
    (`roles`: extra column -> "labels" or "mask") holds -100 and no mask column 0, among its
    first `limit` tokens (None: all; a run that truncates keeps only those)."""

    roles: Mapping[str, str]
    limit: int | None = None


def scan_file(path: str, fmt: str, options: ReadOptions, tokenizer: Any = None,
              sink: Sink | None = None, *, column_sinks: Mapping[str, Sink] | None = None,
              loss_columns: LossCount | None = None,
              chunk_sink: Callable[[Chunk], None] | None = None) -> FileScan:
    """Reads one input chunk by chunk: lengths, dtypes and fingerprint; tokens go to `sink`.

    `column_sinks` (one per `options.extra_columns`, or None to check and drop them): each
    extra column's values go to its own sink, called right after `sink` for the same chunk
    with as many values as tokens (so the k-th calls of all sinks cover the same tokens).
    Values arrive in the chunk's dtype (tokens: any integer dtype, >= 0; JSONL extras: int64);
    the file's dtypes are the scan's. Holds one chunk at a time (a Parquet batch, a range of
    records, a block of JSONL lines, a text file). A URL is read from a temporary local copy
    (see the module docstring). `loss_columns` (extra column -> "labels" or "mask"): also
    count each example's loss tokens, the positions where no labels column holds -100 and no
    mask column 0 (`FileScan.loss_counts`; a mixture's `loss_tokens` unit). `chunk_sink`: each
    chunk whole, as read (its records' offsets too).
    """
    if column_sinks is not None and set(column_sinks) != set(options.extra_columns):
        raise ValueError(f"column_sinks={sorted(column_sinks)} must have one sink per extra "
                         f"column {list(options.extra_columns)}")
    remote = storage.is_url(path)
    if remote:  # the objects' versions as read (rows by reference check them)
        urls = [path, arrays.companion(path)] if (fmt or format_by_name(path)) == "megatron" \
            else [path]
        versions = [storage.version(u) for u in urls]
    with local_input(path, fmt) as local:
        fmt = resolve_format(local, fmt, name=path)
        locals_ = [f for f in ([local, arrays.companion(local)] if fmt == "megatron" else
                               [local]) if os.path.isfile(f)]  # a missing .idx: named below
        stamps = None if remote else [file_stamp(f) for f in locals_]
        counts: list[np.ndarray] | None = None if loss_columns is None else []
        chunks = file_chunks(local, fmt, options, tokenizer)
        if counts is not None:
            assert loss_columns is not None
            chunks = _counting(chunks, loss_columns, counts)
        lens, dtype, extra, top = _consume(chunks, fmt, options, sink, column_sinks or {},
                                           chunk_sink)
        info = fingerprint(local)
        if fmt == "megatron":  # the pair's other file, named as the input names it
            info["companion"] = {**fingerprint(arrays.companion(local)),
                                 "path": fingerprint_path(arrays.companion(path))}
        if stamps is not None:  # a local file: its stamp as read (rows by reference check it)
            if [file_stamp(f) for f in locals_] != stamps:
                raise InputError(f"{path}: changed while it was read; rerun on inputs that "
                                 "stay put")
            for entry, (_, mtime_ns) in zip(entry_files(info), stamps):
                entry["mtime_ns"] = mtime_ns
    if remote:
        if [storage.version(u) for u in urls] != versions:
            raise InputError(f"{path}: changed while it was read; rerun on inputs that stay put")
        for entry, tag in zip(entry_files(info), versions):
            entry["version"] = tag
    info["path"] = fingerprint_path(path)
    info.update(format=fmt, num_examples=int(lens.size), num_tokens=int(lens.sum()),
                lengths_sha256=lengths_sha256(lens))
    loss = None if counts is None else np.concatenate([np.zeros(0, np.int64), *counts])
    return FileScan(info, lens, dtype, {n: d for n, (d, _) in extra.items()},
                    {n: r for n, (_, r) in extra.items()}, loss, top)


def first_id_above(path: str, fmt: str, options: ReadOptions, limit: int) -> int:
    """The first example of input `path` holding a token id above `limit` (-1: none): read
    again only to name it in an error."""
    with local_input(path, fmt) as local:
        seen = 0
        for chunk in file_chunks(local, fmt, options):
            over = np.flatnonzero(chunk.tokens() > limit)
            if over.size:
                at = int(chunk.offsets[0]) + int(over[0])
                return seen + int(np.searchsorted(chunk.offsets, at, side="right")) - 1
            seen += chunk.offsets.size - 1
    return -1


def _counting(chunks: Iterator[Chunk], count: LossCount, out: list[np.ndarray]
              ) -> Iterator[Chunk]:
    """The chunks, as they pass: each record's loss tokens appended to `out`."""
    for chunk in chunks:
        sizes = np.diff(chunk.offsets)
        allowed = carries_loss(((chunk.column(n), r) for n, r in count.roles.items()),
                               int(sizes.sum()))
        starts = np.cumsum(sizes) - sizes
        kept = sizes if count.limit is None else np.minimum(sizes, count.limit)
        total = np.concatenate(([0], np.cumsum(allowed, dtype=np.int64)))
        out.append(total[starts + kept] - total[starts])
        yield chunk


def _consume(chunks: Iterator[Chunk], fmt: str, options: ReadOptions, sink: Sink | None,
             column_sinks: Mapping[str, Sink], chunk_sink: Callable[[Chunk], None] | None = None
             ) -> tuple[np.ndarray, np.dtype, dict[str, tuple[np.dtype, tuple[int, int]]], int]:
    """Feeds a file's chunks to the sinks: (lengths i64[n], token dtype, per extra column
    (dtype, (min, max)), the largest token id)."""
    names = options.extra_columns
    lengths, dtypes = [], []
    col_dtypes: dict[str, list[np.dtype]] = {n: [] for n in names}
    ranges: dict[str, tuple[int, int]] = {}
    top = num_tokens = 0
    for chunk in chunks:
        tokens = chunk.tokens()
        lengths.append(np.diff(chunk.offsets))
        dtypes.append(chunk.values.dtype)
        for n in names:
            col_dtypes[n].append(chunk.extra_values[n].dtype)
        if chunk_sink is not None:
            chunk_sink(chunk)
        if not tokens.size:
            continue
        top = max(top, int(tokens.max()))
        num_tokens += tokens.size
        if sink is not None:
            sink(tokens)
        for n in names:
            values = chunk.column(n)
            v_lo, v_hi = int(values.min()), int(values.max())
            lo, hi = ranges.get(n, (v_lo, v_hi))
            ranges[n] = (min(lo, v_lo), max(hi, v_hi))
            if n in column_sinks:
                column_sinks[n](values)
    lens = np.concatenate(lengths).astype(np.int64, copy=False) if lengths else \
        np.zeros(0, np.int64)
    dtype = narrow_dtype(corpus_dtype(dtypes), num_tokens, top)
    extra = {n: (column_dtype(col_dtypes[n], ranges.get(n, (0, 0)), narrow=fmt == "jsonl",
                              name=n), ranges.get(n, (0, 0))) for n in names}
    return lens, dtype, extra, top


def column_dtype(dtypes: Sequence[np.dtype], value_range: tuple[int, int], *, narrow: bool,
                 name: str) -> np.dtype:
    """The dtype of an extra column whose parts have `dtypes` and values in `value_range`:
    with `narrow` (JSONL) int32 if it holds them, else int64; otherwise numpy's promotion of
    `dtypes`, where uint64 with signed parts (numpy: float64) gives int64 if the values fit."""
    lo, hi = value_range
    if narrow or not dtypes:
        return np.dtype(np.int32 if _INT32.min <= lo and hi <= _INT32.max else np.int64)
    dtype = np.result_type(*dtypes)
    if dtype.kind != "f":
        return dtype
    if hi <= _INT64.max:
        return np.dtype(np.int64)
    raise InputError(f"column {name!r} holds {lo} and {hi}: no integer dtype holds both; "
                     "store it in one signed or one unsigned type")


def extra_corpus_dtypes(scans: Sequence[FileScan]) -> dict[str, np.dtype]:
    """Each extra column's dtype for inputs read back to back (as `read_corpus` makes them):
    the promotion of the dtypes of the inputs holding tokens (see `column_dtype`)."""
    names = scans[0].extra_dtypes if scans else {}
    used = [s for s in scans if s.info["num_tokens"]] or list(scans[:1])
    out = {}
    for n in names:
        lo = min(s.extra_ranges[n][0] for s in used)
        hi = max(s.extra_ranges[n][1] for s in used)
        out[n] = column_dtype([s.extra_dtypes[n] for s in used], (lo, hi), narrow=False,
                              name=n)
    return out


def read_lengths(paths: Sequence[str], options: ReadOptions) -> tuple[np.ndarray, list[dict]]:
    """Every input's example lengths back to back (i64), and each file's manifest entry; the
    tokens are read and dropped chunk by chunk (a dry run needs only the lengths)."""
    if not paths:
        raise InputError("no input files given")
    tokenizer = text.load_tokenizer(options.tokenizer) if options.tokenizer else None
    scans = [scan_file(os.fspath(p), detect_format(os.fspath(p), options.input_format), options,
                       tokenizer) for p in paths]
    check_text_beside_tokens([(s.info["path"], s.info["format"]) for s in scans],
                             tokenized=bool(options.tokenizer))
    return np.concatenate([s.lengths for s in scans]), [s.info for s in scans]


def corpus_dtype(dtypes: Sequence[np.dtype]) -> np.dtype:
    """The token dtype of inputs read back to back (as `read_corpus` makes it): numpy's
    promotion, except that uint64 with signed ids stays uint64 (ids are >= 0), not float64."""
    return common_id_dtype(dtypes) if len(dtypes) else np.dtype(np.int32)


def tokenizer_fingerprint(path: str | None) -> dict | None:
    return fingerprint(path) if path else None
