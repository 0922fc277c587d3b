"""Offline mixtures (`seqpack pack --mix`) end to end (the selection itself:
test_mixture_selection.py): each dataset's units against its target, the
repetition bound, `segment_dataset_id` in every format, verify, stats, resume, the CLI's errors;
the Beam and Spark runners (slow) write the local runner's bytes."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.packer import PackConfig
from seqpack.pipelines.errors import UsageError
from seqpack.pipelines.formats.inputs import ReadOptions
from seqpack.pipelines.offline import PackJob, WriteOptions, pack
from seqpack.pipelines.offline.mixture import MixSpec, hashed
from seqpack.pipelines.offline.shards import read_shard
from seqpack.pipelines.offline.verify import verify
from tests.helpers.cloud import s3, s3_server  # noqa: F401
from tests.helpers.files import dir_bytes, invoke, random_seqs, write_jsonl, write_parquet

CHAT = random_seqs(240, max_len=30, seed=1)  # short: 15 tokens on average, some empty
MATH = random_seqs(60, max_len=120, seed=2)  # long: 60 tokens on average
ARGS = ["--seq-len", 128, "--max-segments", 16, "--workers", 1, "--shard-rows", 16]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("mix")
    (d / "chat").mkdir()
    write_jsonl(d / "chat" / "a.jsonl", CHAT[:100])
    write_parquet(d / "chat" / "b.parquet", CHAT[100:])
    return d, str(d / "chat"), write_parquet(d / "math.parquet", MATH)


def _mix(data, *more):
    _, chat, math = data
    return ["--mix", f"chat={chat}", "--mix", f"math={math}", *more]


def _rows(out) -> dict[str, np.ndarray]:
    m = json.loads((out / "manifest.json").read_text())
    shards = [read_shard(str(out), n) for n in m["shards"]]
    return {k: np.concatenate([s[k] for s in shards]) for k in shards[0]}


def test_repetition_past_the_bound_is_refused_naming_the_dataset(data, tmp_path):
    spec = MixSpec([("a", ["a"]), ("b", ["b"])], {"a": 0.5, "b": 0.5}, mix_tokens=1000,
                   max_repetition=2)
    with pytest.raises(UsageError, match=r"'b' would be repeated 5 times .*max_repetition=5"):
        hashed.select_inputs(spec, [np.full(100, 5), np.full(10, 10)],
                             [np.full(100, 5), np.full(10, 10)], 64)
    with pytest.raises(UsageError, match="'b' holds no loss tokens"):
        hashed.select_inputs(dataclasses.replace(spec, mix_unit="loss_tokens"),
                             [np.ones(3), np.ones(3)], [np.ones(3), np.zeros(3)], 64)
    result = invoke("pack", *_mix(data, "--weights", "chat=0.3,math=0.7", "--mix-tokens",
                                  100_000), "-o", tmp_path / "o", *ARGS, ok=False)
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert result.output.startswith("Error: mixture dataset 'math' would be repeated 18.5 ")
    assert "--max-repetition 18.5 or more" in result.output and "--mix-tokens" in result.output
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args, message", [
    (["--weights", "chat=1,code=1"], "'code' is not a dataset of the mixture"),
    (["--weights", "chat=1"], "--weights math=... is missing"),
    (["--weights", "chat=1,math=-2"], "--weights math=-2.0 must be a number > 0"),
    (["--weights", "chat=1,math=0"], "--weights math=0.0 must be a number > 0"),
    (["--weights", "chat=1,chat=2,math=1"], "--weights gives 'chat' twice"),
    (["--weights", "chat=1,math=x"], "--weights 'math=x' must be NAME=NUMBER"),
    (["--mix", "chat=x.jsonl", "--weights", "chat=1,math=1"], "--mix chat=... is given twice"),
    (["--mix", "nameless", "--weights", "chat=1,math=1"], "--mix 'nameless' must be NAME=PATH"),
    ([], "--mix needs --weights"),
    (["--weights", "chat=1,math=1", "--max-repetition", 3],
     "--max-repetition bounds the repetition --mix-tokens asks for"),
    (["--weights", "chat=1,math=1", "--mix-unit", "loss_tokens"],
     "--mix-unit loss_tokens counts labels"),
])
def test_cli_refuses_bad_mixtures(data, tmp_path, args, message):
    result = invoke("pack", *_mix(data, *args), "-o", tmp_path / "o", *ARGS, ok=False)
    assert result.exit_code == 2 and message in result.output, result.output
    assert result.output.startswith("Error: ") and result.output.count("\n") == 1


def test_cli_refuses_mixture_flags_without_mix_and_inputs_beside_it(data, tmp_path):
    d, chat, _ = data
    result = invoke("pack", chat, "-o", tmp_path / "o", "--weights", "a=1", ok=False)
    assert result.exit_code == 2 and "--weights needs --mix NAME=PATH" in result.output
    result = invoke("pack", chat, *_mix(data, "--weights", "chat=1,math=1"), "-o",
                    tmp_path / "o", ok=False)
    assert result.exit_code == 2 and "INPUT files or --mix datasets, not both" in result.output
    result = invoke("pack", "--mix", f"a={chat}", "--mix", f"b={chat}", "--weights", "a=1,b=1",
                    "-o", tmp_path / "o", ok=False)  # a file in two datasets
    assert result.exit_code == 2 and "given twice" in result.output


# -- packed outputs --------------------------------------------------------------------------


def test_mixed_rows_carry_their_dataset_and_verify(data, tmp_path):
    out = tmp_path / "out"
    invoke("pack", *_mix(data, "--weights", "chat=0.2,math=0.8", "--mix-tokens", 10_000),
           "-o", out, *ARGS, "--block-size", 100)  # several blocks of the mixed stream
    m = json.loads((out / "manifest.json").read_text())
    chat, math = m["mixture"]["datasets"]
    assert chat["repetitions"] < 1 and chat["epochs"] == 0 and chat["unused_examples"] > 0
    assert math["repetitions"] > 2 and math["epochs"] == 2 and math["unused_examples"] == 0
    for d, target in ((chat, 2000), (math, 8000)):
        assert abs(d["units"] - target) <= 120 and d["tokens"] == d["units"]
    rows = _rows(out)
    ids, index = rows["segment_dataset_id"], rows["segment_source_index"]
    lengths = rows["tokens_segment_lengths"]
    assert ids.dtype == np.int32 and np.array_equal(ids >= 0, lengths > 0)
    assert [int(lengths[ids == d].sum()) for d in (0, 1)] == [chat["tokens"], math["tokens"]]
    assert index[ids == 0].max() < len(CHAT) and index[ids == 1].max() < len(MATH)
    seg = np.flatnonzero(ids.reshape(-1) == 1)  # a math segment holds its example's tokens
    r, j = divmod(int(seg[5]), ids.shape[1])
    off, n = rows["tokens_segment_offsets"][r, j], lengths[r, j]
    assert rows["tokens"][r, off : off + n].tolist() == MATH[index[r, j]]
    twice = np.unique(index[ids == 1], return_counts=True)[1]
    assert twice.max() == 3  # 2 epochs and a sample: every math example 2 or 3 times
    report = verify(str(out))
    assert report.ok, report.violations
    assert report.tokens_checked == chat["tokens"] + math["tokens"]
    assert report.repeats == math["examples"] - len(MATH) > len(MATH)  # 2 epochs + some
    assert "repeats of the mixture among them" in invoke("verify", out).output


def test_verify_counts_a_repeat_the_run_did_not_make(data, tmp_path):
    from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

    out = tmp_path / "out"
    invoke("pack", *_mix(data, "--weights", "chat=0.5,math=0.5"), "-o", out, *ARGS)
    name = json.loads((out / "manifest.json").read_text())["shards"][1]
    reader = ArrayRecordReader(str(out / name))
    raws = reader.read_all()
    reader.close()
    writer = ArrayRecordWriter(str(out / name), "group_size:1,uncompressed")
    for raw in [raws[0], *raws[:-1]]:  # row 0 twice, the last row gone
        writer.write(raw)
    writer.close()
    result = invoke("verify", out, ok=False)
    assert result.exit_code == 1 and "the run takes (its" in result.output, result.output
    assert "tokens 1 time(s)): tokens duplicated" in result.output


@pytest.mark.parametrize("fmt", ["parquet", "hf", "megatron"])
def test_parquet_formats_carry_the_dataset_as_a_column(data, tmp_path, fmt):
    out = tmp_path / fmt
    invoke("pack", *_mix(data, "--weights", "chat=0.3,math=0.7"), "-o", out, *ARGS,
           "--format", fmt)
    table = pq.read_table(sorted(out.glob("rows-*.parquet"))[0])
    assert "segment_dataset_id" in table.column_names
    ids = table.column("segment_dataset_id").to_pylist()
    starts = table.column("segment_source_index").to_pylist()
    assert [len(x) for x in ids] == [len(x) for x in starts]  # one per segment (or slot)
    assert {v for x in ids for v in x} <= {-1, 0, 1}
    report = verify(str(out))
    assert report.ok, report.violations


def test_loss_tokens_and_examples_units(tmp_path):
    rng = np.random.default_rng(3)
    seqs = random_seqs(200, max_len=40, seed=4)
    labels = [[-100 if rng.random() < 0.7 else t for t in s] for s in seqs]  # 30% supervised
    import pyarrow as pa

    pq.write_table(pa.table({"input_ids": seqs, "labels": labels}), tmp_path / "sft.parquet")
    plain = write_parquet(tmp_path / "pre.parquet", random_seqs(200, max_len=40, seed=5),
                          column="input_ids")
    pq.write_table(pa.table({"input_ids": pq.read_table(plain)["input_ids"],
                             "labels": pq.read_table(plain)["input_ids"]}), plain)
    for unit in ("loss_tokens", "examples"):
        out = tmp_path / unit
        invoke("pack", "--mix", f"sft={tmp_path / 'sft.parquet'}", "--mix", f"pre={plain}",
               "--weights", "sft=1,pre=1", "--mix-unit", unit, "--column", "input_ids",
               "--column", "labels", "-o", out, *ARGS)
        m = json.loads((out / "manifest.json").read_text())["mixture"]
        sft, pre = m["datasets"]
        scarce = min(m["datasets"], key=lambda d: d["available_units"])
        assert scarce["repetitions"] == 1.0 and (unit == "examples" or scarce is sft)  # whole
        assert abs(pre["units"] - sft["units"]) <= 40
        for d in m["datasets"]:  # an example of no token is no example of the rows either
            assert d["units"] == d["loss_tokens"] if unit == "loss_tokens" else \
                d["units"] <= d["examples"] and d["available_units"] == sum(
                    1 for x in (seqs if d is sft else pq.read_table(plain)["input_ids"]
                                .to_pylist()) if x)
        assert sft["loss_tokens"] < 0.4 * sft["tokens"] and pre["loss_tokens"] == pre["tokens"]
        assert verify(str(out)).ok



@pytest.mark.parametrize("overflow,unit,runner", [
    ("truncate", "loss_tokens", "local"), ("drop", "tokens", "local"),
    pytest.param("truncate", "loss_tokens", "beam", marks=pytest.mark.slow)])
def test_weights_hold_in_the_rows_after_truncate_and_drop(tmp_path, overflow, unit, runner):
    """The weights are of what the rows keep: a truncated example counts its first seq_len
    tokens (and the loss tokens among them), a dropped one nothing; the record and the
    summary agree with the rows, within one example of each target."""
    import pyarrow as pa

    if runner != "local":
        _need(runner)
    rng = np.random.default_rng(6)
    paths = {}
    for name, n, top in (("short", 150, 30), ("long", 60, 120)):
        seqs = random_seqs(n, max_len=top, seed=n)
        labels = [[-100 if rng.random() < 0.5 else t for t in s] for s in seqs]
        paths[name] = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table({"input_ids": seqs, "labels": labels}), paths[name])
    out = tmp_path / "out"
    result = invoke("pack", *(a for n, p in paths.items() for a in ("--mix", f"{n}={p}")),
                    "--weights", "short=1,long=1", "--mix-unit", unit, "--column", "input_ids",
                    "--column", "labels", "--overflow", overflow, "--runner", runner,
                    "-o", out, "--seq-len", 48, "--max-segments", 16, "--shard-rows", 16)
    record = json.loads((out / "manifest.json").read_text())["mixture"]
    rows, k = _rows(out), PackConfig(48, feature="input_ids").keys()
    got = np.zeros((2, 2), np.int64)  # per dataset: tokens, loss tokens in the rows
    for r, j in zip(*np.nonzero(rows[k.segment_lengths])):
        a, n = rows[k.segment_offsets][r, j], rows[k.segment_lengths][r, j]
        got[rows["segment_dataset_id"][r, j]] += n, (rows["labels"][r, a:a + n] != -100).sum()
    for d, entry in enumerate(record["datasets"]):
        assert [entry["tokens"], entry["loss_tokens"]] == got[d].tolist(), entry
        assert f"{entry['tokens']:>14,}{entry['loss_tokens']:>14,}" in result.output
    units = [e["units"] for e in record["datasets"]]
    assert abs(units[0] - units[1]) <= 48, units
    assert verify(str(out)).ok

def test_stats_show_each_datasets_share_per_step_and_resume_repairs(data, tmp_path):
    out = tmp_path / "out"
    invoke("pack", *_mix(data, "--weights", "chat=0.5,math=0.5"), "-o", out, *ARGS)
    shown = invoke("stats", out, "--batch-size", 4).output
    assert "mixture in tokens; share of tokens per step of 4 rows" in shown
    assert "chat" in shown and "math" in shown
    stats = json.loads(invoke("stats", out, "--json").output)["mixture"]
    assert stats["step_rows"] is None and [d["name"] for d in stats["datasets"]] == ["chat",
                                                                                     "math"]
    for d in stats["datasets"]:
        assert abs(d["token_share"] - 0.5) < 0.01
        assert d["step_share"]["p5"] <= d["step_share"]["p50"] <= d["step_share"]["p95"]
    shown = invoke("inspect", out, "--row", 0).output.splitlines()
    slots = next(line for line in shown if line.startswith("segment_dataset_id"))
    assert set(slots.split()[1:]) <= {"0", "1"}  # in the slot table, one id per used slot
    assert sum(line.startswith("segment_dataset_id") for line in shown) == 1
    want = dir_bytes(out)
    (out / json.loads(want["manifest.json"])["shards"][0]).unlink()
    invoke("pack", *_mix(data, "--weights", "chat=0.5,math=0.5"), "-o", out, *ARGS, "--resume")
    assert dir_bytes(out) == want


def test_worker_processes_write_the_same_bytes(data, tmp_path):
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        invoke("pack", *_mix(data, "--weights", "chat=0.4,math=0.6"), "-o", out, *ARGS,
               "--workers", workers, "--block-size", 80)
        outs.append(dir_bytes(out))
    assert outs[0] == outs[1]


# -- other runners ---------------------------------------------------------------------------


def _mixed_job(data, out, workers: int) -> PackJob:
    from seqpack.pipelines.formats.paths import expand_inputs

    _, chat, math = data
    spec = MixSpec([("chat", expand_inputs([chat])), ("math", [math])],
                   {"chat": 0.4, "math": 0.6}, mix_tokens=8000, seed=3)
    return PackJob(spec.inputs, out, PackConfig(128, max_segments=16),
                   write_options=WriteOptions(shard_rows=16), workers=workers, block_size=80,
                   read_options=ReadOptions(), mixture=spec)


def _need(runner: str) -> None:
    """Skips, saying why, where the runner's engine is missing."""
    pytest.importorskip({"beam": "apache_beam", "spark": "pyspark"}[runner])
    if runner == "spark" and shutil.which("java") is None:
        pytest.skip("Spark needs Java 17+")


