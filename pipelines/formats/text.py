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
from seqpack.pipelines.formats.chunks import Chunk, concat
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
            if len(texts[i]) > ENCODE_CHARS:  # a long text goes alone (`_spans`)
                ids.append(encode_long(tokenizer, texts[i]))
            else:
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


_SPACES = np.array([c for c in range(0x3001) if chr(c).isspace() and not 0x1C <= c <= 0x1F],
                   np.uint32)  # str.isspace's, less the information separators regexes keep

# A long text's windows: each overlaps the last by width // OVERLAP characters and is joined to
# it at a character both cut at where text turns to or from whitespace, at least width // MARGIN
# clear of either's edges, where both hold the same SYNC tokens on either side; WINDOWS of them
# go to the tokenizer a call.
OVERLAP, MARGIN, SYNC, WINDOWS = 8, 32, 8, 8


def encode_long(tokenizer: Any, text: str) -> np.ndarray:
    """The ids one call gives for `text` (special tokens included), tokenized in windows of
    `ENCODE_CHARS` characters: the tokenizer's memory is WINDOWS windows', not the text's, and
    its threads share them. Windows are joined where they agree (see OVERLAP): a tokenizer's
    model works within pre-tokens, and two windows cut at one character with the same tokens
    around it have pre-tokenized alike there. Two windows that do not agree (a token longer
    than their overlap) are made twice as wide from the last join, until they do. A Unigram
    model (SentencePiece's) goes in one call unless its text is cut into words at every
    whitespace character: its best split of a pre-token can turn on a tie whose rounding
    depends on where the pre-token starts, far from the join; and so does a text whose special
    tokens cannot be told from its own."""
    whole = type(getattr(tokenizer, "model", None)).__name__ == "Unigram" and not _cuts_words(
        tokenizer)
    specials = None if whole else _specials(tokenizer)
    if specials is None:
        return _one_call(tokenizer, text)
    width, start, keep, parts = ENCODE_CHARS, 0, 0, [specials[0]]
    window, at, held = next(_windows(tokenizer, text, [0], width))[1], 0, width  # from, wide
    ahead: list = []  # the windows after `window`, tokenized in one call
    while at + held < len(text):  # `start`: where the windows ahead are counted from
        step, margin = width - width // OVERLAP, width // MARGIN
        if not ahead:
            ahead = list(_windows(tokenizer, text, [start + step * k for k in range(
                1, WINDOWS + 1) if start + step * (k - 1) + width < len(text)], width))
        after, following = ahead.pop(0)
        join = _join(window, following, after + margin, start + width - margin)
        if join is None:  # `keep`, early in `window`, holds in a wider one from `at`
            width = held = 2 * max(width, held)
            start, ahead = at, []
            window = next(_windows(tokenizer, text, [at], width))[1]
            continue
        parts.append(window[0][keep : join[0]])
        keep, window, start, at, held = join[1], following, after, after, width
        if width != ENCODE_CHARS:  # past the long token: narrower windows after the join
            width, ahead, start = ENCODE_CHARS, [], int(window[1][keep, 0])
    parts += [window[0][keep:], specials[1]]
    return np.concatenate(parts)


def _cuts_words(tokenizer: Any) -> bool:
    """Whether the tokenizer cuts text into words at every whitespace character (its normalizer,
    then its pre-tokenizer), so its model works within each word alone, never across a place
    where windows may join."""
    pre, norm = (getattr(tokenizer, a, None) for a in ("pre_tokenizer", "normalizer"))
    try:
        return pre is not None and all(len(pre.pre_tokenize_str(
            s if norm is None else norm.normalize_str(s))) > 1
            for s in (f"ab{chr(c)}cd" for c in _SPACES.tolist()))
    except Exception:  # noqa: BLE001 (a pre-tokenizer that cannot tell: one call)
        return False


def _one_call(tokenizer: Any, text: str) -> np.ndarray:
    return np.asarray(tokenizer.encode(text).ids, np.int64)


