"""The distributed verify's steps (`offline.verify`: shard_pieces, input_records, check_routed,
finish_verify) give the local verify's report: the same verdict, counts and violations."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from seqpack.pipelines.formats.manifest import signed
from seqpack.pipelines.offline.verify import verify
from tests.helpers.files import invoke, random_seqs, write_jsonl
from tests.helpers.verify_steps import verify_by_steps
from tests.test_cli_check import rewrite_shard

SEQS = random_seqs(300, max_len=60, seed=12) + [list(range(150))]
ARGS = ["--seq-len", 64, "--max-segments", 8, "--shard-rows", 20, "--workers", 1]


def _same(out, inputs=None, limit=20):
    local = verify(str(out), inputs, max_violations=limit)
    steps = verify_by_steps(out, inputs, limit)
    assert steps.to_dict() == local.to_dict()
    return local


@pytest.fixture
def two_inputs(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", SEQS[:150])
    b = write_jsonl(tmp_path / "b.jsonl", SEQS[150:])
    out = tmp_path / "out"
    invoke("pack", a, b, "-o", out, "--overflow", "split", *ARGS)
    return [str(a), str(b)], out


@pytest.mark.parametrize("overflow", ["split", "truncate", "drop"])
def test_clean_runs_agree(tmp_path, overflow):
    a = write_jsonl(tmp_path / "a.jsonl", SEQS)
    out = tmp_path / "out"
    invoke("pack", a, "-o", out, "--overflow", overflow, *ARGS)
    report = _same(out)
    assert report.ok and report.num_examples == len(SEQS)


@pytest.mark.parametrize("fmt", ["arrayrecord", "parquet", "hf", "megatron", "index"])
def test_columns_and_encodings_agree(tmp_path, fmt):
    rng = np.random.default_rng(3)
    seqs = random_seqs(120, max_len=50, seed=7)
    labels = [[-100 if rng.random() < 0.5 else t for t in s] for s in seqs]
    pq.write_table(pa.table({"input_ids": seqs, "labels": labels}), tmp_path / "in.parquet")
    out = tmp_path / "out"
    invoke("pack", tmp_path / "in.parquet", "-o", out, "--column", "input_ids", "--column",
           "labels", "--format", fmt, *ARGS)
    assert _same(out).ok


def test_a_mixture_agrees(tmp_path):
    chat = write_jsonl(tmp_path / "chat.jsonl", random_seqs(200, max_len=40, seed=1))
    math = write_jsonl(tmp_path / "math.jsonl", random_seqs(60, max_len=60, seed=2))
    out = tmp_path / "out"
    invoke("pack", "--mix", f"chat={chat}", "--mix", f"math={math}", "--weights",
           "chat=0.3,math=0.7", "--mix-tokens", 6000, "-o", out, *ARGS)
    report = _same(out)
    assert report.ok and report.repeats > 0


def _damage(paths, out, tmp_path) -> list[str]:
    """A changed token, a duplicated and a lost row, a missing shard, a wrong counter and a
    changed input; the inputs to verify against."""
    m = json.loads((out / "manifest.json").read_text())

    def edit(rows):
        rows[3]["tokens"][2] += 1
        return [rows[0], *rows[:-1]]

    rewrite_shard(out, m["shards"][1], edit)
    (out / m["shards"][4]).unlink()
    m["stats"]["counters"]["split_examples"] = 0
    (out / "manifest.json").write_text(json.dumps(signed(m)))
    seqs = [list(s) for s in SEQS[150:]]
    seqs[7][0] = (seqs[7][0] + 1) % 1000
    return [paths[0], write_jsonl(tmp_path / "b2.jsonl", seqs)]


DAMAGE = ("differs from the packed input", "position 2: token", "missing (20 rows)",
          "tokens duplicated", "are not in any row", "split_examples=0")


def test_damage_is_reported_alike(two_inputs, tmp_path):
    paths, out = two_inputs
    inputs = _damage(paths, out, tmp_path)
    report = _same(out, inputs, limit=50)
    text = "\n".join(report.violations)
    for what in DAMAGE:
        assert what in text, (what, text)
    assert report.found > 6
    short = verify_by_steps(out, inputs, 3)
    assert len(short.violations) == 3 and short.found == report.found


def test_an_input_that_lost_examples_leaves_the_others_numbered_as_packed(two_inputs, tmp_path):
    # before: the local verify numbered examples as read now, so every example of b.jsonl
    # moved down 50 and failed, and the distributed steps (numbering as packed) disagreed
    paths, out = two_inputs
    short = write_jsonl(tmp_path / "a_short.jsonl", SEQS[:100])
    report = _same(out, [short, paths[1]], limit=1000)
    assert not report.ok and report.num_examples == 100 + len(SEQS[150:])
    assert "the inputs' 251 example lengths differ from the packed inputs' 301" in \
        report.violations
    named = [int(v.split("source example ")[1].split()[0]) for v in report.violations
             if "source example" in v]
    assert named and all(100 <= e < 150 for e in named), named  # a's lost examples only
    # the lost examples' places read as padding; no example's tokens differ from its source
    assert not [v for v in report.violations if " != " in v]


@pytest.mark.parametrize("fault", ["drop", "repeat"])
def test_a_runner_that_loses_or_repeats_records_fails_the_run(two_inputs, fault):
    # a lost record once read as a shard's every token missing (seen once in five Beam runs
    # of a 10^7-example input); a repeated one would pass unseen: both stop the run
    from seqpack.pipelines.errors import RunFailed

    _, out = two_inputs
    with pytest.raises(RunFailed, match="the runner lost or repeated records; verify again"):
        verify_by_steps(out, runner_fault=fault)


def test_a_segment_past_the_row_is_a_violation_not_a_crash(two_inputs):
    # before: the stats' histogram of a row holding 164 tokens of 64 broke numpy (ValueError)
    _, out = two_inputs
    name = json.loads((out / "manifest.json").read_text())["shards"][1]

    def edit(rows):
        rows[0]["tokens_segment_lengths"][0] += 100
        return rows

    rewrite_shard(out, name, edit)
    report = _same(out)
    assert f"{name}: packed batch violates the row contract: row 0 slot 0: segment ends at" \
        in report.violations[1], report.violations


def _vouched_but_unreadable(out) -> str:
    """Shard 2's manifest entry says one row more than it holds, re-signed; its name."""
    m = json.loads((out / "manifest.json").read_text())
    m["shard_num_rows"][2] += 1
    (out / "manifest.json").write_text(json.dumps(signed(m)))
    return m["shards"][2]