@pytest.mark.slow
@pytest.mark.parametrize("runner", ["beam", "spark"])
def test_beam_and_spark_write_the_local_runners_bytes(data, tmp_path, runner):
    _need(runner)
    pack(_mixed_job(data, tmp_path / "local", 1))
    pack(_mixed_job(data, tmp_path / runner, 2), runner=runner, quiet=True)
    assert dir_bytes(tmp_path / runner) == dir_bytes(tmp_path / "local")
    assert verify(str(tmp_path / runner)).ok


@pytest.mark.slow
@pytest.mark.parametrize("runner", ["beam", "spark"])
def test_beam_and_spark_refuse_a_repetition_past_the_bound(data, tmp_path, runner):
    _need(runner)
    result = invoke("pack", *_mix(data, "--weights", "chat=0.3,math=0.7", "--mix-tokens",
                                  100_000), "-o", tmp_path / "o", *ARGS, "--runner", runner,
                    ok=False)
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert result.output.startswith("Error: mixture dataset 'math' would be repeated 18.5 ")


@pytest.mark.slow
def test_a_mixture_on_object_storage_writes_the_local_rows(data, tmp_path, s3):  # noqa: F811
    d, chat, math = data
    s3.upload(chat, s3.url("chat/"))
    s3.upload(math, s3.url("math.parquet"))
    local, remote = tmp_path / "local", s3.url("out/")
    invoke("pack", *_mix(data, "--weights", "chat=0.3,math=0.7", "--mix-tokens", 9000), "-o",
           local, *ARGS)
    invoke("pack", "--mix", f"chat={s3.url('chat/')}", "--mix", f"math={s3.url('math.parquet')}",
           "--weights", "chat=0.3,math=0.7", "--mix-tokens", 9000, "-o", remote, *ARGS)
    got = json.loads(s3.fs.cat(remote.split("://")[1] + "manifest.json"))
    want = json.loads((local / "manifest.json").read_text())
    assert got["shard_sha256"] == want["shard_sha256"]
    assert got["mixture"]["datasets"][1]["inputs"] == [s3.url("math.parquet")]
    assert verify(remote).ok


