"""Text: UTF-8 files, one example per file, non-blank line or paragraph; tokenized or bytes.

With a `tokenizers` tokenizer.json the ids are the tokenizer's; without one, the UTF-8 bytes are
the ids (0..255). Text that is not UTF-8 is refused, naming the line and byte; the input format
``bytes`` (`raw=True`) packs a file's bytes as they are (no UTF-8 check, no decompression).
Text may be gzip- or zstd-compressed (`detect.open_stream`). Paragraphs are runs of non-blank
lines, numbered by their first line, so a bad one is named ``path:line``; a leading byte order
mark is dropped, and lines and paragraphs end at ``\n`` or ``\r\n`` alike. `encode` is the one
place texts become ids (text files here, text fields of JSONL and text columns of Parquet
there).

A loaded tokenizer has its padding and truncation switched off: a tokenizer.json saved for
inference often pads every text to a fixed length and cuts longer ones, which would put pad ids
into examples as real tokens and lose the cut ones without a count. Packing pads; overflow is
the packer's `--overflow` policy, counted.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from seqpack.pipelines.errors import InputError, require
from seqpack.pipelines.formats.arrayrecord import first_line
from seqpack.pipelines.formats.chunks import Chunk
from seqpack.pipelines.formats.detect import open_stream


def load_tokenizer(path: str) -> Any:
    """A `tokenizers` Tokenizer from a tokenizer.json; InputError if it cannot be loaded."""
    Tokenizer = require("tokenizers", "tokenizer=").Tokenizer
    if not os.path.isfile(path):
        raise InputError(f"{path}: tokenizer file does not exist")
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises its own Exception subclass
        raise InputError(f"{path}: not a readable tokenizer.json ({first_line(e)})") from None
    tokenizer.no_padding()  # see the module docstring
    tokenizer.no_truncation()
    return tokenizer


# Characters of text a tokenizer call takes at most (one longer text goes alone): bounds the
# tokenizer's own memory (~200 bytes a token while it works) and how long an interrupt waits.
ENCODE_CHARS = 1 << 18
TEXT_CHUNK = 16 << 20  # bytes of a text file's examples tokenized into one chunk


def encode(tokenizer: Any, texts: list[str], where: Callable[[int], str] | None = None
           ) -> tuple[np.ndarray, np.ndarray]:
    """The ids of `texts` (values, offsets); i64 values. `where(i)`: text i's file and record,
    for an InputError on a text the tokenizer refuses (a lone surrogate from a JSON escape)."""
    batch = getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch  # no offsets
    ids: list[np.ndarray] = []
    for i, j in _spans([len(t) for t in texts], ENCODE_CHARS):
        try:
            ids += [np.asarray(enc.ids, np.int64) for enc in batch(texts[i:j])]
        except Exception as e:  # TypeError for a lone surrogate; tokenizers' own errors
            raise InputError(_refused(texts, i, j, where, e)) from None
    lengths = np.fromiter((a.size for a in ids), np.int64, len(ids))
    values = np.concatenate(ids) if ids else np.zeros(0, np.int64)
    offsets = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return values, offsets


def _spans(sizes: list[int], budget: int) -> Iterator[tuple[int, int]]:
    """Consecutive [i, j) covering `sizes`, each summing to at most `budget` (or one item
    larger than it, alone)."""
    i = 0
    while i < len(sizes):
        j, total = i + 1, sizes[i]
        while j < len(sizes) and total + sizes[j] <= budget:
            total += sizes[j]
            j += 1
        yield i, j
        i = j


def lines_of(path: str, lines: list[int]) -> Callable[[int], str]:
    """`encode`'s `where` for texts from lines `lines` of `path`: "path:line"."""
    return lambda k: f"{path}:{lines[k]}"


