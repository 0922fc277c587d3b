"""Input faults the readers refuse where they read (file and line / record named), and inputs
recognized by content: nulls and out-of-range or non-integer ids in every path, formats whose
name does not say, compressed JSONL, text that is not UTF-8 (and the explicit bytes format)."""

from __future__ import annotations

import functools
import gzip
import json
import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.pipelines.errors import InputError, MissingDependency
from seqpack.pipelines.formats import detect, jsonl
from seqpack.pipelines.formats.inputs import ReadOptions, read_corpus, read_lengths
from seqpack.pipelines.formats.parquet import ParquetTokens
from tests.helpers import files
from tests.helpers.files import random_seqs, write_arrayrecord, write_jsonl, write_parquet
from tests.test_cli_errors import assert_bad_input

SEQS = random_seqs(40, max_len=12, seed=5)
invoke = functools.partial(files.invoke, ok=False)


def _values(corpus):
    return [corpus.values[a:b].tolist() for a, b in zip(corpus.offsets[:-1], corpus.offsets[1:])]


@pytest.mark.parametrize("ids, message", [  # the third line's token ids; the error after it
    ("[1, null, 3]", "tokens[1]=None is not a non-negative integer"),
    ("[null]", "tokens[0]=None is not a non-negative integer"),
    ("[5, 9223372036854775808]", "tokens[1]=9223372036854775808 is not a valid token id for "
                                 "int64"),
    ("[18446744073709551616]", "tokens[0]=18446744073709551616 is not a valid"),
    ("[0, -1]", "tokens[1]=-1 is not a valid token id"),
    ("[1.5]", "tokens[0]=1.5 is not a non-negative integer"),
    ("[2, 1.0]", "tokens[1]=1.0 is not"),
    ('["7"]', "tokens[0]='7' is not"),
    ("[true]", "tokens[0]=True is not"),
])
def test_bad_jsonl_ids_are_refused_naming_file_and_line(tmp_path, ids, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(f'{{"tokens": [1]}}\n\n{{"tokens": {ids}}}\n')
    with pytest.raises(InputError, match=re.escape(f"{path}:3: {message}")):
        read_corpus([str(path)], ReadOptions())
    # The Grain source's per-record check is the same function.
    with pytest.raises(InputError, match=re.escape(message)):
        jsonl.tokens(json.loads(ids), "tokens", "here", np.dtype(np.int64))


def test_the_cli_refuses_a_null_id_in_one_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"tokens": [1, 2]}\n{"tokens": [null]}\n')
    assert_bad_input(invoke("pack", path, "-o", tmp_path / "out", "--workers", "1"),
                     "bad.jsonl:2: tokens[0]=None")
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_uint64_ids_fit_a_uint64_source_but_not_int64():
    big = [2**63 + 5]
    assert jsonl.tokens(big, "t", "w", np.dtype(np.uint64)).tolist() == big
    with pytest.raises(InputError, match=r"w: t\[0\]=9223372036854775813 is not a valid token"):
        jsonl.tokens(big, "t", "w", np.dtype(np.int64))


def test_parquet_null_ids_name_their_record_in_any_batch(tmp_path):
    path = tmp_path / "n.parquet"
    seqs = [[1, 2]] * 5 + [[3, None, 4]] + [[5]] * 3
    pq.write_table(pa.table({"tokens": pa.array(seqs, pa.list_(pa.int64()))}), path)
    reader = ParquetTokens(path, "tokens")
    with pytest.raises(InputError, match=f"{path} record 5: a token id is null"):
        list(reader.chunks(batch_rows=2))
    with pytest.raises(InputError, match=f"{path} record 5: a token id is null"):
        reader.read_group(0)


def test_a_corrupt_parquet_row_group_is_named_with_its_records(tmp_path):
    path = tmp_path / "x.parquet"
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, 30000, rng.integers(50, 400)).astype(np.int32) for _ in range(600)]
    pq.write_table(pa.table({"tokens": pa.array(ids, pa.list_(pa.int32()))}), path,
                   row_group_size=256, compression="snappy")
    col = pq.ParquetFile(path).metadata.row_group(1).column(0)
    at = col.data_page_offset + col.total_compressed_size // 2
    data = bytearray(path.read_bytes())
    data[at : at + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))
    with pytest.raises(InputError, match=r"cannot read row group 1 \(records 256 to 511\)"):
        list(ParquetTokens(path, "tokens").chunks())


@pytest.mark.parametrize("array, message", [
    (np.array([1.0, 2.0]), "'tokens' is float64[2], not a 1-D integer array of token ids"),
    (np.array([True]), "'tokens' is bool[1], not a 1-D integer array"),
    (np.array([3, -1], np.int16), "tokens[1]=-1 is a negative token id"),
])
def test_arrayrecord_ids_that_are_not_token_ids_name_the_record(tmp_path, array, message):
    from array_record.python.array_record_module import ArrayRecordWriter

    from seqpack.pipelines.formats.records import encode_row

    path = tmp_path / "x.arrayrecord"
    w = ArrayRecordWriter(str(path), "group_size:1")
    for row in ({"tokens": np.array([1, 2], np.int32)}, {"tokens": array}):
        w.write(encode_row(row))
    w.close()
    with pytest.raises(InputError, match=re.escape(f"{path} record 1: {message}")):
        read_corpus([str(path)], ReadOptions())