def _specials(tokenizer: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """The ids the tokenizer's post-processor puts before and after a text's (BOS, [CLS] ...);
    None when a probe's own ids are not found whole among them."""
    full = tokenizer.encode("a b").ids
    bare = tokenizer.encode("a b", add_special_tokens=False).ids
    for k in range(len(full) - len(bare) + 1 if bare else 0):
        if full[k : k + len(bare)] == bare:
            return (np.asarray(full[:k], np.int64), np.asarray(full[k + len(bare):], np.int64))
    return None


def _windows(tokenizer: Any, text: str, starts: list[int], width: int
             ) -> Iterator[tuple[int, tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    """(start, (ids, character offsets in `text` [n, 2], the cuts: indices i whose token starts
    at or after every earlier token's end, where text turns to whitespace or from it)) of each
    text[start:start + width], no special tokens, tokenized in one call. Only there: within a
    word, or a run of digits or spaces, a tokenizer's split can depend on all of it (a
    WordPiece word past its longest is [UNK]; digits go three by three from the run's start)."""
    texts = [text[a : a + width] for a in starts]
    encs = tokenizer.encode_batch(texts, add_special_tokens=False)
    for start, piece, enc in zip(starts, texts, encs):
        ids = np.asarray(enc.ids, np.int64)
        offsets = np.asarray(enc.offsets, np.int64).reshape(-1, 2)
        ends = np.maximum.accumulate(offsets[:, 1])
        cuts = np.flatnonzero(offsets[1:, 0] >= ends[:-1]) + 1
        space = np.isin(np.frombuffer(piece.encode("utf-32-le"), np.uint32), _SPACES)
        at = offsets[cuts, 0]
        turn = (at > 0) & (at < space.size)
        turn[turn] = space[at[turn] - 1] != space[at[turn]]
        yield start, (ids, offsets + start, cuts[turn])


def _join(a: tuple, b: tuple, lo: int, hi: int) -> tuple[int, int] | None:
    """(i, j): a's tokens before i then b's from j, cut at one character in [lo, hi] where a
    and b hold the same SYNC tokens (ids and offsets) either side; None if there is none."""
    (ids_a, off_a, cuts_a), (ids_b, off_b, cuts_b) = a, b
    at, ia, ib = np.intersect1d(off_a[cuts_a, 0], off_b[cuts_b, 0], return_indices=True)
    inside = (at >= lo) & (at <= hi)
    for i, j in zip(cuts_a[ia[inside]].tolist(), cuts_b[ib[inside]].tolist()):
        if (SYNC <= min(i, j) and i + SYNC <= ids_a.size and j + SYNC <= ids_b.size
                and np.array_equal(ids_a[i - SYNC : i + SYNC], ids_b[j - SYNC : j + SYNC])
                and np.array_equal(off_a[i - SYNC : i + SYNC], off_b[j - SYNC : j + SYNC])):
            return i, j
    return None


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
_BLANK = re.compile(rb"^[ \t\r\f\v]*\n", re.MULTILINE)  # a line _PARAGRAPH does not take
_BOM = b"\xef\xbb\xbf"


def read_chunks(path: str, tokenizer: Any, text_unit: str, *, raw: bool = False
                ) -> Iterator[Chunk]:
    """The file's examples: one per file, non-blank line or paragraph (lines between blank
    lines), tokenizer ids or UTF-8 bytes as ids (`raw`: the file's bytes, whatever they are).
    Lines and paragraphs are read about `TEXT_CHUNK` bytes at a time, a chunk each (tokenized:
    one per `TEXT_CHUNK` bytes of text), so memory holds a block, not the file."""
    if raw and tokenizer is not None:
        raise InputError(f"{path}: the input format bytes packs raw bytes; drop tokenizer= "
                         "(or read the file as text)")
    hint = "" if tokenizer is not None else "; pass input_format='bytes' to pack its raw bytes"
    first = 0
    for numbered in _blocks(path, text_unit, raw, hint):
        if tokenizer is None:
            values, offsets = _bytes_ids([c for _, c in numbered])
            yield Chunk(values, offsets, first)
            first += len(numbered)
            continue
        for a, b in _spans([len(c) for _, c in numbered], TEXT_CHUNK):
            part = numbered[a:b]
            values, offsets = encode(tokenizer, [c.decode("utf-8") for _, c in part],  # checked
                                     lines_of(path, [n for n, _ in part]))
            yield Chunk(values, offsets, first)
            first += len(part)


def read_text(path: str, tokenizer: Any, text_unit: str, *, raw: bool = False
              ) -> tuple[np.ndarray, np.ndarray]:
    """The file's examples (`read_chunks`) joined: (values, offsets)."""
    chunks = list(read_chunks(path, tokenizer, text_unit, raw=raw))
    return concat(chunks) if chunks else (np.zeros(0, np.int64), np.zeros(1, np.int64))


def _bytes_ids(texts: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter(map(len, texts), np.int64, len(texts))
    offsets = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return np.frombuffer(b"".join(texts), np.uint8), offsets


def _blocks(path: str, text_unit: str, raw: bool, hint: str
            ) -> Iterator[list[tuple[int, bytes]]]:
    """The file's examples as (line number, bytes), checked as `read_chunks` says: a block of
    whole lines or paragraphs of about `TEXT_CHUNK` bytes at a time (at least one block), a
    file whole."""
    with open(path, "rb") if raw else open_stream(path) as f:
        pending, line, byte, end, done = bytearray(), 1, 0, False, 0
        while not end:
            more = f.read() if text_unit == "file" else f.read(TEXT_CHUNK)
            end = not more or text_unit == "file"
            since = len(pending)
            pending += more
            cut = len(pending) if end else _cut(pending, since, text_unit)
            if not cut and not end:
                continue
            ready = bytes(pending[:cut])
            del pending[:cut]
            if not raw:
                check_utf8(ready, path, hint=hint, line=line, byte=byte)
                if not byte:
                    ready = ready.removeprefix(_BOM)  # a byte order mark is not text
                if text_unit != "file":  # a Windows line end is a line end
                    ready = ready.replace(b"\r\n", b"\n")
            numbered = _numbered(ready, text_unit, line)
            if numbered or (end and not done):
                yield numbered
                done += 1
            line, byte = line + ready.count(b"\n"), byte + cut


def _cut(pending: bytearray, since: int, text_unit: str) -> int:
    """Where the whole lines (paragraphs: up to the last blank line) of `pending` end; 0 if
    none do. Bytes before `since` held no cut when they came."""
    if text_unit == "line":
        return pending.rfind(b"\n", since) + 1
    end = 0
    for m in _BLANK.finditer(pending, pending.rfind(b"\n", 0, since) + 1):
        end = m.end()
    return end


def _numbered(data: bytes, text_unit: str, line: int) -> list[tuple[int, bytes]]:
    """The examples of `data`, whose first line is line `line` of the file."""
    if text_unit == "line":
        return [(k, x) for k, x in enumerate(data.split(b"\n"), line) if x.strip()]
    if text_unit == "paragraph":  # runs of non-blank lines, numbered by their first line
        numbered, pos = [], 0
        for m in _PARAGRAPH.finditer(data):
            line += data.count(b"\n", pos, m.start())
            pos = m.start()
            numbered.append((line, m.group().rstrip(b"\n")))
        return numbered
    return [(1, data)]


def check_utf8(data: bytes, path: str, *, hint: str = "", line: int = 1, byte: int = 0) -> None:
    """InputError naming ``path:line`` and the byte unless `data` is UTF-8; `data` starts at
    line `line`, byte `byte` of the file."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        line += data.count(b"\n", 0, e.start)
        raise InputError(f"{path}:{line}: not UTF-8 text ({e.reason} at byte {byte + e.start} "
                         f"of the file){hint}") from None
