"""JSON Lines: one JSON object per line, token ids in a field. One reader for the CLI and Grain.

    {"tokens": [101, 7592, 102], "labels": [-100, 7592, 102], "id": 3}
    {"tokens": [101, 102], "labels": [-100, 102]}

With a tokenizer (`--tokenizer`), the field holds text instead, tokenized here:

    {"text": "the cat sat", "id": 3}

Blank lines are skipped and are not records. `read_chunks` streams a file (gzip or zstd
compressed too, told by content: `detect.open_stream`) in blocks of whole lines, one chunk per
block: pyarrow's parser when installed, Python's (which names the bad line) otherwise or when a
block holds anything pyarrow does not check (a null, a negative id, a number it cannot parse,
columns of unequal length). `line_index` + `parse_line` + `tokens` give random access to one
record of an uncompressed file (`JsonlSource`).

Aligned fields (`aligned_columns`: labels, masks) hold one integer per token of the record
(any sign, int64 range); a record whose fields differ in length is refused.

Every check raises `InputError` naming ``path:line``: not JSON, not an object, a field missing
or not a list, a value that is not an integer (1.5, "7", true, null), a token id that is
negative or too large for the dtype (2**63 and above for int64), a length mismatch.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from seqpack.packer.inputs import check_range
from seqpack.pipelines.errors import InputError
from seqpack.pipelines.formats.chunks import Chunk, check_aligned, numpy_view, ragged
from seqpack.pipelines.formats.detect import Readable, compression, open_stream
from seqpack.pipelines.formats.text import encode, lines_of

BLOCK_BYTES = 16 << 20  # whole lines parsed at a time (about 2M short token ids)
_INT64 = np.dtype(np.int64)


def line_index(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start, end, line number) of the non-blank lines of a file; i64[n] each."""
    size = os.path.getsize(path)
    if size == 0:
        z = np.zeros(0, np.int64)
        return z, z, z
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        kind = compression(mm[:4])
        if kind:
            raise InputError(f"{path}: {kind}-compressed JSONL has no random access; decompress "
                             "it for a Grain source (the offline CLI reads it as it is)")
        data = np.frombuffer(mm, np.uint8)
        newlines = np.flatnonzero(data == ord("\n"))
        starts = np.concatenate([[0], newlines + 1])
        ends = np.concatenate([newlines, [size]])
        keep = ends > starts
        first = data[np.minimum(starts, size - 1)]  # a copy: the view goes before the map
        del data
        # A line that starts with white space may be only white space (a blank line of a
        # CRLF file): skipped, as the offline reader skips it.
        for i in np.flatnonzero(keep & np.isin(first, list(b" \t\r\f\v"))).tolist():
            keep[i] = bool(mm[starts[i] : ends[i]].strip())
    line_no = np.arange(1, starts.size + 1, dtype=np.int64)
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
                         "name the token list with column= or field=")
    return record


def tokens(value: Any, field: str, where: str, dtype: np.dtype, *, token_ids: bool = True
           ) -> np.ndarray:
    """A record's list of token ids (`token_ids`: >= 0) or of integers (labels, masks: any
    sign) as a `dtype` array; InputError for anything else or a value `dtype` cannot hold."""
    what = "token ids" if token_ids else "integers"
    if not isinstance(value, list):
        hint = ("; text is tokenized by seqpack pack with tokenizer= (a Grain source: map it "
                "through a tokenizer before packing)") if isinstance(value, str) else ""
        raise InputError(f"{where}: field {field!r} must be a list of {what}, "
                         f"got {type(value).__name__}{hint}")
    if not value:
        return np.zeros(0, dtype)
    for k, t in enumerate(value):
        if type(t) is not int:  # bool, float, str, None, nested list: all rejected
            raise InputError(f"{where}: {field}[{k}]={t!r} is not "
                             + ("a non-negative integer token id" if token_ids else
                                "an integer"))
    arr = np.asarray(value)  # int64 / uint64; float64 or object beyond: checked as Python ints
    return check_range(arr if arr.dtype.kind in "iu" else value, np.dtype(dtype),
                       lambda k: f"{where}: {field}[{k}]", token_ids=token_ids)


def read_chunks(path: str, field: str, tokenizer: Any = None, *,
                aligned_columns: Sequence[str] = ()) -> Iterator[Chunk]:
    """The token lists (and aligned fields, int64) of one JSONL file, a block of lines per
    chunk; with a tokenizer its tokenized text field."""
    if tokenizer is not None:
        if aligned_columns:
            raise InputError(f"{path}: extra columns cannot be read with tokenizer= (the "
                             "tokenized lengths would not match them)")
        yield from read_text_field(path, field, tokenizer)
        return
    fields = (field, *aligned_columns)
    first = 0
    with open_stream(path) as stream:
        for block, line in line_blocks(stream):
            chunk = _read_arrow(block, fields, first)
            if chunk is None:
                chunk = _read_python(block, path, line, fields, first)
            first += chunk.num_records
            yield chunk


def line_blocks(stream: Readable, size: int | None = None) -> Iterator[tuple[bytes, int]]:
    """(whole lines, number of the first one) of a stream, about `size` bytes at a time
    (default `BLOCK_BYTES`)."""
    size = size or BLOCK_BYTES
    line, tail = 1, b""
    while True:
        data = stream.read(size)
        if not data:
            if tail:
                yield tail, line
            return
        data = tail + data if tail else data
        cut = data.rfind(b"\n") + 1
        if cut == 0:  # a line longer than `size`: read on
            tail = data
            continue
        block, tail = (data, b"") if cut == len(data) else (data[:cut], data[cut:])
        yield block, line
        line += block.count(b"\n")


