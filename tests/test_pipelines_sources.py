"""Sources and the SQP1 record encoding: round trips, zero copy, bad records named by file+index."""

from __future__ import annotations

import json
import pickle

import grain
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack import packer
from seqpack.pipelines.datasets import (
    ArrayRecordSource,
    ArraySource,
    JsonlSource,
    PackedArrayRecordSource,
    ParquetSource,
    SequentialIterDataset,
)
from seqpack.pipelines.formats.records import decode_row, encode_row
from tests.helpers.files import write_manifest
from tests.helpers.pipelines import ensure_flags_parsed

ensure_flags_parsed()
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
ar = pytest.importorskip("array_record.python.array_record_module")

DTYPES = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
          np.float16, np.float32, np.float64]


def _sequences(seed: int, n: int = 40) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 30000, rng.integers(0, 50)).astype(np.int32) for _ in range(n)]


def _write_arrayrecord(path, records: list[bytes]) -> None:
    w = ar.ArrayRecordWriter(str(path), "group_size:1")
    for r in records:
        w.write(r)
    w.close()


# ---- records ---------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(DTYPES),
                          st.lists(st.integers(0, 5), min_size=0, max_size=3)),
                min_size=0, max_size=6),
       st.integers(0, 2**31))
def test_records_round_trip(specs, seed):
    rng = np.random.default_rng(seed)
    row = {f"k{i}_é": (rng.random(shape) * 100).astype(dt) for i, (dt, shape) in enumerate(specs)}
    buf = encode_row(row)
    assert len(buf) % 8 == 0
    out = decode_row(buf)
    assert list(out) == list(row)
    for k in row:
        assert out[k].dtype == row[k].dtype and out[k].shape == row[k].shape
        np.testing.assert_array_equal(out[k], row[k])


def test_records_zero_copy_and_aligned():
    row = {"tokens": np.arange(11, dtype=np.uint16), "tokens_segment_ids": np.ones(11, np.int32),
           "segment_source_index": np.arange(3, dtype=np.int64)}
    buf = bytearray(encode_row(row))
    out = decode_row(buf)
    base = np.frombuffer(buf, np.uint8).ctypes.data
    for k, v in out.items():
        assert np.shares_memory(v, np.frombuffer(buf, np.uint8)), k
        assert (v.ctypes.data - base) % 8 == 0, k
    buf[-8] ^= 0xFF  # the views see changes to the buffer: no copy was made
    assert out["segment_source_index"][-1] != 2


def test_records_reject_corrupt_and_truncated():
    buf = encode_row({"tokens": np.arange(5, dtype=np.int32), "m": np.ones((2, 3), np.float32)})
    for cut in range(len(buf)):  # every proper prefix is a truncated record
        with pytest.raises(ValueError):
            decode_row(buf[:cut])
    with pytest.raises(ValueError, match="not an SQP1"):
        decode_row(b"XXXX" + buf[4:])
    with pytest.raises(ValueError, match="trailing"):
        decode_row(buf + b"\0" * 8)
    bad_dtype = bytearray(buf)
    i = bad_dtype.index(b"<i4")
    bad_dtype[i : i + 3] = b"|O8"
    with pytest.raises(ValueError, match="dtype"):
        decode_row(bytes(bad_dtype))
    with pytest.raises(ValueError, match="dtype"):
        encode_row({"x": np.array(["a"], dtype=object)})


# ---- in-memory + sequential ----------------------------------------------------------------


def test_array_source_round_trip_and_state():
    seqs = _sequences(0)
    src = ArraySource.from_sequences(seqs)
    assert len(src) == len(seqs)
    for i in (0, 7, len(seqs) - 1, -1):
        np.testing.assert_array_equal(src[i]["tokens"], seqs[i])
    it = iter(SequentialIterDataset(src))
    for _ in range(5):
        next(it)
    state = it.get_state()
    rest = [e["tokens"] for e in it]
    it2 = iter(SequentialIterDataset(src))
    it2.set_state(state)
    for a, b in zip([e["tokens"] for e in it2], rest, strict=True):
        np.testing.assert_array_equal(a, b)
    assert len(rest) == len(seqs) - 5


def test_array_source_several_columns():
    src = ArraySource({"inputs": (np.arange(6), [0, 2, 6]), "targets": (np.arange(3), [0, 1, 3]),
                       "id": np.array([10, 11])})
    e = src[1]
    np.testing.assert_array_equal(e["inputs"], [2, 3, 4, 5])
    np.testing.assert_array_equal(e["targets"], [1, 2])
    assert e["id"] == 11
    with pytest.raises(ValueError, match="holds 3 examples"):
        ArraySource({"a": (np.arange(6), [0, 2, 6]), "b": np.arange(3)})