def test_an_input_that_cannot_be_read_is_an_input_error(two_inputs, tmp_path):
    paths, out = two_inputs
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tokens": [1, 2]}\nnot json\n')
    from seqpack.pipelines.errors import InputError

    with pytest.raises(InputError, match="bad.jsonl"):
        verify_by_steps(out, [paths[0], str(bad)])


def test_runner_options_need_their_runner(two_inputs):
    _, out = two_inputs
    result = invoke("verify", out, "--beam-option", "direct_num_workers=2", ok=False)
    assert result.exit_code == 2 and "--beam-option is for --runner beam" in result.output
    result = invoke("verify", out, "--runner", "beam", "--spark-option", "master=local[2]",
                    ok=False)
    assert result.exit_code == 2 and "--spark-option is for --runner spark" in result.output


def _runner(name: str):
    """The distributed verify of runner `name` (skipped without its extra, or Spark's Java)."""
    if name == "spark" and shutil.which("java") is None:
        pytest.skip("Spark needs Java 17+")
    job = pytest.importorskip(f"seqpack.pipelines.offline.runners.{name}_verify",
                              reason=f"the {name} job needs seqpack[{name}]")
    return getattr(job, f"verify_{name}")


@pytest.mark.slow
@pytest.mark.parametrize("runner", ["beam", "spark"])
def test_a_distributed_job_reports_what_the_local_verify_reports(two_inputs, tmp_path, runner):
    run = _runner(runner)
    paths, out = two_inputs
    assert run(str(out), workers=2, quiet=True) == verify(str(out))
    inputs = _damage(paths, out, tmp_path)
    got = run(str(out), inputs, max_violations=50, workers=2, quiet=True)
    assert got == verify(str(out), inputs, max_violations=50) and not got.ok
    fewer = [write_jsonl(tmp_path / "a_short.jsonl", SEQS[:100]), inputs[1]]  # 50 lost
    assert run(str(out), fewer, max_violations=50, workers=2, quiet=True) == verify(
        str(out), fewer, max_violations=50)
    result = invoke("verify", out, *inputs, "--runner", runner, "--workers", 2,
                    "--max-violations", 4, ok=False)
    assert result.exit_code == 1 and result.stdout.count("\n") == 4
    assert f"FAILED: {got.found} violation(s) found, the first 4 listed" in result.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tokens": [1, 2]}\nnot json\n')
    result = invoke("verify", out, paths[0], bad, "--runner", runner, ok=False)
    assert result.exit_code == 2 and result.output.startswith("Error: ") and "bad.jsonl" in \
        result.output, result.output
    # a shard the manifest vouches for that cannot be decoded: bad input, as locally (before:
    # the Beam job's traceback, exit 1)
    name = _vouched_but_unreadable(out)
    want = invoke("verify", out, *inputs, ok=False)
    result = invoke("verify", out, *inputs, "--runner", runner, ok=False)
    assert result.exit_code == want.exit_code == 2 and result.output == want.output
    assert result.output.startswith("Error: ") and name in result.output