def _read_arrow(block: bytes, fields: tuple[str, ...], first: int) -> Chunk | None:
    """A block parsed by pyarrow, or None when pyarrow is missing or the block needs the
    Python reader to be checked (or named)."""
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.json as pj
    except ImportError:
        return None
    schema = pa.schema([(name, pa.list_(pa.int64())) for name in fields])
    opts = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    try:
        try:
            table = pj.read_json(pa.BufferReader(block), parse_options=opts)
        except pa.ArrowInvalid as e:
            if "straddl" not in str(e):  # a line longer than pyarrow's block: one block
                raise
            one = pj.ReadOptions(block_size=len(block) + 1)
            table = pj.read_json(pa.BufferReader(block), parse_options=opts, read_options=one)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    if table.num_rows != _nonblank_lines(block):
        return None  # not one object a line (two on one, lone \r ends): the checked reader
    try:  # JSON is UTF-8, also in the fields not read (as json.loads)
        block.isascii() or block.decode("utf-8")
    except UnicodeDecodeError:
        return None
    cols = [table.column(i).combine_chunks() for i in range(len(fields))]
    if any(c.null_count or c.values.null_count for c in cols):  # null lists / ids
        return None
    tok = cols[0]
    if len(tok.values) and pc.min(tok.values).as_py() < 0:
        return None
    offsets = numpy_view(tok.offsets).astype(np.int64)
    extra = {}
    for name, col in zip(fields[1:], cols[1:]):
        if not np.array_equal(numpy_view(col.offsets), offsets):
            return None
        extra[name] = numpy_view(col.values)
    return Chunk(numpy_view(tok.values), offsets, first, extra_values=extra)


_SPACE = np.zeros(256, bool)
_SPACE[list(b" \t\n\r\f\v")] = True


def _nonblank_lines(block: bytes) -> int:
    """How many lines of `block` hold more than white space: one numpy pass over the line
    starts; the lines that start with white space (rare in JSON Lines) looked at alone."""
    data = np.frombuffer(block, np.uint8)
    if not data.size:
        return 0
    ends = np.flatnonzero(data == 10)
    starts = np.concatenate(([0], ends + 1))
    starts = starts[starts < data.size]  # no line after a final newline
    spaced = np.flatnonzero(_SPACE[data[starts]])
    bounds = np.append(ends, data.size)
    return int(starts.size - sum(not block[starts[i] : bounds[i]].strip() for i in spaced))


def _read_python(block: bytes, path: str, line: int, fields: tuple[str, ...], first: int
                 ) -> Chunk:
    field, aligned = fields[0], fields[1:]
    seqs: list[np.ndarray] = []
    columns: dict[str, list[np.ndarray]] = {name: [] for name in aligned}
    for k, raw in enumerate(block.split(b"\n")):
        if not raw.strip():
            continue
        where = f"{path}:{line + k}"
        record = parse_line(raw, field, where)
        seq = tokens(record[field], field, where, _INT64)
        for name in aligned:
            if name not in record:
                raise InputError(f"{where}: field {name!r} (an extra column) is missing (keys: "
                                 f"{sorted(record)[:8]})")
            values = tokens(record[name], name, where, _INT64, token_ids=False)
            check_aligned(where, field, seq.size, name, values.size)
            columns[name].append(values)
        seqs.append(seq)
    values, offsets = ragged(seqs, _INT64)
    extra = {name: ragged(v, _INT64)[0] for name, v in columns.items()}
    return Chunk(values, offsets, first, extra_values=extra)


def read_python(path: str, field: str) -> Chunk:
    """Every record of a file through the Python reader (one chunk; checks and names lines)."""
    with open_stream(path) as stream:
        return _read_python(stream.read(), path, 1, (field,), 0)


def read_text_field(path: str, field: str, tokenizer: Any) -> Iterator[Chunk]:
    """The text field of every record, tokenized, a block of lines per chunk; InputError naming
    the line of a record whose field is not a string (token ids with a tokenizer are an error,
    not silently kept) or that the tokenizer refuses."""
    first = 0
    with open_stream(path) as stream:
        for block, line in line_blocks(stream):
            texts, lines = [], []
            for line_no, raw in enumerate(block.split(b"\n"), line):
                if not raw.strip():
                    continue
                where = f"{path}:{line_no}"
                value = parse_line(raw, field, where)[field]
                if not isinstance(value, str):
                    raise InputError(_not_text(where, field, value))
                texts.append(value)
                lines.append(line_no)
            values, offsets = encode(tokenizer, texts, lines_of(path, lines))
            yield Chunk(values, offsets, first)
            first += len(texts)


def _not_text(where: str, field: str, value: Any) -> str:
    if value is None:
        return f"{where}: field {field!r} is null; write an empty string for an empty example"
    if isinstance(value, list) and all(type(v) is int for v in value):
        return (f"{where}: field {field!r} holds token ids, not text; tokenizer= tokenizes a "
                "text field (drop tokenizer= for token ids, or point column= at the text)")
    what = "a list of objects (chat messages?)" if isinstance(value, list) else \
        type(value).__name__
    return (f"{where}: field {field!r} holds {what}, not text; tokenizer= tokenizes a text "
            "field: render it to text first (a chat template), or point column= at the text")
