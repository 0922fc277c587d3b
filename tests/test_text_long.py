"""Text in bounded memory: a long text tokenized in windows gives the ids of one call, and a text
file's lines and paragraphs read a block at a time are those of the whole file."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from seqpack.pipelines.formats import text
from seqpack.pipelines.formats.inputs import InputError
from tests.helpers.tokenizers import WORDS, families, sample_text

pytest.importorskip("tokenizers")

FAMILIES = sorted(families())
_PIECES = [*WORDS, " ", "  ", "\n", "\n\n", "\t", ".", "aaaa", "x" * 40, "y" * 130, "9" * 50,
           "12345", "😀", "é"]


@pytest.fixture
def small_windows(monkeypatch):
    """Windows of 256 characters, half overlapping, joined on 2 tokens 8 characters clear of
    the edges, 3 a call; the calls that went whole are counted."""
    monkeypatch.setattr(text, "ENCODE_CHARS", 256)
    monkeypatch.setattr(text, "OVERLAP", 2)
    monkeypatch.setattr(text, "MARGIN", 32)
    monkeypatch.setattr(text, "SYNC", 2)
    monkeypatch.setattr(text, "WINDOWS", 3)
    whole = []
    one_call = text._one_call

    def counted(tok, s):
        whole.append(len(s))
        return one_call(tok, s)

    monkeypatch.setattr(text, "_one_call", counted)
    return whole


@pytest.mark.parametrize("name", FAMILIES)
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(st.sampled_from(_PIECES), min_size=50, max_size=700))
def test_a_long_text_in_windows_is_one_call(small_windows, name, pieces):
    tok = families()[name]
    s = "".join(pieces)
    want = tok.encode(s).ids
    assert text.encode_long(tok, s).tolist() == want
    assert text.encode(tok, [s, "the cat"])[0].tolist() == want + tok.encode("the cat").ids


class _Spy:
    """A tokenizer that records how many characters each call takes (a batch: its longest)."""

    def __init__(self, tok):
        self.tok, self.model, self.calls = tok, tok.model, []
        self.normalizer, self.pre_tokenizer = tok.normalizer, tok.pre_tokenizer

    def encode(self, t, **kw):
        self.calls.append(len(t))
        return self.tok.encode(t, **kw)

    def encode_batch(self, texts, **kw):
        self.calls.append(max(map(len, texts)))
        return self.tok.encode_batch(texts, **kw)


@pytest.mark.parametrize("name", FAMILIES)
def test_prose_is_joined_not_sent_whole(small_windows, name):
    """Text with word breaks is joined window to window: no call takes it whole, no call more
    than a window's worth. A Unigram model (SentencePiece's) with no pre-tokenizer takes it
    whole: its split of the text can turn on a rounding tie that depends on where it starts
    (T5's, over Metaspace's words, is joined)."""
    tok, s = families()[name], sample_text(3000, seed=1)
    spy = _Spy(tok)
    assert text.encode_long(spy, s).tolist() == tok.encode(s).ids
    if name == "unigram_bare":
        assert small_windows == [len(s)]
    else:
        assert not small_windows and len(spy.calls) > 10 and max(spy.calls) <= 256


@pytest.mark.parametrize("spaces", [False, True])
def test_a_unigram_joins_only_where_every_whitespace_cuts_its_words(small_windows, spaces):
    """A Unigram over Metaspace, whose words hold tabs and newlines unless its normalizer makes
    every whitespace a space: a tie inside such a word ("catcatcatcatcat" + "c a t" or "c a t"
    + ...) rounds by where the window starts, so it goes in one call; with the normalizer it
    is joined window to window. Either way the ids are one call's (before: other ids)."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), *(
        [normalizers.Replace(Regex(r"\s"), " ")] if spaces else [])])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    words = [sample_text(2000, seed=4), *("cat" * k for k in range(1, 12))] * 20
    tok.train_from_iterator(words, trainers.UnigramTrainer(
        vocab_size=150, show_progress=False, unk_token="<unk>", special_tokens=["<unk>"]))
    assert text._cuts_words(tok) == spaces
    for k in (6, 7, 8, 9, 11):
        for sep in ("\t", "\n", "\r\n", "\u3000"):
            s = "the cat sat " * 30 + sep.join(["cat" * k] * 40)
            assert text.encode_long(tok, s).tolist() == tok.encode(s).ids, (k, sep)
    assert bool(small_windows) != spaces  # one call, or none