@pytest.mark.slow
@pytest.mark.parametrize("runner", ["beam", "spark"])
@pytest.mark.parametrize("selection", ["hashed", "legacy"])
def test_a_distributed_job_verifies_a_mixture(tmp_path, runner, selection, monkeypatch):
    if selection == "legacy":  # a run written before the hashed selection
        from seqpack.pipelines.offline.mixture import legacy
        from seqpack.pipelines.offline.runners import local

        monkeypatch.setattr(local, "select_inputs", lambda spec, lengths, loss, _:
                            legacy.select_inputs(spec, lengths, loss))
    run = _runner(runner)
    chat = write_jsonl(tmp_path / "chat.jsonl", random_seqs(200, max_len=40, seed=1))
    math = write_jsonl(tmp_path / "math.jsonl", random_seqs(60, max_len=60, seed=2))
    out = tmp_path / "out"
    invoke("pack", "--mix", f"chat={chat}", "--mix", f"math={math}", "--weights",
           "chat=0.3,math=0.7", "--mix-tokens", 6000, "--format", "parquet", "-o", out, *ARGS)
    got = run(str(out), workers=2, quiet=True)
    assert got == verify(str(out)) and got.ok and got.repeats > 0
    assert ("selection" in json.loads((out / "manifest.json").read_text())["mixture"]) == (
        selection == "hashed")


@pytest.mark.slow
def test_a_spark_tasks_unexpected_error_is_worded_and_its_log_kept():
    # before: the error was worded after the JVM stopped: "Error: [Errno 111] Connection
    # refused", exit 2, the cause only in a log the message did not name
    if shutil.which("java") is None:
        pytest.skip("Spark needs Java 17+")
    spark = pytest.importorskip("seqpack.pipelines.offline.runners.spark")
    with pytest.raises(RuntimeError, match=r"^the Spark job failed: Py4JJavaError: .*"
                       r"ZeroDivisionError.*\(Spark's log: (\S+)\)$") as caught:
        with spark.spark_job((), 1, True) as sc:
            sc.parallelize([1]).map(lambda x: 1 / 0).collect()
    log = str(caught.value).rsplit("(Spark's log: ", 1)[1].rstrip(")")
    assert os.path.getsize(log) > 0
    os.remove(log)


def _mixture_run(tmp_path, *more):
    chat = write_jsonl(tmp_path / "chat.jsonl", random_seqs(200, max_len=40, seed=1))
    math = write_jsonl(tmp_path / "math.jsonl", random_seqs(60, max_len=60, seed=2))
    out = tmp_path / "out"
    invoke("pack", "--mix", f"chat={chat}", "--mix", f"math={math}", "--weights",
           "chat=0.3,math=0.7", "--mix-tokens", 6000, "-o", out, *ARGS, *more)
    return out, chat, math


