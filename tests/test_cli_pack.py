"""`seqpack pack` via click's CliRunner: every input format and flag, shards, manifest, resume."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from seqpack.packer import PackConfig, pack_ragged
from seqpack.packer.inputs import ragged_from_sequences
from seqpack.pipelines.formats import encodings
from seqpack.pipelines.formats.manifest import INTENT
from seqpack.pipelines.formats.records import decode_row, encode_row
from seqpack.pipelines.offline.shards import read_shard
from tests.helpers.files import (
    dir_bytes,
    invoke,
    random_seqs,
    write_arrayrecord,
    write_jsonl,
    write_parquet,
    write_tokenizer,
)

SEQS = random_seqs(300, max_len=40, seed=1)


def all_rows(out) -> dict[str, np.ndarray]:
    manifest = json.loads((out / "manifest.json").read_text())
    shards = [read_shard(str(out), n) for n in manifest["shards"]]
    return {k: np.concatenate([s[k] for s in shards]) for k in shards[0]}


def expected_rows(seqs, **config) -> dict[str, np.ndarray]:
    values, offsets = ragged_from_sequences([np.asarray(s, np.int32) for s in seqs])
    return pack_ragged(values, offsets, PackConfig(**config))


def assert_same_rows(got, want):
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
        assert got[k].dtype == want[k].dtype, k


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "arrayrecord"])
def test_pack_each_format_gives_the_packers_rows(tmp_path, fmt):
    write = {"jsonl": write_jsonl, "parquet": write_parquet, "arrayrecord": write_arrayrecord}
    src = write[fmt](tmp_path / f"in.{fmt}", SEQS)
    out = tmp_path / "out"
    invoke("pack", src, "-o", out, "--row-order", "plan",
           "--seq-len", 64, "--max-segments", 8, "--shard-rows", 7)
    manifest = json.loads((out / "manifest.json").read_text())
    want = expected_rows(SEQS, seq_len=64, max_segments=8)
    assert_same_rows(all_rows(out), want)
    assert manifest["format"] == "seqpack-rows" and manifest["record_encoding"] == "SQP1"
    assert manifest["num_rows"] == want["tokens"].shape[0] == sum(manifest["shard_num_rows"])
    assert len(manifest["shards"]) == -(-manifest["num_rows"] // 7)
    assert manifest["shard_num_rows"][:-1] == [7] * (len(manifest["shards"]) - 1)
    assert sorted(os.listdir(out)) == sorted(manifest["shards"] + ["manifest.json"])
    assert manifest["inputs"]["files"][0]["format"] == fmt
    assert manifest["inputs"]["num_examples"] == len(SEQS)
    assert manifest["stats"]["counters"]["num_examples"] == len(SEQS)
    assert manifest["stats"]["real_tokens"] == sum(map(len, SEQS))


def test_records_are_sqp1_rows_byte_for_byte(tmp_path):
    from array_record.python.array_record_module import ArrayRecordReader

    out = tmp_path / "out"
    invoke("pack", write_jsonl(tmp_path / "a.jsonl", SEQS), "-o", out, "--row-order", "plan",
           "--seq-len", 50,
           "--max-segments", 4, "--shard-rows", 1000)
    want = expected_rows(SEQS, seq_len=50, max_segments=4)
    reader = ArrayRecordReader(str(next(out.glob("rows-*"))))
    raws = reader.read_all()
    assert len(raws) == want["tokens"].shape[0]
    derived = {"tokens_segment_ids", "tokens_positions"}
    for r, raw in enumerate(raws):
        stored = decode_row(raw, restore=False)
        assert set(want) - set(stored) == derived  # rebuilt on read, not stored
        assert raw == encode_row(dict(stored))
        assert raw == encode_row({k: want[k][r] for k in stored})
        full = decode_row(raw)  # the full contract row, derived arrays rebuilt
        assert set(full) == set(want)
        for k in want:
            np.testing.assert_array_equal(full[k], want[k][r], err_msg=k)
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["stored_keys"]) == set(want) - derived


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32, np.int64])
def test_row_encoder_matches_encode_row(dtype):
    seqs = [np.arange(n, dtype=dtype) % 200 for n in (3, 9, 1, 12, 0, 5)]
    values, offsets = ragged_from_sequences(seqs)
    batch = pack_ragged(values, offsets, PackConfig(16, max_segments=3))
    enc = encodings.RowEncoder(batch)
    records = list(enc.records(batch))
    assert [decode_row(r)["tokens"].dtype for r in records] == [np.dtype(dtype)] * len(records)
    assert records == [encode_row({k: v[r] for k, v in batch.items()})
                       for r in range(batch["tokens"].shape[0])]


def test_packed_dir_reads_with_the_grain_source(tmp_path):
    from seqpack.pipelines.datasets import PackedArrayRecordSource

    out = tmp_path / "out"
    invoke("pack", write_parquet(tmp_path / "a.parquet", SEQS), "-o", out, "--row-order", "plan",
           "--seq-len", 64,
           "--max-segments", 8, "--shard-rows", 10)
    src = PackedArrayRecordSource(str(out))
    want = expected_rows(SEQS, seq_len=64, max_segments=8)
    assert len(src) == want["tokens"].shape[0]
    for r in (0, 13, len(src) - 1):
        for k in want:
            np.testing.assert_array_equal(src[r][k], want[k][r])


@pytest.mark.parametrize("strategy", ["best_fit_decreasing", "best_fit", "first_fit",
                                      "concat_split"])
@pytest.mark.parametrize("overflow", ["truncate", "split", "drop"])
def test_strategy_and_overflow_then_verify(tmp_path, strategy, overflow):
    seqs = SEQS + [list(range(90)), list(range(200, 331))]  # two over-length examples
    src = write_jsonl(tmp_path / "a.jsonl", seqs)
    out = tmp_path / "out"
    policy = ["--overflow", overflow]
    if strategy == "concat_split":  # it cuts examples itself: an --overflow is refused
        result = invoke("pack", src, "-o", out, "--strategy", strategy, *policy, ok=False)
        assert result.exit_code == 2 and f"--overflow {overflow} does not apply to --strategy " \
            "concat_split" in result.stderr
        policy = []
    invoke("pack", src, "-o", out, "--row-order", "plan",
           "--seq-len", 64, "--max-segments", 6, "--strategy", strategy,
           *policy, "--shard-rows", 9)
    want = expected_rows(seqs, seq_len=64, max_segments=6, strategy=strategy, overflow=overflow)
    assert_same_rows(all_rows(out), want)
    counters = json.loads((out / "manifest.json").read_text())["stats"]["counters"]
    if strategy != "concat_split" and overflow == "truncate":
        assert counters["truncated_tokens"] == (90 - 64) + (131 - 64)
    if strategy != "concat_split" and overflow == "drop":
        assert counters["dropped_tokens"] == 90 + 131
    result = invoke("verify", out, src)
    assert result.stdout.startswith("OK:")


def test_alignment_pad_id_feature_and_compression(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", SEQS)
    out = tmp_path / "out"
    invoke("pack", src, "-o", out, "--row-order", "plan",
           "--seq-len", 64, "--max-segments", 8, "--segment-alignment",
           8, "--pad-id", 7, "--feature", "ids", "--compression", "zstd")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"] == PackConfig(64, max_segments=8, segment_alignment=8, pad_id=7,
                                            feature="ids").to_dict()
    assert manifest["writer_options"] == "group_size:1,zstd:3"
    want = expected_rows(SEQS, seq_len=64, max_segments=8, segment_alignment=8, pad_id=7,
                         feature="ids")
    got = all_rows(out)
    assert_same_rows(got, want)
    used = got["ids_segment_lengths"] > 0
    assert (got["ids_segment_offsets"][used] % 8 == 0).all() and used.sum() > len(SEQS) // 2
    assert invoke("verify", out).stdout.startswith("OK:")


def test_text_inputs_with_tokenizer_and_bytes(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("the cat sat on a mat\n\nthe dog ran\nzebra the\n")
    tok = write_tokenizer(tmp_path / "tokenizer.json")
    out = tmp_path / "out"
    invoke("pack", text, "-o", out, "--row-order", "plan",
           "--seq-len", 8, "--max-segments", 4, "--tokenizer", tok,
           "--text-unit", "line")
    want = expected_rows([[1, 2, 3, 4, 5, 6], [1, 7, 8], [0, 1]], seq_len=8, max_segments=4)
    assert_same_rows(all_rows(out), want)
    invoke("pack", text, "-o", out, "--row-order", "plan",
           "--seq-len", 64, "--overwrite")  # bytes, whole file
    rows = all_rows(out)
    assert rows["tokens"].dtype == np.uint8
    assert bytes(rows["tokens"][0][: rows["tokens_segment_lengths"][0, 0]]) == text.read_bytes()
    assert invoke("verify", out).stdout.startswith("OK:")


def test_several_inputs_number_examples_across_files(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", SEQS[:100])
    b = write_parquet(tmp_path / "b.parquet", SEQS[100:])
    out = tmp_path / "out"
    invoke("pack", a, b, "-o", out, "--row-order", "plan", "--seq-len", 64, "--max-segments", 8)
    assert_same_rows(all_rows(out), expected_rows(SEQS, seq_len=64, max_segments=8))
    files = json.loads((out / "manifest.json").read_text())["inputs"]["files"]
    assert [f["num_examples"] for f in files] == [100, len(SEQS) - 100]


def test_json_output_and_table(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", SEQS)
    result = invoke("pack", src, "-o", tmp_path / "o1", "--seq-len", 64, "--json")
    stats = json.loads(result.stdout)["stats"]
    manifest = json.loads((tmp_path / "o1" / "manifest.json").read_text())
    assert stats == manifest["stats"]
    table = invoke("pack", src, "-o", tmp_path / "o2", "--seq-len", 64, "--batch-size", 5).stdout
    rows = manifest["num_rows"]
    assert f"{stats['efficiency']:.2%}" in table
    steps = next(line for line in table.splitlines() if line.startswith("steps / epoch"))
    assert steps.startswith("steps / epoch (batch 5)") and steps.endswith(f" {rows // 5:,}")
    assert "step: ranks' max / mean" not in table  # rows shuffled: no steps to report
    # balanced steps: the pack's table and `seqpack stats OUT` report the ranks' max / mean
    args = ["--seq-len", 64, "--data-parallel", 4, "--batch-size", 2, "--d-model", 16]
    table = invoke("pack", src, "-o", tmp_path / "o3", *args).stdout
    balance = json.loads((tmp_path / "o3" / "manifest.json").read_text())["stats"]["step_balance"]
    for text in (table, invoke("stats", tmp_path / "o3").stdout):
        value = {line.strip().rsplit(None, 1)[0]: line.split()[-1]
                 for line in text.splitlines() if len(line.split()) > 1}
        assert value["step: ranks' max / mean"] == f"{balance['mean']:.3f}"
        assert value["rows in random order"] == f"{balance['random_order']['mean']:.3f}"


def test_existing_output_needs_overwrite_or_resume(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", SEQS)
    out = tmp_path / "out"
    invoke("pack", src, "-o", out, "--seq-len", 64)
    before = dir_bytes(out)
    result = invoke("pack", src, "-o", out, "--seq-len", 64, ok=False)
    assert result.exit_code == 2 and "--overwrite" in result.stderr
    result = invoke("pack", src, "-o", out, "--seq-len", 64, "--resume", "--overwrite", ok=False)
    assert result.exit_code == 2
    mtimes = {n: os.stat(out / n).st_mtime_ns for n in os.listdir(out)}
    invoke("pack", src, "-o", out, "--seq-len", 64, "--resume")  # complete: nothing rewritten
    assert {n: os.stat(out / n).st_mtime_ns for n in os.listdir(out)} == mtimes
    result = invoke("pack", src, "-o", out, "--seq-len", 64, "--max-segments", 3, "--resume",
                    ok=False)
    assert result.exit_code == 2 and "cannot resume" in result.stderr and "config" in result.stderr
    (out / "stray.txt").write_text("not ours")
    (out / "notes.tmp").write_text("not ours either")
    invoke("pack", src, "-o", out, "--seq-len", 128, "--overwrite", "--shard-rows", 5)
    assert (out / "stray.txt").exists() and (out / "notes.tmp").exists()
    assert dir_bytes(out) != before
    assert json.loads((out / "manifest.json").read_text())["seq_len"] == 128


def test_interrupted_run_resumes_to_the_same_bytes(tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "a.jsonl", SEQS)
    args = ["--seq-len", 64, "--max-segments", 8, "--shard-rows", 10, "--workers", 1]
    invoke("pack", src, "-o", tmp_path / "clean", *args)
    sqp1 = encodings.encoding("arrayrecord")
    real_open = sqp1.open_writer
    opened, fail_at = [], [4]

    def failing_open(path, options):
        opened.append(os.path.basename(path))
        if len(opened) == fail_at[0]:
            raise OSError(28, "No space left on device")
        return real_open(path, options)

    monkeypatch.setattr(sqp1, "open_writer", failing_open)
    out = tmp_path / "out"
    result = invoke("pack", src, "-o", out, *args, ok=False)
    assert result.exit_code == 2 and "No space left" in result.stderr
    names = sorted(os.listdir(out))
    assert "manifest.json" not in names and INTENT in names
    assert len([n for n in names if n.endswith(".arrayrecord")]) == 3
    (out / "rows-00003-of-00099.arrayrecord.tmp").write_bytes(b"half a shard")
    opened.clear()
    fail_at[0] = 0
    invoke("pack", src, "-o", out, *args, "--resume")
    names = json.loads((out / "manifest.json").read_text())["shards"]
    assert [o.rsplit(".", 2)[0] for o in opened] == names[3:]  # the 3 complete shards were kept
    assert dir_bytes(out) == dir_bytes(tmp_path / "clean")


def test_embedded_sample(tmp_path):
    out = tmp_path / "sample"
    result = invoke("pack", "-o", out, "--seq-len", 4096)
    assert "built-in sample" in result.stdout and "efficiency" in result.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    files = manifest["inputs"]["files"]
    assert len(files) > 50 and all(f["path"].endswith(".py") for f in files)
    assert manifest["config"]["overflow"] == "split"
    # One example per paragraph: the blank lines between paragraphs are not tokens.
    assert manifest["inputs"]["read_options"]["text_unit"] == "paragraph"
    assert manifest["inputs"]["num_examples"] > 10 * len(files)
    assert 0.8 * sum(f["size"] for f in files) < manifest["inputs"]["num_tokens"] < sum(
        f["size"] for f in files)
    st = manifest["stats"]  # many short examples: real packing, several segments per row
    assert st["efficiency"] > 0.95 and st["num_segments"] > 4 * st["num_rows"]
    assert invoke("verify", out).stdout.startswith("OK:")


def test_embedded_sample_without_output_uses_a_temporary_dir(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = invoke("pack", "--seq-len", 8192, "--json")
    out = json.loads(result.stdout)["output_dir"]
    assert out.startswith(str(tmp_path)) and os.path.isfile(os.path.join(out, "manifest.json"))


def test_resume_needs_an_interrupted_run(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", SEQS)
    other = tmp_path / "other"
    other.mkdir()
    (other / "data.txt").write_text("someone else's")
    result = invoke("pack", src, "-o", other, "--seq-len", 64, "--resume", ok=False)
    assert result.exit_code == 2 and "holds no interrupted run" in result.stderr
    fresh = tmp_path / "fresh"
    invoke("pack", src, "-o", fresh, "--seq-len", 64, "--resume")  # nothing there: a fresh run
    assert (fresh / "manifest.json").exists() and not (fresh / INTENT).exists()