@pytest.mark.slow
def test_sequential_slicing_under_mp_prefetch():
    seqs = _sequences(1, n=30)
    ds = SequentialIterDataset(ArraySource.from_sequences(seqs)).map(
        lambda e: {"tokens": e["tokens"], "n": np.int64(e["tokens"].size)})
    out = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=2))
    it = iter(out)
    got = sorted(tuple(e["tokens"].tolist()) for e in it)
    it.close()
    assert got == sorted(tuple(s.tolist()) for s in seqs)


# ---- JSONL -----------------------------------------------------------------------------------


def test_jsonl_round_trip(tmp_path):
    seqs = _sequences(2)
    paths = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    paths[0].write_text("".join(json.dumps({"tokens": s.tolist(), "id": i}) + "\n"
                                for i, s in enumerate(seqs[:25])) + "\n")
    lines = [json.dumps({"ids": [], "id": 25 + i, "tokens": s.tolist()})
             for i, s in enumerate(seqs[25:])]
    paths[1].write_text("\n".join(lines))  # no trailing newline
    src = JsonlSource(paths, extra_fields=("id",))
    assert len(src) == len(seqs)
    for i, s in enumerate(seqs):
        e = src[i]
        assert e["tokens"].dtype == np.int32 and int(e["id"]) == i
        np.testing.assert_array_equal(e["tokens"], s)
    src2 = pickle.loads(pickle.dumps(src))  # picklable for worker processes
    np.testing.assert_array_equal(src2[30]["tokens"], seqs[30])


@pytest.mark.parametrize("line,match", [
    ('[1, 2, 3]', "expected a JSON object"),
    ('{"ids": [1, 2]}', "field 'tokens' is missing"),
    ('{"tokens": "1 2 3"}', "must be a list"),
    ('{"tokens": [1, 2.5, 3]}', r"tokens\[1\]=2.5 is not a non-negative integer"),
    ('{"tokens": [1, true]}', r"tokens\[1\]=True is not a non-negative integer"),
    ('{"tokens": [1, -4]}', r"tokens\[1\]=-4 is not a valid token id"),
    ('{"tokens": [1, 99999999999]}', r"tokens\[1\]=99999999999 is not a valid"),
    ('{"tokens": [1, 2', "not valid JSON"),
])
def test_jsonl_bad_records_name_file_and_line(tmp_path, line, match):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"tokens": [1]}\n\n{"tokens": [2]}\n' + line + "\n")
    src = JsonlSource(path)
    assert len(src) == 3  # the blank line is not a record
    src[1]
    with pytest.raises(ValueError, match=match) as e:
        src[2]
    assert f"{path}:4 (record 2)" in str(e.value)


def test_jsonl_lines_of_white_space_are_not_records(tmp_path):
    """As the offline reader skips them (a CRLF file's blank line is "\\r")."""
    path = tmp_path / "crlf.jsonl"
    path.write_bytes(b'{"tokens": [1, 2]}\r\n\r\n   \n\t\n{"tokens": [3]}\r\n')
    src = JsonlSource(path)
    assert len(src) == 2 and src[1]["tokens"].tolist() == [3]


# ---- Parquet ---------------------------------------------------------------------------------


def _write_parquet(path, seqs, *, row_group_size=7, value_type=None, extra=None):
    value_type = value_type or pa.int32()
    cols = {"tokens": pa.array([s.tolist() for s in seqs], type=pa.list_(value_type))}
    if extra is not None:
        cols["id"] = pa.array(extra, type=pa.int64())
    pq.write_table(pa.table(cols), path, row_group_size=row_group_size)


def test_parquet_round_trip(tmp_path):
    seqs = _sequences(3, n=50)
    _write_parquet(tmp_path / "a.parquet", seqs[:20], extra=list(range(20)))
    _write_parquet(tmp_path / "b.parquet", seqs[20:], extra=list(range(20, 50)),
                   value_type=pa.int64())
    src = ParquetSource([tmp_path / "a.parquet", tmp_path / "b.parquet"], extra_columns=("id",),
                        cache_row_groups=2)
    assert len(src) == 50
    for i in [0, 6, 7, 19, 20, 49, 3, 27]:  # across row groups and files, out of order
        e = src[i]
        np.testing.assert_array_equal(e["tokens"], seqs[i])
        assert int(e["id"]) == i
    src2 = pickle.loads(pickle.dumps(src))
    np.testing.assert_array_equal(src2[45]["tokens"], seqs[45])


