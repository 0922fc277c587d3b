"""Several columns read together (`ReadOptions.extra_columns`): the token column defines the
examples and is checked as ids; every extra column comes back equal to its source, in its own
dtype, any sign; a record whose columns differ in length is refused naming file and record."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.pipelines.errors import InputError
from seqpack.pipelines.formats import inputs, jsonl
from seqpack.pipelines.formats.inputs import ReadOptions, read_corpus, read_lengths, scan_file
from seqpack.pipelines.formats.parquet import ParquetTokens

OPTIONS = ReadOptions(column="input_ids", extra_columns=("labels", "mask"))


def _write_jsonl(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


def _write_parquet(path, records, types):
    cols = {k: pa.array([r[k] for r in records], pa.list_(types[k])) for k in types}
    pq.write_table(pa.table(cols), path, row_group_size=max(1, len(records) // 2))
    return str(path)


def _write_arrayrecord(path, records, dtypes):
    from array_record.python.array_record_module import ArrayRecordWriter

    from seqpack.pipelines.formats.records import encode_row

    w = ArrayRecordWriter(str(path), "group_size:1")
    for r in records:
        w.write(encode_row({k: np.asarray(r[k], dtypes[k]) for k in dtypes}))
    w.close()
    return str(path)


def _examples(values, offsets):
    return [values[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]


@st.composite
def _records(draw):
    n = draw(st.integers(0, 12))
    wide = draw(st.booleans())  # labels beyond int32: JSONL's column becomes int64
    label = st.integers(-(2**40), 2**40) if wide else st.sampled_from([-100, 0, 5, 31999])
    out = []
    for _ in range(n):
        ids = draw(st.lists(st.integers(0, 50000), max_size=7))
        labels = [draw(st.one_of(st.just(-100), label)) for _ in ids]
        out.append({"input_ids": ids, "labels": labels, "mask": [int(x != -100) for x in labels],
                    "id": 1})
    return out


@settings(max_examples=20, deadline=None)
@given(_records(), _records())
def test_every_column_equals_its_source_in_every_format(tmp_path_factory, first, second):
    tmp = tmp_path_factory.mktemp("cols")
    fits32 = all(-(2**31) <= v < 2**31 for r in first for v in r["labels"])
    files = [
        _write_jsonl(tmp / "a.jsonl", first),
        _write_parquet(tmp / "b.parquet", second, {"input_ids": pa.uint16(),
                                                  "labels": pa.int64(), "mask": pa.int8()}),
        _write_arrayrecord(tmp / "c.arrayrecord", first, {"input_ids": np.int32,
                                                          "labels": np.int64, "mask": np.uint8}),
    ]
    source = first + second + first
    corpus = read_corpus(files, OPTIONS)
    assert _examples(corpus.values, corpus.offsets) == [r["input_ids"] for r in source]
    assert sorted(corpus.extra_values) == ["labels", "mask"]
    for name in ("labels", "mask"):
        assert _examples(corpus.extra_values[name], corpus.offsets) == [r[name] for r in source]
    scans = [scan_file(f, inputs.detect_format(f, None), OPTIONS) for f in files]
    want = [{"labels": np.int32 if fits32 else np.int64, "mask": np.int32},  # JSONL: narrowest
            {"labels": np.int64, "mask": np.int8}, {"labels": np.int64, "mask": np.uint8}]
    for scan, dtypes in zip(scans, want):
        if scan.info["num_tokens"]:  # (an empty file has no values to have a dtype)
            assert scan.extra_dtypes == {k: np.dtype(v) for k, v in dtypes.items()}
    labels = [v for r in source for v in r["labels"]]
    if labels:
        assert corpus.extra_values["labels"].dtype == np.int64
        has_first = any(r["input_ids"] for r in first)
        assert corpus.extra_values["mask"].dtype == (np.int32 if has_first else np.int8)
        assert min(s.extra_ranges["labels"][0] for s in scans if s.info["num_tokens"]) == \
            min(labels)
    # One-column reading is unchanged by the extra columns.
    alone = read_corpus(files, ReadOptions(column="input_ids"))
    assert alone.extra_values == {} and np.array_equal(alone.values, corpus.values)
    assert [f["sha256"] for f in alone.files] == [f["sha256"] for f in corpus.files]


def test_column_sinks_receive_each_chunk_beside_its_tokens(tmp_path, monkeypatch):
    monkeypatch.setattr(jsonl, "BLOCK_BYTES", 200)  # several chunks
    records = [{"input_ids": list(range(i % 5)), "labels": [-100] * (i % 5), "mask": [1] * (i % 5)}
               for i in range(60)]
    path = _write_jsonl(tmp_path / "a.jsonl", records)
    calls = {"tokens": [], "labels": [], "mask": []}
    scan = scan_file(path, "jsonl", OPTIONS, None, calls["tokens"].append,
                     column_sinks={n: calls[n].append for n in ("labels", "mask")})
    assert len(calls["tokens"]) > 1
    assert [t.size for t in calls["tokens"]] == [v.size for v in calls["labels"]] == \
        [v.size for v in calls["mask"]]
    assert np.concatenate(calls["labels"]).tolist() == [-100] * scan.info["num_tokens"]
    assert scan.extra_ranges == {"labels": (-100, -100), "mask": (1, 1)}
    with pytest.raises(ValueError, match="one sink per extra column"):
        scan_file(path, "jsonl", OPTIONS, None, None, column_sinks={"labels": print})


def _mismatch(records, k, name="labels"):
    records[k] = dict(records[k], **{name: records[k][name] + [7]})
    return records


def _good(n=9):
    return [{"input_ids": [1, 2, 3][: i % 4], "labels": [-100, 2, 3][: i % 4],
             "mask": [0, 1, 1][: i % 4]} for i in range(n)]


def test_columns_of_unequal_length_are_refused_naming_file_and_record(tmp_path):
    path = _write_jsonl(tmp_path / "a.jsonl", _mismatch(_good(), 6))
    message = r"a.jsonl:7: 'labels' holds 3 values but 'input_ids' holds 2"
    with pytest.raises(InputError, match=message):
        read_corpus([path], OPTIONS)
    with pytest.raises(InputError, match=message):  # a dry run reads every column too
        read_lengths([path], OPTIONS)
    types = {"input_ids": pa.int32(), "labels": pa.int32(), "mask": pa.int32()}
    path = _write_parquet(tmp_path / "a.parquet", _mismatch(_good(), 5, "mask"), types)
    with pytest.raises(InputError, match=r"a.parquet record 5: 'mask' holds 2 values but "
                                         r"'input_ids' holds 1"):
        list(ParquetTokens(path, "input_ids", aligned_columns=("labels", "mask")).chunks(2))
    dtypes = {"input_ids": np.int32, "labels": np.int32, "mask": np.int32}
    path = _write_arrayrecord(tmp_path / "a.arrayrecord", _mismatch(_good(), 3), dtypes)
    with pytest.raises(InputError, match=r"a.arrayrecord record 3: 'labels' holds 4 values"):
        read_corpus([path], OPTIONS)


@pytest.mark.parametrize("line, message", [
    ('{"input_ids": [1], "mask": [1]}', r":2: field 'labels' \(an extra column\) is missing"),
    ('{"input_ids": [1], "labels": [1.5], "mask": [1]}', r":2: labels\[0\]=1.5 is not an "
                                                          "integer"),
    ('{"input_ids": [1], "labels": [null], "mask": [1]}', r":2: labels\[0\]=None is not"),
    ('{"input_ids": [1], "labels": [-9223372036854775809], "mask": [1]}',
     r":2: labels\[0\]=-9223372036854775809 is not a valid value for int64"),
    ('{"input_ids": [-1], "labels": [1], "mask": [1]}', r":2: input_ids\[0\]=-1 is not a valid "
                                                         "token id"),
])
def test_bad_extra_values_are_refused_but_negative_ones_kept(tmp_path, line, message):
    path = tmp_path / "a.jsonl"
    path.write_text('{"input_ids": [4, 5], "labels": [-100, -7], "mask": [0, 1]}\n' + line + "\n")
    with pytest.raises(InputError, match=message):
        read_corpus([str(path)], OPTIONS)
    path.write_text('{"input_ids": [4, 5], "labels": [-100, -7], "mask": [0, 1]}\n')
    assert read_corpus([str(path)], OPTIONS).extra_values["labels"].tolist() == [-100, -7]


def test_parquet_extra_columns_must_be_integer_lists(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"input_ids": pa.array([[1, 2]], pa.list_(pa.int32())),
                             "labels": pa.array([[0.5, 1.0]], pa.list_(pa.float32())),
                             "mask": pa.array([[1, None]], pa.list_(pa.int8()))}), path)
    with pytest.raises(InputError, match=r"column 'labels' has type list<.*float>; an extra "
                                         "column must be a list of integers"):
        read_corpus([str(path)], OPTIONS)
    with pytest.raises(InputError, match=r"record 0: a value of column 'mask' is null"):
        read_corpus([str(path)], ReadOptions(column="input_ids", extra_columns=("mask",)))
    with pytest.raises(InputError, match=r"column 'nope' is missing"):
        read_corpus([str(path)], ReadOptions(column="input_ids", extra_columns=("nope",)))


def test_text_inputs_have_one_column(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("hello\n")
    with pytest.raises(InputError, match="a.txt: a text input has one column"):
        read_corpus([str(path)], ReadOptions(extra_columns=("labels",)))