def _refused(texts: list[str], i: int, j: int, where: Callable[[int], str] | None,
             e: Exception) -> str:
    for k in range(i, j):
        try:
            texts[k].encode("utf-8")
        except UnicodeEncodeError as u:
            at = where(k) if where else f"text {k}"
            return (f"{at}: the text holds {texts[k][u.start]!r} at character {u.start}, a "
                    "lone surrogate (an unpaired \\ud800-\\udfff escape), which is not "
                    "Unicode text; the tokenizer cannot read it")
    at = where(i) if where else f"text {i}"
    return f"{at}: the tokenizer refused the text ({first_line(e)})"


_PARAGRAPH = re.compile(rb"(?:[^\n]*\S[^\n]*(?:\n|$))+")


def read_text(path: str, tokenizer: Any, text_unit: str, *, raw: bool = False
              ) -> tuple[np.ndarray, np.ndarray]:
    """One example per file, non-blank line or paragraph (lines between blank lines): tokenizer
    ids, or UTF-8 bytes as ids (`raw`: the file's bytes, whatever they are). Returns (values,
    offsets)."""
    numbered = _units(path, tokenizer, text_unit, raw)
    chunks = [c for _, c in numbered]
    if tokenizer is not None:
        return encode(tokenizer, [c.decode("utf-8") for c in chunks],  # checked in _units
                      lines_of(path, [n for n, _ in numbered]))
    lengths = np.fromiter((len(c) for c in chunks), np.int64, len(chunks))
    values = np.frombuffer(b"".join(chunks), np.uint8)
    offsets = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return values, offsets


def _units(path: str, tokenizer: Any, text_unit: str, raw: bool) -> list[tuple[int, bytes]]:
    """The file's examples as (line number, bytes), checked as `read_text` says."""
    if raw:
        if tokenizer is not None:
            raise InputError(f"{path}: the input format bytes packs raw bytes; drop tokenizer= "
                             "(or read the file as text)")
        with open(path, "rb") as f:
            data = f.read()
    else:
        with open_stream(path) as f:
            data = f.read()
        check_utf8(data, path, hint="" if tokenizer is not None else
                   "; pass input_format='bytes' to pack its raw bytes")
        data = data.removeprefix(b"\xef\xbb\xbf")  # a byte order mark is not text
        if text_unit != "file":  # a Windows line end is a line end
            data = data.replace(b"\r\n", b"\n")
    if text_unit == "line":
        return [(k, line) for k, line in enumerate(data.split(b"\n"), 1) if line.strip()]
    if text_unit == "paragraph":  # runs of non-blank lines, numbered by their first line
        numbered, line_no, pos = [], 1, 0
        for m in _PARAGRAPH.finditer(data):
            line_no += data.count(b"\n", pos, m.start())
            pos = m.start()
            numbered.append((line_no, m.group().rstrip(b"\n")))
        return numbered
    return [(1, data)]


def check_utf8(data: bytes, path: str, *, hint: str = "") -> None:
    """InputError naming ``path:line`` and the byte unless `data` is UTF-8."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise InputError(f"{path}:{line}: not UTF-8 text ({e.reason} at byte {e.start} of the "
                         f"file){hint}") from None


def read_chunks(path: str, tokenizer: Any, text_unit: str, *, raw: bool = False
                ) -> Iterator[Chunk]:
    """The file's examples (`read_text`): tokenized, about `TEXT_CHUNK` bytes of text a chunk
    (the ids of a whole file at once take 8 bytes a token); else one chunk (a byte an id)."""
    if tokenizer is None:
        values, offsets = read_text(path, tokenizer, text_unit, raw=raw)
        yield Chunk(values, offsets, 0)
        return
    numbered = _units(path, tokenizer, text_unit, raw)
    for first, end in _spans([len(c) for _, c in numbered], TEXT_CHUNK):
        part = numbered[first:end]
        values, offsets = encode(tokenizer, [c.decode("utf-8") for _, c in part],
                                 lines_of(path, [n for n, _ in part]))
        yield Chunk(values, offsets, first)