def test_a_legacy_mixtures_output_still_verifies(tmp_path, monkeypatch):
    """A run written before the hashed selection (its record names no `selection`) verifies
    by the legacy one, locally and by the distributed steps; a hashed verify would not."""
    from seqpack.pipelines.offline.mixture import legacy
    from seqpack.pipelines.offline.runners import local

    monkeypatch.setattr(local, "select_inputs",
                        lambda spec, lengths, loss, _: legacy.select_inputs(spec, lengths, loss))
    out, _, _ = _mixture_run(tmp_path)
    record = json.loads((out / "manifest.json").read_text())["mixture"]
    assert "selection" not in record and "sample_below" not in record["datasets"][0]
    report = _same(out)
    assert report.ok and report.repeats > 0


def test_a_hashed_mixture_whose_input_changed_is_found_by_both_verifies(tmp_path):
    out, chat, _ = _mixture_run(tmp_path, "--block-size", 50)
    assert json.loads((out / "manifest.json").read_text())["mixture"]["selection"] == "hashed"
    seqs = random_seqs(200, max_len=40, seed=1)
    seqs[7] = seqs[7] + [5, 6, 7]  # one example longer: the tallies and the takes differ
    write_jsonl(chat, seqs)
    report = _same(out)
    assert not report.ok
    assert any("mixture dataset 'chat'" in v for v in report.violations), report.violations


def test_resuming_a_legacy_mixtures_run_says_why_it_cannot(tmp_path, monkeypatch):
    from seqpack.pipelines.offline.mixture import legacy
    from seqpack.pipelines.offline.runners import local

    with monkeypatch.context() as patch:
        patch.setattr(local, "select_inputs", lambda spec, lengths, loss, _:
                      legacy.select_inputs(spec, lengths, loss))
        out, chat, math = _mixture_run(tmp_path)
    result = invoke("pack", "--mix", f"chat={chat}", "--mix", f"math={math}", "--weights",
                    "chat=0.3,math=0.7", "--mix-tokens", 6000, "-o", out, *ARGS, "--resume",
                    ok=False)
    assert result.exit_code == 2, result.output
    assert "mixture (made by an older seqpack's selection) differ" in result.output
    assert "--overwrite" in result.output


def _lost_example(tmp_path):
    """A mixture of three inputs packed, then its first input with one example lost: (the
    output, the inputs to verify against)."""
    seqs = random_seqs(200, max_len=40, seed=1)
    (tmp_path / "chat").mkdir()
    write_jsonl(tmp_path / "chat" / "a.jsonl", seqs[:150])
    b = write_jsonl(tmp_path / "chat" / "b.jsonl", seqs[150:])
    math = write_jsonl(tmp_path / "math.jsonl", random_seqs(60, max_len=60, seed=2))
    out = tmp_path / "out"
    invoke("pack", "--mix", f"chat={tmp_path / 'chat'}", "--mix", f"math={math}",
           "--weights", "chat=0.4,math=0.6", "--mix-tokens", 8000, "-o", out, *ARGS,
           "--block-size", 20)
    short = write_jsonl(tmp_path / "a_short.jsonl", seqs[:10] + seqs[11:150])  # one lost
    return out, [short, b, math]


def test_a_mixture_input_that_lost_examples_leaves_the_others_numbered_as_packed(tmp_path):
    # before: the distributed steps took the packed count of takes for an input of one example
    # fewer and failed (shapes 149 and 150); the local verify numbered the dataset's later
    # inputs as read now, and named their untouched examples
    out, inputs = _lost_example(tmp_path)
    report = _same(out, inputs, limit=1000)
    assert not report.ok
    assert "the inputs' 259 example lengths differ from the packed inputs' 260" in \
        report.violations
    named = [int(v.split("source example ")[1].split()[0]) for v in report.violations
             if "source example " in v]
    assert named and all(10 <= e < 150 for e in named), named  # a's shifted examples only


@pytest.mark.slow
@pytest.mark.parametrize("runner", ["beam", "spark"])
def test_a_distributed_job_reports_a_mixture_input_that_lost_examples(tmp_path, runner):
    run = _runner(runner)
    out, inputs = _lost_example(tmp_path)
    got = run(str(out), inputs, max_violations=1000, workers=2, quiet=True)
    assert got == verify(str(out), inputs, max_violations=1000) and not got.ok

