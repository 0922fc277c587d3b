"""Tokenizers: padding and truncation switched off when loaded; text fields of JSONL and text
columns of Parquet tokenized with --field/--column + --tokenizer; --tokenizer with token ids is
an error (exit 2), never silently ignored."""

from __future__ import annotations

import json

import pytest

from tests.helpers.files import (
    invoke,
    write_arrayrecord,
    write_jsonl,
    write_parquet,
    write_tokenizer,
)
from tests.test_cli_pack import all_rows, assert_same_rows, expected_rows

LINES = ["the cat sat on a mat", "the dog ran", "a cat " * 12 + "sat"]  # 3, 3 and 25 words
IDS = [[1, 2, 3, 4, 5, 6], [1, 7, 8], [5, 2] * 12 + [3]]


@pytest.fixture
def padded(tmp_path):
    """A tokenizer.json saved with padding and truncation to 16 tokens on."""
    return write_tokenizer(tmp_path / "padded.json", pad_to=16)


def _pack(tmp_path, *inputs, extra=()):
    out = tmp_path / "out"
    invoke("pack", *inputs, "-o", out, "--row-order", "plan", "--seq-len", 32, "--max-segments",
           4, "--overwrite",
           *extra)
    return out


def _write_text_parquet(path, texts, column="text", categories=False):
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = pa.array(texts, type=pa.string())
    if categories:  # as pandas writes a categorical column: read back dictionary-encoded
        text = text.dictionary_encode()
    pq.write_table(pa.table({column: text, "n": range(len(texts))}), path, row_group_size=2)
    return path


def test_padding_and_truncation_are_switched_off(tmp_path, padded):
    text = tmp_path / "a.txt"
    text.write_text("\n".join(LINES) + "\n")
    out = _pack(tmp_path, text, extra=("--tokenizer", padded, "--text-unit", "line"))
    # Before: every example 16 tokens ([PAD] = 9 counted as real), the 25-word line cut to 16.
    assert_same_rows(all_rows(out), expected_rows(IDS, seq_len=32, max_segments=4))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stats"]["counters"]["truncated_tokens"] == 0
    assert invoke("verify", out).stdout.startswith("OK:")


def test_jsonl_text_field_and_parquet_text_column_are_tokenized(tmp_path, padded):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t, "id": i}) + "\n"
                             for i, t in enumerate(LINES)))
    parquet = _write_text_parquet(tmp_path / "b.parquet", LINES[::-1])
    out = _pack(tmp_path, jsonl, parquet, extra=("--field", "text", "--tokenizer", padded))
    assert_same_rows(all_rows(out), expected_rows(IDS + IDS[::-1], seq_len=32, max_segments=4))
    assert invoke("verify", out).stdout.startswith("OK:")  # re-tokenizes the same way


def test_a_dictionary_encoded_text_column_is_tokenized(tmp_path, padded):
    parquet = _write_text_parquet(tmp_path / "b.parquet", LINES + LINES[:1], categories=True)
    # Before: refused, "column 'text' has type dictionary<values=string, ...>, not text".
    out = _pack(tmp_path, parquet, extra=("--column", "text", "--tokenizer", padded))
    assert_same_rows(all_rows(out), expected_rows(IDS + IDS[:1], seq_len=32, max_segments=4))
    assert invoke("verify", out).stdout.startswith("OK:")


def test_tokenizer_with_token_ids_is_an_error(tmp_path, padded):
    seqs = [[1, 2, 3], [4, 5]]
    jsonl = write_jsonl(tmp_path / "ids.jsonl", seqs)
    cases = {
        jsonl: f"{jsonl}:1: field 'tokens' holds token ids, not text; --tokenizer tokenizes",
        write_parquet(tmp_path / "ids.parquet", seqs):
            "column 'tokens' has type list<element: int32>, not text; --tokenizer",
        write_arrayrecord(tmp_path / "ids.arrayrecord", seqs):
            "ArrayRecord records hold token ids; --tokenizer is for text",
    }
    for path, message in cases.items():
        # Before: exit 0, --tokenizer silently ignored.
        result = invoke("pack", path, "-o", tmp_path / "o", "--tokenizer", padded, ok=False)
        assert result.exit_code == 2, result.output
        assert result.output.startswith("Error: ") and message in result.output
        assert result.output.count("\n") == 1


def test_text_without_a_tokenizer_says_to_pass_one(tmp_path):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text(json.dumps({"text": "the cat"}) + "\n")
    parquet = _write_text_parquet(tmp_path / "b.parquet", ["the cat"])
    for path, message in ((jsonl, "got str; text is tokenized by seqpack pack with --tokenizer"),
                          (parquet, "seqpack pack: --tokenizer tokenizer.json")):
        result = invoke("pack", path, "-o", tmp_path / "o", "--field", "text", ok=False)
        assert result.exit_code == 2 and message in result.output, result.output


