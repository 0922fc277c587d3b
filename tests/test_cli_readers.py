"""The CLI's input readers: JSONL fast/slow paths agree, dtypes, several files, fingerprints."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.pipelines.formats import inputs as readers
from seqpack.pipelines.formats import jsonl, text
from seqpack.pipelines.formats.inputs import InputError, ReadOptions, fingerprint, read_corpus
from tests.helpers.files import random_seqs, write_jsonl, write_parquet

SEQS = random_seqs(200, max_len=30, seed=7)


def ragged(seqs):
    lengths = np.array([len(s) for s in seqs])
    return np.concatenate([np.asarray(s, np.int64) for s in seqs]), np.concatenate(
        [[0], np.cumsum(lengths)])


def test_jsonl_arrow_and_python_paths_agree(tmp_path, monkeypatch):
    path = tmp_path / "a.jsonl"
    lines = [f'{{"id": {i}, "tokens": {s}}}' for i, s in enumerate(SEQS)]
    lines[3:3] = ["", "   "]  # blank lines are skipped
    path.write_text("\r\n".join(lines) + "\r\n")
    chunk = jsonl.read_python(str(path), "tokens")
    slow = readers.narrow(chunk.values), chunk.offsets
    monkeypatch.setattr(jsonl, "_read_python", None)  # the Arrow path must not fall back
    fast = readers.read_file(str(path), "jsonl", ReadOptions())
    want_values, want_offsets = ragged(SEQS)
    for values, offsets in (fast, slow):
        assert values.dtype == np.int32
        np.testing.assert_array_equal(values, want_values)
        np.testing.assert_array_equal(offsets, want_offsets)


@pytest.mark.parametrize("value_type, dtype", [(pa.int64(), np.int32), (pa.int32(), np.int32),
                                               (pa.uint16(), np.uint16),
                                               (pa.uint32(), np.uint32)])
def test_parquet_dtypes_and_row_groups(tmp_path, value_type, dtype):
    path = write_parquet(tmp_path / "a.parquet", SEQS, value_type=value_type)  # 3+ row groups
    values, offsets = readers.read_file(path, "parquet", ReadOptions())
    want_values, want_offsets = ragged(SEQS)
    assert values.dtype == dtype
    np.testing.assert_array_equal(values, want_values)
    np.testing.assert_array_equal(offsets, want_offsets)


def test_parquet_large_list_and_big_ids(tmp_path):
    import pyarrow.parquet as pq

    path = tmp_path / "big.parquet"
    seqs = [[1, 2**40], [3]]
    pq.write_table(pa.table({"tokens": pa.array(seqs, pa.large_list(pa.int64()))}), path)
    values, offsets = readers.read_file(str(path), "parquet", ReadOptions())
    assert values.dtype == np.int64 and values.tolist() == [1, 2**40, 3]
    assert offsets.tolist() == [0, 2, 3]


def test_several_files_concatenate_in_order(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", SEQS[:50])
    b = write_parquet(tmp_path / "b.parquet", SEQS[50:], value_type=pa.uint16())
    corpus = read_corpus([a, b], ReadOptions())
    want_values, want_offsets = ragged(SEQS)
    np.testing.assert_array_equal(corpus.values, want_values)
    np.testing.assert_array_equal(corpus.offsets, want_offsets)
    assert [f["format"] for f in corpus.files] == ["jsonl", "parquet"]
    assert corpus.files[1]["num_tokens"] == sum(map(len, SEQS[50:]))


def test_text_units_and_bytes(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(b"ab\n\ncd e\n")
    values, offsets = text.read_text(str(path), None, "line")
    assert bytes(values) == b"abcd e" and offsets.tolist() == [0, 2, 6]
    values, offsets = text.read_text(str(path), None, "file")
    assert bytes(values) == b"ab\n\ncd e\n" and offsets.tolist() == [0, 9]


def test_fingerprint_sees_same_size_edits_at_either_end(tmp_path):
    path = tmp_path / "f.bin"
    data = bytearray(np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8))
    path.write_bytes(bytes(data))
    base = fingerprint(str(path))
    assert base["size"] == 3 << 20 and base["path"] == str(path)
    for pos in (10, len(data) - 10):
        edited = bytearray(data)
        edited[pos] ^= 1
        path.write_bytes(bytes(edited))
        assert fingerprint(str(path))["sha256"] != base["sha256"]
    path.write_bytes(bytes(data))
    assert fingerprint(str(path)) == base


def test_unknown_format_or_unit_is_an_input_error():
    with pytest.raises(InputError, match="csv"):
        ReadOptions(input_format="csv")
    with pytest.raises(InputError, match="sentence"):
        ReadOptions(text_unit="sentence")
    with pytest.raises(InputError, match="no input files"):
        read_corpus([], ReadOptions())


def test_read_text_paragraphs(tmp_path):
    path = tmp_path / "p.txt"
    path.write_bytes(b"a b\ncd\n\n\n  \nxyz\n\nq")
    values, offsets = text.read_text(str(path), None, "paragraph")
    chunks = [bytes(values[offsets[i] : offsets[i + 1]]) for i in range(offsets.size - 1)]
    assert chunks == [b"a b\ncd", b"xyz", b"q"]


@pytest.mark.parametrize("unit, want", [("line", [b"a b", b"cd", b"xyz"]),
                                        ("paragraph", [b"a b\ncd", b"xyz"])])
def test_windows_text_reads_as_unix_text(tmp_path, unit, want):
    """A byte order mark is dropped, and CRLF ends lines as LF does."""
    for name, data in (("unix", b"a b\ncd\n\nxyz\n"),
                       ("windows", b"\xef\xbb\xbfa b\r\ncd\r\n\r\nxyz\r\n")):
        (tmp_path / f"{name}.txt").write_bytes(data)
        values, offsets = text.read_text(str(tmp_path / f"{name}.txt"), None, unit)
        got = [bytes(values[offsets[i] : offsets[i + 1]]) for i in range(offsets.size - 1)]
        assert got == want, name


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([b"{}", b"", b" ", b"\t", b"\r", b" {}", b"{} "]), max_size=12),
       st.booleans())
def test_jsonl_blocks_count_their_non_blank_lines(lines, final_newline):
    from seqpack.pipelines.formats.jsonl import _nonblank_lines

    block = b"\n".join(lines) + (b"\n" if final_newline and lines else b"")
    assert _nonblank_lines(block) == sum(1 for line in block.split(b"\n") if line.strip())
