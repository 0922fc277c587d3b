"""JSON Lines: one JSON object per line, token ids in a field. One reader for the CLI and Grain.

    {"tokens": [101, 7592, 102], "id": 3}
    {"tokens": [101, 102]}

With a tokenizer (`--tokenizer`), the field holds text instead, tokenized here:

    {"text": "the cat sat", "id": 3}

Blank lines are skipped and are not records. `read_chunks` reads a whole file as ragged chunks
(pyarrow's parser when installed; Python's, which names the bad line, otherwise or on error);
`line_index` + `parse_line` + `tokens` give random access to one record (`JsonlSource`).

Every check raises `InputError` naming ``path:line``: not JSON, not an object, the field
missing or not a list, a token that is not an integer, negative or too large for the dtype.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from seqpack.pipelines.errors import InputError
from seqpack.pipelines.formats.chunks import Chunk, numpy_view, ragged
from seqpack.pipelines.formats.text import encode


def line_index(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


def parse_line(raw: bytes, field: str, where: str) -> dict[str, Any]:
    """The JSON object on one line; InputError unless it is an object holding `field`."""
    try:
        record = json.loads(raw)
    except ValueError as e:
        raise InputError(f"{where}: not valid JSON ({e}); fix or remove the line") from None
    if not isinstance(record, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(record).__name__}; "
                         f"write one object per line with a {field!r} list")
    if field not in record:
        raise InputError(f"{where}: field {field!r} is missing (keys: {sorted(record)[:8]}); "
                         "pass --column (column= in Python) naming the token list")
    return record


def tokens(value: Any, field: str, where: str, dtype: np.dtype) -> np.ndarray:
    """A record's token list as a `dtype` array; InputError for anything but valid ids."""
    if not isinstance(value, list):
        hint = "; text is tokenized with --tokenizer" if isinstance(value, str) else ""
        raise InputError(f"{where}: field {field!r} must be a list of token ids, "
                         f"got {type(value).__name__}{hint}")
    if not value:
        return np.zeros(0, dtype)
    for k, t in enumerate(value):
        if type(t) is not int:  # bool, float, str, None, nested list: all rejected
            raise InputError(f"{where}: {field}[{k}]={t!r} is not a non-negative integer token id")
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu":  # ints beyond 64 bits
        arr = np.asarray([min(max(t, -1), 2**63 - 1) for t in value])
    info = np.iinfo(dtype)
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > info.max:
        k = int(np.argmax((arr < 0) | (arr > info.max)))
        raise InputError(f"{where}: {field}[{k}]={value[k]} is not a valid token id for {dtype} "
                         f"(ids must be in [0, {info.max}])")
    return arr.astype(dtype)


def read_chunks(path: str, field: str, tokenizer: Any = None) -> Iterator[Chunk]:
    """The token lists of one JSONL file (one chunk per file: pyarrow parses it whole), or with
    a tokenizer its tokenized text field."""
    if tokenizer is not None:
        yield read_text_field(path, field, tokenizer)
        return
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.json as pj
    except ImportError:
        yield read_python(path, field)
        return
    schema = pa.schema([(field, pa.list_(pa.int64()))])
    opts = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    try:
        col = pj.read_json(path, parse_options=opts).column(0).combine_chunks()
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        yield read_python(path, field)  # finds and names the bad line
        return
    if col.null_count or (len(col.values) and pc.min(col.values).as_py() < 0):
        yield read_python(path, field)
        return
    yield Chunk(numpy_view(col.values), numpy_view(col.offsets).astype(np.int64), 0)


def read_text_field(path: str, field: str, tokenizer: Any) -> Chunk:
    """The text field of every record, tokenized; InputError naming the line of a record whose
    field is not a string (token ids with a tokenizer are an error, not silently kept)."""
    texts = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path}:{line_no}"
            value = parse_line(raw, field, where)[field]
            if not isinstance(value, str):
                what = "token ids" if isinstance(value, list) else type(value).__name__
                raise InputError(f"{where}: field {field!r} holds {what}, not text; --tokenizer "
                                 "tokenizes a text field (drop --tokenizer for token ids, or "
                                 "point --field at the text)")
            texts.append(value)
    values, offsets = encode(tokenizer, texts)
    return Chunk(values, offsets, 0)


def read_python(path: str, field: str) -> Chunk:
    seqs = []
    int64 = np.dtype(np.int64)
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path}:{line_no}"
            seqs.append(tokens(parse_line(raw, field, where)[field], field, where, int64))
    values, offsets = ragged(seqs, int64)
    return Chunk(values, offsets, 0)