def test_parquet_bad_records_name_file_and_record(tmp_path):
    p = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"tokens": pa.array([[1], [2], None, [3]], pa.list_(pa.int32()))}), p,
                   row_group_size=2)
    src = ParquetSource(p)
    src[1]
    with pytest.raises(ValueError, match=f"{p} record 2: column 'tokens' is null"):
        src[2]
    p = tmp_path / "nulltok.parquet"
    pq.write_table(pa.table({"tokens": pa.array([[1], [2, None]], pa.list_(pa.int32()))}), p)
    with pytest.raises(ValueError, match=f"{p} record 1: a token id is null"):
        ParquetSource(p)[0]
    p = tmp_path / "neg.parquet"
    pq.write_table(pa.table({"tokens": pa.array([[1], [2], [5, -3]], pa.list_(pa.int32()))}), p)
    with pytest.raises(ValueError, match=f"{p} record 2: token id -3 is negative"):
        ParquetSource(p)[0]
    p = tmp_path / "float.parquet"
    pq.write_table(pa.table({"tokens": pa.array([[1.0], [2.0, 2.5]], pa.list_(pa.float64()))}), p)
    with pytest.raises(ValueError, match=f"{p} record 1: token 2.5"):
        ParquetSource(p)
    p = tmp_path / "str.parquet"
    pq.write_table(pa.table({"tokens": pa.array(["1 2", "3"])}), p)
    with pytest.raises(ValueError, match=f"{p}: column 'tokens' has type string"):
        ParquetSource(p)
    with pytest.raises(ValueError, match=f"{p}: column 'ids' is missing"):
        ParquetSource(p, column="ids")


# ---- ArrayRecord -----------------------------------------------------------------------------


def _packed_rows(seed: int, config: packer.PackConfig):
    seqs = [s[: config.seq_len] for s in _sequences(seed, n=60)]
    batch = packer.pack(seqs, config)
    return [{k: v[r] for k, v in batch.items()} for r in range(len(batch["tokens"]))]


def test_packed_arrayrecord_round_trip_with_manifest(tmp_path):
    config = packer.PackConfig(64, max_segments=8)
    rows = _packed_rows(4, config)
    half = len(rows) // 2
    _write_arrayrecord(tmp_path / "rows-00000.arrayrecord", [encode_row(r) for r in rows[:half]])
    _write_arrayrecord(tmp_path / "rows-00001.arrayrecord", [encode_row(r) for r in rows[half:]])
    write_manifest(tmp_path, ["rows-00000.arrayrecord", "rows-00001.arrayrecord"],
                   [half, len(rows) - half], seq_len=64, max_segments=8)
    for src in (PackedArrayRecordSource(tmp_path),
                PackedArrayRecordSource([tmp_path / "rows-00000.arrayrecord",
                                         tmp_path / "rows-00001.arrayrecord"])):
        assert len(src) == len(rows)
        got = [src[i] for i in range(len(src))]
        for a, b in zip(got, rows, strict=True):
            assert set(a) == set(b)
            for k in a:
                np.testing.assert_array_equal(a[k], b[k])
                assert a[k].dtype == b[k].dtype
        packer.validate({k: np.stack([r[k] for r in got]) for k in got[0]}, config)
    src = pickle.loads(pickle.dumps(PackedArrayRecordSource(tmp_path)))
    np.testing.assert_array_equal(src[half]["tokens"], rows[half]["tokens"])


def test_arrayrecord_bad_records_name_file_and_index(tmp_path):
    config = packer.PackConfig(32, max_segments=4)
    rows = _packed_rows(5, config)
    good = [encode_row(r) for r in rows[:3]]
    path = tmp_path / "bad.arrayrecord"
    _write_arrayrecord(path, good + [good[0][:-8], b"junk", encode_row({"x": np.arange(3)})])
    raw = ArrayRecordSource(path)
    np.testing.assert_array_equal(raw[2]["tokens"], rows[2]["tokens"])
    with pytest.raises(ValueError, match=f"{path} record 3: record .*truncated|{path} record 3: "
                                         "record has"):
        raw[3]
    with pytest.raises(ValueError, match=f"{path} record 4: record is 4 bytes"):
        raw[4]
    packed = PackedArrayRecordSource(path)
    with pytest.raises(ValueError, match=f"{path} record 5: packed row lacks"):
        packed[5]
    write_manifest(tmp_path, ["bad.arrayrecord"], [6], seq_len=64, max_segments=4)
    with pytest.raises(ValueError, match=f"{path} record 0: packed row has L=32"):
        PackedArrayRecordSource(tmp_path)[0]