def _formats(tmp_path):
    """(file, expected format) for names that do not say their format, or say it unusually."""
    out = []
    ar = write_arrayrecord(tmp_path / "x.array_record-00000-of-00001", SEQS)
    out.append((ar, "arrayrecord"))
    os.rename(write_arrayrecord(tmp_path / "t.arrayrecord", SEQS), tmp_path / "records.bin")
    out.append((str(tmp_path / "records.bin"), "arrayrecord"))
    os.rename(write_parquet(tmp_path / "t.parquet", SEQS), tmp_path / "part-0")
    out.append((str(tmp_path / "part-0"), "parquet"))
    js = "".join(json.dumps({"tokens": s}) + "\n" for s in SEQS)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(js.encode()))
    out.append((str(tmp_path / "a.jsonl.gz"), "jsonl"))
    (tmp_path / "dump").write_bytes(gzip.compress(js.encode()))  # gzip told by content
    out.append((str(tmp_path / "dump"), "jsonl"))
    (tmp_path / "plain.jsonl").write_bytes(gzip.compress(js.encode()))  # named plain, is gzip
    out.append((str(tmp_path / "plain.jsonl"), "jsonl"))
    z = pa.compress(js.encode(), "zstd", asbytes=True)
    (tmp_path / "a.jsonl.zst").write_bytes(z)
    out.append((str(tmp_path / "a.jsonl.zst"), "jsonl"))
    (tmp_path / "records").write_text(js)  # JSONL by content
    out.append((str(tmp_path / "records"), "jsonl"))
    return out


def test_inputs_are_recognized_by_content_where_the_name_does_not_say(tmp_path):
    for path, fmt in _formats(tmp_path):
        corpus = read_corpus([path], ReadOptions())
        assert corpus.files[0]["format"] == fmt, path
        assert _values(corpus) == SEQS, path
    lengths, infos = read_lengths([p for p, _ in _formats(tmp_path)], ReadOptions())
    assert lengths.tolist() == [len(s) for s in SEQS] * 8


def test_compressed_jsonl_streams_in_blocks_naming_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(jsonl, "BLOCK_BYTES", 64)  # many blocks, lines across their edges
    lines = [json.dumps({"tokens": s}) for s in SEQS] + [json.dumps({"tokens": list(range(40))})]
    lines.insert(7, "")
    data = ("\n".join(lines) + "\n").encode()
    path = tmp_path / "a.jsonl.gz"
    path.write_bytes(gzip.compress(data))
    assert _values(read_corpus([str(path)], ReadOptions())) == SEQS + [list(range(40))]
    bad_lines = data.split(b"\n")
    bad_lines[30] = b'{"tokens": [1, "x"]}'
    path.write_bytes(gzip.compress(b"\n".join(bad_lines)))
    with pytest.raises(InputError, match=f"{path}:31: tokens\\[1\\]='x'"):
        read_corpus([str(path)], ReadOptions())
    path.write_bytes(gzip.compress(data)[:-20])  # truncated
    with pytest.raises(InputError, match=f"{path}: corrupt compressed data"):
        read_corpus([str(path)], ReadOptions())


@settings(max_examples=25, deadline=None)
@given(st.lists(st.binary(max_size=12).map(lambda b: b.replace(b"\n", b"")), max_size=20),
       st.integers(1, 40))
def test_line_blocks_keep_every_line_and_its_number(lines, size):
    import io

    data = b"\n".join(lines)
    seen = []
    for block, first in jsonl.line_blocks(io.BytesIO(data), size):
        assert block.endswith(b"\n") or first + block.count(b"\n") == len(lines)
        seen += [(first + k, raw) for k, raw in enumerate(block.split(b"\n"))]
    got = [(n, raw) for n, raw in seen if raw]
    assert got == [(n, raw) for n, raw in enumerate(lines, 1) if raw]


def test_zstd_without_pyarrow_names_the_install(tmp_path, monkeypatch):
    path = tmp_path / "a.jsonl.zst"
    path.write_bytes(pa.compress(b'{"tokens": [1]}\n', "zstd", asbytes=True))
    monkeypatch.setitem(__import__("sys").modules, "pyarrow", None)
    with pytest.raises(MissingDependency,
                       match=r"zstd.*needs pyarrow: pip install seqpack \(it is a core"):
        with detect.open_stream(str(path)) as stream:
            stream.read()


