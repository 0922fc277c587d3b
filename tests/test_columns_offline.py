"""Several columns packed together offline: labels and masks under the tokens' segment layout.

`seqpack pack --column input_ids --column labels --pad labels=-100`: the first column is the
token feature (its lengths define the examples), each further one is packed at the same
positions under its own name with its own pad. Checked here: every segment of every column
equals its source slice and padding holds each column's pad (any worker count, the local and
the Beam steps alike), verify checks every column, and bad columns are refused.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.packer import PackConfig
from seqpack.pipelines.formats.inputs import ReadOptions
from seqpack.pipelines.offline import PackJob, WriteOptions
from seqpack.pipelines.offline.runners import pack_to_dir
from seqpack.pipelines.offline.shards import read_shard
from seqpack.pipelines.offline.verify import verify
from tests.helpers.files import dir_bytes, invoke, write_jsonl

CONFIG = PackConfig(32, max_segments=4, overflow="split")


def _sft(rng: np.random.Generator, n: int, max_len: int = 50):
    """n examples: token ids, labels (-100 on a prompt prefix, else the token), a 0/1 mask."""
    tokens, labels, masks = [], [], []
    for m in rng.integers(0, max_len + 1, n).tolist():
        t = rng.integers(0, 500, m)
        prompt = int(rng.integers(0, m + 1))
        lab = t.copy()
        lab[:prompt] = -100
        tokens.append(t.tolist())
        labels.append(lab.tolist())
        masks.append((np.arange(m) >= prompt).astype(int).tolist())
    return tokens, labels, masks


def _write(tmp_path, rng, n_files=2, n=40):
    """JSONL and Parquet inputs with `input_ids`, `labels`, `mask`; their columns, back to back."""
    paths, cols = [], {"input_ids": [], "labels": [], "mask": []}
    for i in range(n_files):
        tokens, labels, masks = _sft(rng, n)
        if i % 2:
            import pyarrow as pa
            import pyarrow.parquet as pq

            path = str(tmp_path / f"in{i}.parquet")
            pq.write_table(pa.table({
                "input_ids": pa.array(tokens, pa.list_(pa.int32())),
                "labels": pa.array(labels, pa.list_(pa.int32())),
                "mask": pa.array(masks, pa.list_(pa.int8()))}), path)
        else:
            path = str(tmp_path / f"in{i}.jsonl")
            with open(path, "w") as f:
                for t, lab, m in zip(tokens, labels, masks):
                    f.write(json.dumps({"input_ids": t, "labels": lab, "mask": m}) + "\n")
        paths.append(path)
        for name, values in zip(cols, (tokens, labels, masks)):
            cols[name] += values
    return paths, cols


def _job(paths, out, **kw) -> PackJob:
    return PackJob(paths, out, CONFIG, read_options=ReadOptions(
        column="input_ids", extra_columns=("labels", "mask")), pads={"labels": -100},
        write_options=WriteOptions(shard_rows=5), **kw)


def _rows(out) -> dict[str, np.ndarray]:
    manifest = json.loads((out / "manifest.json").read_text())
    parts = [read_shard(str(out), name, n)
             for name, n in zip(manifest["shards"], manifest["shard_num_rows"])]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _check_columns(rows: dict[str, np.ndarray], cols: dict[str, list], pads: dict[str, int]):
    """Every segment of every column is its source slice; everything else is the pad."""
    k = CONFIG.keys()
    L = CONFIG.seq_len
    covered = np.zeros(rows[k.values].shape, bool)
    for r, j in zip(*np.nonzero(rows[k.segment_lengths] > 0)):
        a, n = rows[k.segment_offsets][r, j], rows[k.segment_lengths][r, j]
        ex, s = rows[k.source_index][r, j], rows[k.source_start][r, j]
        covered[r, a : a + n] = True
        for key, name in ((k.values, "input_ids"), ("labels", "labels"), ("mask", "mask")):
            np.testing.assert_array_equal(rows[key][r, a : a + n], cols[name][ex][s : s + n])
    for key, pad in ((k.values, CONFIG.pad_id), *pads.items()):
        assert (rows[key][~covered] == pad).all(), key
    assert rows[k.values].shape[1] == L


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_every_column_of_every_segment_is_its_source_slice(tmp_path_factory, seed):
    tmp_path = tmp_path_factory.mktemp("cols")
    paths, cols = _write(tmp_path, np.random.default_rng(seed))
    manifest = pack_to_dir(_job(paths, tmp_path / "out", workers=1))
    rows = _rows(tmp_path / "out")
    _check_columns(rows, cols, {"labels": -100, "mask": 0})
    assert rows["labels"].dtype == rows["mask"].dtype == np.int32  # JSONL's int32 + Parquet's
    assert manifest.columns == [
        {"name": "labels", "source": "labels", "dtype": "<i4", "pad": -100, "role": "labels"},
        {"name": "mask", "source": "mask", "dtype": "<i4", "pad": 0, "role": "mask"}]
    assert manifest.stored_keys[-2:] == ["labels", "mask"]
    assert verify(str(tmp_path / "out")).ok


def test_two_workers_and_the_beam_steps_write_the_same_bytes(tmp_path):
    from seqpack.pipelines.offline import steps as beam_steps

    paths, _ = _write(tmp_path, np.random.default_rng(1), n_files=3)
    pack_to_dir(_job(paths, tmp_path / "one", workers=1))
    pack_to_dir(_job(paths, tmp_path / "two", workers=2))
    assert dir_bytes(tmp_path / "one") == dir_bytes(tmp_path / "two")
    job = _job(paths, tmp_path / "steps", block_size=23)
    scans = [beam_steps.scan_file(i, p, job.read_options) for i, p in enumerate(paths)]
    summary, jobs = beam_steps.plan_in_process(scans, job)
    assert summary is not None
    by_shard: dict[int, list] = {}
    for file_job in jobs:
        for shard, part in beam_steps.route_file(file_job, job.read_options, summary.shard_rows,
                                                 summary.row_dtype):
            by_shard.setdefault(shard, []).append(part)
    rows = [(k, *beam_steps.write_shard_parts(k, parts, summary, job.output, CONFIG,
                                               write_options=job.write_options))
            for k, parts in by_shard.items()]
    beam_steps.finish_job(rows, summary, job.output)
    pack_to_dir(_job(paths, tmp_path / "blocked", block_size=23, workers=1))
    assert dir_bytes(tmp_path / "steps") == dir_bytes(tmp_path / "blocked")


def _rewrite_shard(out, name: str, rows: dict[str, np.ndarray]) -> None:
    """Writes `rows` as shard `name` and re-signs the manifest (a damage verify cannot tell
    from its digests: only the rows themselves show it)."""
    from array_record.python.array_record_module import ArrayRecordWriter

    from seqpack.pipelines.formats.manifest import file_digest, signed
    from seqpack.pipelines.formats.records import encode_row

    w = ArrayRecordWriter(str(out / name), "group_size:1,uncompressed")
    for i in range(next(iter(rows.values())).shape[0]):
        w.write(encode_row({k: v[i] for k, v in rows.items()}))
    w.close()
    manifest = json.loads((out / "manifest.json").read_text())
    i = manifest["shards"].index(name)
    manifest["shard_bytes"][i], manifest["shard_sha256"][i] = file_digest(str(out / name))
    (out / "manifest.json").write_text(json.dumps(signed(manifest)))


@pytest.mark.parametrize("column,where", [("labels", "segment"), ("mask", "padding")])
def test_verify_checks_every_column(tmp_path, column, where):
    paths, _ = _write(tmp_path, np.random.default_rng(2))
    out = tmp_path / "out"
    pack_to_dir(_job(paths, out, workers=1))
    name = json.loads((out / "manifest.json").read_text())["shards"][-1]  # has padding
    rows = {k: v.copy() for k, v in read_shard(str(out), name, restore=False).items()}
    covered = rows["labels"] != -100 if where == "segment" else \
        np.arange(CONFIG.seq_len)[None] >= rows["tokens_segment_lengths"].sum(1)[:, None]
    r, j = np.argwhere(covered)[0]
    rows[column][r, j] += 1
    _rewrite_shard(out, name, rows)
    report = verify(str(out))
    assert not report.ok
    want = f"{name} row {r} " + ("slot" if where == "segment" else f"position {j}: mask padding")
    assert any(want in v and column in v for v in report.violations), report.violations


def test_the_cli_packs_labels_and_refuses_bad_columns(tmp_path):
    good = write_jsonl(tmp_path / "a.jsonl", [[1, 2, 3], [4]], field="input_ids")
    with open(good, "w") as f:
        f.write('{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}\n')
        f.write('{"input_ids": [4, 5], "labels": [-100, 5]}\n')
    out = tmp_path / "out"
    said = invoke("pack", good, "-o", out, "--seq-len", 8, "--column", "input_ids", "--column",
                  "labels", "--workers", 1).stdout
    # the first column keeps its name as the row key; labels are padded with -100 by default,
    # and the run says so
    assert "key 'input_ids', column 'labels' (labels, padded with -100)" in said
    row = json.loads(invoke("inspect", out, "--row", 0, "--json").output)
    assert row["input_ids"] == [1, 2, 3, 4, 5, 0, 0, 0] and "tokens" not in row
    assert row["labels"] == [-100, 2, 3, -100, 5, -100, -100, -100]
    cut = json.loads(invoke("inspect", out, "--row", 0, "--json", "--start", 2, "--count", 3
                            ).output)
    assert cut["input_ids"] == [3, 4, 5] and cut["labels"] == [3, -100, 5]
    assert cut["input_ids_segment_lengths"] == row["input_ids_segment_lengths"]  # [S]: whole
    text = invoke("inspect", out, "--row", 0).output
    assert "labels" in text and "-100" in text
    assert invoke("verify", out).output.startswith("OK:")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2], "labels": [1]}\n')
    result = invoke("pack", bad, "-o", tmp_path / "o2", "--column", "input_ids", "--column",
                    "labels", ok=False)
    assert result.exit_code == 2 and "bad.jsonl:1" in result.stderr and "'labels' holds 1" \
        in result.stderr and "holds 2" in result.stderr
    for args, needle in ((["--pad", "mask=0"], "--pad mask=...: 'mask' is not an extra column "
                                               "(--column ['labels'])"),
                         (["--pad", "labels"], "must be NAME=INTEGER"),
                         (["--pad", "labels=-1", "--pad", "labels=-100"],
                          "--pad gives 'labels' twice"),
                         (["--role", "labels=loss"], "the role must be one of"),
                         (["--column", "input_ids_segment_lengths"], "already have a key")):
        result = invoke("pack", good, "-o", tmp_path / "o3", "--column", "input_ids",
                        "--column", "labels", *args, ok=False)
        assert result.exit_code == 2 and needle in result.stderr, result.stderr


@pytest.mark.slow
def test_the_beam_job_packs_every_column_as_locally(tmp_path):
    pytest.importorskip("apache_beam")
    from seqpack.pipelines.offline.runners import pack_beam

    paths, _ = _write(tmp_path, np.random.default_rng(3), n_files=3)
    pack_to_dir(_job(paths, tmp_path / "local", workers=1))
    pack_beam(_job(paths, tmp_path / "beam", workers=2), quiet=True)
    assert dir_bytes(tmp_path / "beam") == dir_bytes(tmp_path / "local")
    assert verify(str(tmp_path / "beam")).ok


def test_the_training_pipeline_reads_the_columns_by_their_recorded_roles(tmp_path):
    pytest.importorskip("grain")
    from seqpack.pipelines.datasets import (
        Batching,
        LossTokens,
        PackedArrayRecordSource,
        make_training_pipeline,
    )

    paths, _ = _write(tmp_path, np.random.default_rng(4))
    out = tmp_path / "out"
    invoke("pack", *paths, "-o", out, "--seq-len", 32, "--max-segments", 4, "--overflow",
           "split", "--column", "input_ids", "--column", "labels", "--column", "mask",
           "--pad", "labels=-100", "--workers", 1)
    manifest = json.loads((out / "manifest.json").read_text())
    assert [(c["name"], c["role"]) for c in manifest["columns"]] == [("labels", "labels"),
                                                                    ("mask", "mask")]
    ds = make_training_pipeline(PackedArrayRecordSource(str(out)),
                                batch=Batching(4, shard_index=0, shard_count=1), shuffle_seed=0,
                                num_epochs=1)
    batch = next(iter(ds))
    assert batch["labels"].shape == batch["mask"].shape == batch["input_ids"].shape
    want = LossTokens(feature="input_ids", labels=("labels",), masks=("mask",)).count(batch)
    np.testing.assert_array_equal(batch["loss_tokens"], want)
    assert (want < LossTokens(feature="input_ids").count(batch)).all()  # prompts: no loss


@pytest.mark.parametrize("dtype,pad,want", [
    ("int8", 0, "int8"), ("int8", -100, "int8"), ("uint8", 0, "uint8"), ("uint8", -100, "int16"),
    ("int8", 200, "int16"), ("uint16", 70000, "uint32"), ("int32", -100, "int32"),
    ("int64", -100, "int64"), ("uint32", -100, "int64"),
    # Before: float64 rows (numpy's common type of int32 and uint64).
    ("int32", 5_000_000_000, "int64"), ("int16", 2**32, "int64"), ("uint8", 2**40, "uint64"),
    ("uint64", 5, "uint64"), ("int64", 2**63 - 1, "int64")])
def test_a_column_keeps_its_dtype_unless_its_pad_is_outside_it(dtype, pad, want):
    from seqpack.pipelines.offline.shards import row_dtype

    assert row_dtype(np.dtype(dtype), pad) == np.dtype(want)


@pytest.mark.parametrize("dtype,pad", [("uint64", -1), ("int64", 2**63), ("int32", 2**64)])
def test_a_pad_no_integer_type_holds_with_the_ids_is_refused(dtype, pad):
    from seqpack.pipelines.errors import InputError
    from seqpack.pipelines.offline.shards import row_dtype

    with pytest.raises(InputError, match=f"pad {pad} and the {dtype} ids of its column fit no"):
        row_dtype(np.dtype(dtype), pad)


def test_an_int8_mask_is_stored_as_int8(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "sft.parquet"
    pq.write_table(pa.table({"input_ids": pa.array([[5, 6, 7], [8, 9]], pa.list_(pa.int32())),
                             "mask": pa.array([[0, 1, 1], [1, 1]], pa.list_(pa.int8()))}), path)
    invoke("pack", path, "-o", tmp_path / "out", "--column", "input_ids", "--column", "mask",
           "--seq-len", 8)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert [c["dtype"] for c in manifest["columns"]] == ["|i1"]
    rows = read_shard(str(tmp_path / "out"), manifest["shards"][0])
    assert rows["mask"].dtype == np.int8 and rows["mask"][0].tolist() == [0, 1, 1, 1, 1, 0, 0, 0]