@settings(max_examples=12, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=2, max_size=3), st.integers(0, 2**31),
       st.sampled_from([None, 1.5, 3.0]), st.sampled_from(["split", "truncate"]))
def test_any_mixture_packs_its_selection_exactly(sizes, seed, scale, overflow):
    import tempfile

    from seqpack.pipelines.offline.runners import pack_to_dir

    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as d:
        datasets = [(f"d{i}", [write_jsonl(f"{d}/d{i}.jsonl", random_seqs(
            n, max_len=int(rng.integers(5, 90)), seed=seed + i))]) for i, n in enumerate(sizes)]
        weights = {name: float(rng.uniform(0.1, 1)) for name, _ in datasets}
        spec = MixSpec(datasets, weights, seed=seed % 7)
        avail = [sum(len(json.loads(x)["tokens"]) for x in open(p[0])) for _, p in datasets]
        if min(avail) == 0:
            return
        if scale is not None:
            total = scale * min(a / spec.weights[n] for (n, _), a in zip(datasets, avail))
            spec = dataclasses.replace(spec, mix_tokens=max(1, int(total)))
        job = PackJob(spec.inputs, f"{d}/out", PackConfig(64, max_segments=8, overflow=overflow),
                      workers=1, block_size=int(rng.integers(5, 200)), mixture=spec)
        manifest = pack_to_dir(job)
        rows = _rows(pathlib.Path(d, "out"))
        ids, lengths = rows["segment_dataset_id"], rows["tokens_segment_lengths"]
        for k, entry in enumerate(manifest.mixture["datasets"]):
            kept = int(lengths[ids == k].sum())
            assert kept <= entry["tokens"]
            assert kept == entry["tokens"] or overflow == "truncate"
        report = verify(f"{d}/out")
        assert report.ok, report.violations


def test_balanced_steps_of_a_mixture_verify_and_stats_use_their_step(data, tmp_path):
    out = tmp_path / "out"
    invoke("pack", *_mix(data, "--weights", "chat=0.5,math=0.5"), "-o", out, *ARGS,
           "--data-parallel", 2, "--batch-size", 3)
    assert verify(str(out)).ok
    stats = json.loads(invoke("stats", out, "--json").output)["mixture"]
    assert stats["step_rows"] == 6 and stats["steps"] == json.loads(
        (out / "manifest.json").read_text())["num_rows"] // 6