def test_unrecognized_content_is_refused_not_packed_as_bytes(tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(InputError, match=f"{path}: cannot tell the input format .*"
                                         "input_format="):
        read_corpus([str(path)], ReadOptions())
    assert_bad_input(invoke("stats", path), "blob.bin: cannot tell the input format",
                     "pass --input-format (")
    # Asked for explicitly, the raw bytes are the ids.
    corpus = read_corpus([str(path)], ReadOptions(input_format="bytes"))
    assert corpus.values.dtype == np.uint8 and bytes(corpus.values) == path.read_bytes()
    gz = tmp_path / "x.gz"
    gz.write_bytes(gzip.compress(b"\x00\xff" * 50))
    with pytest.raises(InputError, match="cannot tell the input format .* gzip-compressed"):
        read_corpus([str(gz)], ReadOptions())
    pz = tmp_path / "p.gz"
    pz.write_bytes(gzip.compress(open(write_parquet(tmp_path / "p.parquet", SEQS), "rb").read()))
    with pytest.raises(InputError, match="gzip-compressed Parquet file; decompress it first"):
        read_corpus([str(pz)], ReadOptions())


def test_text_that_is_not_utf8_is_refused_unless_bytes_are_asked_for(tmp_path):
    path = tmp_path / "a.txt"
    data = b"fine line\nsecond \xff\xfe line\n"
    path.write_bytes(data)
    for unit in ("file", "line", "paragraph"):
        with pytest.raises(InputError, match=f"{path}:2: not UTF-8 text .*at byte 17 .*"
                                             "input_format='bytes'"):
            read_corpus([str(path)], ReadOptions(text_unit=unit))
    corpus = read_corpus([str(path)], ReadOptions(input_format="bytes", text_unit="line"))
    assert [bytes(corpus.values[a:b]) for a, b in zip(corpus.offsets[:-1], corpus.offsets[1:])
            ] == data.split(b"\n")[:2]
    assert_bad_input(invoke("stats", path), "a.txt:2: not UTF-8 text", "--input-format bytes")
    notes = tmp_path / "notes"  # UTF-8 text without an extension: text
    notes.write_text("ein Beispiel: grüße\n")
    corpus = read_corpus([str(notes)], ReadOptions())
    assert corpus.files[0]["format"] == "text"
    assert bytes(corpus.values) == notes.read_bytes()


def test_read_options_check_their_columns():
    opts = ReadOptions(column="input_ids", extra_columns=["labels", "mask"])
    assert opts.extra_columns == ("labels", "mask")  # a manifest's JSON list
    assert ReadOptions(**json.loads(json.dumps(opts.__dict__))) == opts
    for bad, message in [
        (dict(extra_columns=("tokens",)), "distinct"),
        (dict(extra_columns=("a", "a")), "distinct"),
        (dict(extra_columns=("a",), tokenizer="tok.json"), "tokenizer"),
        (dict(extra_columns=("a",), input_format="text"), "one column"),
        (dict(input_format="bytes", tokenizer="tok.json"), "raw bytes"),
    ]:
        with pytest.raises(InputError, match=message):
            ReadOptions(**bad)


def test_format_by_name():
    names = {"a.JSONL": "jsonl", "a.ndjson.zst": "jsonl", "b.json.gz": "jsonl",
             "c.array_record-00003-of-00008": "arrayrecord", "d.arrayrecord": "arrayrecord",
             "train-00000-of-00002.parquet": "parquet", "t.txt.gz": "text", "x.csv": None,
             "README": None, "gs://b/p/x.parquet": "parquet"}
    assert {n: detect.format_by_name(n) for n in names} == names
    assert detect.detect_format("x.csv", None) == detect.AUTO
    assert detect.detect_format("x.csv", "text") == "text"


def test_jsonl_fast_and_slow_paths_agree_on_valid_input(tmp_path, monkeypatch):
    long = list(range(140_000))  # one line longer than pyarrow's 1 MiB parse block
    path = write_jsonl(tmp_path / "a.jsonl", SEQS + [[2**40, 0], long] + SEQS)
    slow_calls = []
    python_reader = jsonl._read_python
    monkeypatch.setattr(jsonl, "_read_python", lambda *a: slow_calls.append(a) or
                        python_reader(*a))
    fast = read_corpus([path], ReadOptions())
    assert not slow_calls  # valid input never needs the Python reader
    monkeypatch.setattr(jsonl, "_read_arrow", lambda *a: None)
    slow = read_corpus([path], ReadOptions())
    assert _values(fast) == _values(slow) == SEQS + [[2**40, 0], long] + SEQS
    assert fast.values.dtype == slow.values.dtype == np.int64


def test_a_shard_of_a_packed_output_given_as_an_input_is_refused(tmp_path):
    """It would read as examples of padded rows, several examples merged into each."""
    src = write_jsonl(tmp_path / "a.jsonl", random_seqs(30, max_len=10))
    files.invoke("pack", src, "-o", tmp_path / "out", "--seq-len", 32, "--workers", 1)
    shard = next(p for p in (tmp_path / "out").iterdir() if p.suffix == ".arrayrecord")
    for command in ("pack", "stats"):
        args = ["-o", tmp_path / "again"] if command == "pack" else []
        assert_bad_input(files.invoke(command, shard, *args, ok=False),
                         f"{shard.name} record 0: a packed row")