def test_help_says_padding_and_truncation_are_off():
    text = " ".join(invoke("pack", "--help").output.split())
    assert "padding and truncation are switched off" in text


def test_a_relative_tokenizer_path_is_recorded_whole(tmp_path, monkeypatch):
    (tmp_path / "run").mkdir()
    (tmp_path / "elsewhere").mkdir()
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in LINES))
    monkeypatch.chdir(tmp_path / "run")
    write_tokenizer("tok.json")
    args = ("pack", jsonl, "-o", tmp_path / "out", "--field", "text", "--seq-len", 32)
    invoke(*args, "--tokenizer", "tok.json")
    invoke(*args, "--tokenizer", "./tok.json", "--resume")  # before: "inputs differ"
    monkeypatch.chdir(tmp_path / "elsewhere")
    # Before: "tok.json: tokenizer file does not exist" here, and with another tok.json in
    # this directory verify read the text with it and found false violations.
    write_tokenizer("tok.json", pad_to=4)
    assert invoke("verify", tmp_path / "out").stdout.startswith("OK:")


def test_verify_and_resume_name_a_changed_tokenizer(tmp_path):
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in LINES))
    tok = write_tokenizer(tmp_path / "tok.json")
    args = ("pack", jsonl, "-o", tmp_path / "out", "--field", "text", "--seq-len", 32,
            "--tokenizer", tok)
    invoke(*args)
    write_tokenizer(tok, pad_to=4)  # another tokenizer under the same name
    result = invoke("verify", tmp_path / "out", ok=False)
    assert result.exit_code == 1
    assert f"tokenizer {tok} is not the one that packed the rows" in result.output
    result = invoke(*args, "--resume", ok=False)
    assert result.exit_code == 2
    assert f"(the tokenizer: {tok}, the run had {tok}, another file)" in result.output


def test_text_fields_a_tokenizer_cannot_read_are_named_by_line(tmp_path, padded):
    jsonl = tmp_path / "a.jsonl"
    cases = {
        r'{"text": "the \ud800 cat"}': ":2: the text holds '\\ud800' at character 4, a lone "
                                        "surrogate",  # before: a TypeError traceback, exit 1
        '{"text": null}': ":2: field 'text' is null; write an empty string",
        '{"text": [{"role": "user", "content": "hi"}]}':
            ":2: field 'text' holds a list of objects (chat messages?), not text",
    }
    for line, message in cases.items():
        jsonl.write_text('{"text": "the cat"}\n' + line + "\n")
        result = invoke("pack", jsonl, "-o", tmp_path / "o", "--field", "text", "--tokenizer",
                        padded, ok=False)
        assert result.exit_code == 2, result.output
        assert f"Error: {jsonl}{message}" in result.output, result.output


def test_tokenized_text_is_read_a_block_at_a_time(tmp_path, padded, monkeypatch):
    """A JSONL text field and a text file's lines come a block of lines a chunk, each tokenized
    a bounded text at a time (before: the whole file tokenized in one call, one chunk: about
    130 bytes a token held at once)."""
    from seqpack.pipelines.formats import jsonl, text

    calls = []
    monkeypatch.setattr(text, "ENCODE_CHARS", 40)
    monkeypatch.setattr(text, "TEXT_CHUNK", 100)
    tok = text.load_tokenizer(padded)
    real = tok.encode_batch_fast

    monkeypatch.setattr(text, "WINDOWS", 1)  # a long text: one window a call

    class Counting:
        def encode_batch_fast(self, texts):
            calls.append(sum(map(len, texts)))
            return real(texts)

        def encode_batch(self, texts, **kw):
            calls.append(sum(map(len, texts)))
            return tok.encode_batch(texts, **kw)

        def encode(self, text, **kw):
            calls.append(len(text))
            return tok.encode(text, **kw)

    lines = [LINES[i % 3] for i in range(40)]
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    txt = tmp_path / "a.txt"
    txt.write_text("\n".join(lines) + "\n")
    want = [IDS[i % 3] for i in range(40)]
    monkeypatch.setattr(jsonl, "BLOCK_BYTES", 300)
    for chunks in (jsonl.read_chunks(str(path), "text", Counting()),
                   text.read_chunks(str(txt), Counting(), "line")):
        calls.clear()
        chunks = list(chunks)
        assert len(chunks) > 3 and [c.first for c in chunks] == sorted({c.first for c in chunks})
        got = [c.values[a:b].tolist() for c in chunks for a, b in zip(c.offsets, c.offsets[1:])]
        assert got == want
        assert max(calls) <= max(40, max(map(len, lines)))