def test_a_token_longer_than_the_overlap_widens_the_windows(small_windows):
    """One token longer than the windows' overlap (WordPiece's [UNK] for a word past 100
    characters): no two windows agree across it, so the windows double from the last join
    until they do, then narrow again; the text never goes whole, and the ids are one call's."""
    tok = families()["bert_wordpiece"]
    s = sample_text(1500, seed=2) + "z" * 2000 + " " + sample_text(3000, seed=3)
    spy = _Spy(tok)
    assert text.encode_long(spy, s).tolist() == tok.encode(s).ids
    assert not small_windows and 2000 < max(spy.calls) <= 4 * 2048 < len(s)
    wide = max(range(len(spy.calls)), key=spy.calls.__getitem__)
    assert spy.calls[-1] <= 256 and len(spy.calls) > wide + 5  # narrow again after it


def _units(path, unit: str, raw: bool = False) -> list[tuple[int, bytes]]:
    return [u for block in text._blocks(str(path), unit, raw, "") for u in block]


_LINES = st.lists(st.sampled_from([b"a b", b"cd", b"", b"  ", b"\t", b"x\r", b"\r",
                                   b"\xc3\xa9t\xc3\xa9", b"\xf0\x9f\x98\x80",
                                   b"long line " * 5]), max_size=40)


@settings(max_examples=150, deadline=None)
@given(lines=_LINES, bom=st.booleans(), end=st.sampled_from([b"", b"\n", b"\r\n"]),
       block=st.integers(1, 40), unit=st.sampled_from(["line", "paragraph"]), raw=st.booleans())
def test_lines_and_paragraphs_a_block_at_a_time_are_the_whole_files(
        tmp_path_factory, lines, bom, end, block, unit, raw):
    """Line numbers, a byte order mark, CRLF and blank lines with spaces come out the same
    whatever the block size (the reference: the whole file in one block)."""
    path = tmp_path_factory.mktemp("t") / "t.txt"
    data = b"\n".join(lines) + (end if lines else b"")
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + data)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(text, "TEXT_CHUNK", 1 << 30)
        whole = _units(path, unit, raw)
        mp.setattr(text, "TEXT_CHUNK", block)
        assert _units(path, unit, raw) == whole
        chunks = list(text.read_chunks(str(path), None, unit, raw=raw))
    assert chunks and [c.first for c in chunks] == np.cumsum(
        [0] + [c.num_records for c in chunks[:-1]]).tolist()
    assert b"".join(bytes(c.values) for c in chunks) == b"".join(u for _, u in whole)


@pytest.mark.parametrize("block", [1, 3, 8, 1 << 20])
def test_bad_utf8_is_named_by_line_and_byte_whatever_the_block(tmp_path, monkeypatch, block):
    path = tmp_path / "t.txt"
    path.write_bytes(b"ab\ncd\n\nef g\n\xe9x\nh\n")
    monkeypatch.setattr(text, "TEXT_CHUNK", block)
    for unit in ("line", "paragraph", "file"):
        with pytest.raises(InputError, match=r"t\.txt:5: not UTF-8 .* at byte 12 of the file"):
            list(text.read_chunks(str(path), None, unit))


def test_a_file_of_lines_is_read_a_block_at_a_time(tmp_path, monkeypatch):
    """Each read takes TEXT_CHUNK bytes: a file of lines is never held whole (before: the file
    read whole, then split)."""
    path = tmp_path / "t.txt"
    path.write_text("".join(f"line {i} of the file\n" for i in range(500)))
    monkeypatch.setattr(text, "TEXT_CHUNK", 256)
    sizes = []
    real = text.open_stream

    class Counting:
        def __init__(self, f):
            self.f = f

        def read(self, n=-1):
            sizes.append(n)
            return self.f.read(n)

    def counted(p):
        import contextlib

        @contextlib.contextmanager
        def opened():
            with real(p) as f:
                yield Counting(f)
        return opened()

    monkeypatch.setattr(text, "open_stream", counted)
    tok = families()["gpt2_bytes"]
    chunks = list(text.read_chunks(str(path), tok, "line"))
    assert set(sizes) == {256} and len(chunks) > 20
    ids = [c.values[a:b].tolist() for c in chunks for a, b in zip(c.offsets, c.offsets[1:])]
    assert ids == [tok.encode(f"line {i} of the file").ids for i in range(500)]
