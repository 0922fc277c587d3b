"""`seqpack pack --dry-run`: the figures a run would record (stats, static shapes, the order's
balance, a mixture's shares per step) equal the run's own, for every kind of run, and nothing is
written; bad input fails as the run fails; options that only a writing run takes are refused."""

from __future__ import annotations

import json

import pytest

from tests.helpers.cloud import s3, s3_server  # noqa: F401
from tests.helpers.files import invoke, random_seqs, run_cli, write_jsonl, write_parquet

SHORT = random_seqs(300, max_len=40, seed=5)
LONG = random_seqs(80, max_len=150, seed=6)
ARGS = ["--seq-len", 128, "--max-segments", 12, "--workers", 1, "--shard-rows", 32]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("dry")
    write_jsonl(d / "a.jsonl", SHORT)
    write_parquet(d / "b.parquet", LONG)
    columns = [{"input_ids": s, "labels": [t if i % 3 else -100 for i, t in enumerate(s)]}
               for s in SHORT]
    (d / "c.jsonl").write_text("".join(json.dumps(c) + "\n" for c in columns))
    return d


RUNS = {
    "shuffled, split": lambda d: [d / "a.jsonl", d / "b.parquet", "--overflow", "split"],
    "truncated, plan order": lambda d: [d / "a.jsonl", d / "b.parquet", "--overflow",
                                        "truncate", "--row-order", "plan"],
    "balanced for 4 ranks": lambda d: [d / "a.jsonl", d / "b.parquet", "--overflow", "drop",
                                       "--data-parallel", 4, "--batch-size", 2,
                                       "--cost-model", "attention", "--d-model", 64],
    "a mixture in steps of 8 rows": lambda d: [
        "--mix", f"short={d / 'a.jsonl'}", "--mix", f"long={d / 'b.parquet'}", "--weights",
        "short=0.7,long=0.3", "--mix-tokens", 12000, "--overflow", "split",
        "--batch-size", 8, "--seed", 3],
    "a mixture smaller than a step": lambda d: [
        "--mix", f"short={d / 'a.jsonl'}", "--mix", f"long={d / 'b.parquet'}", "--weights",
        "short=0.5,long=0.5", "--overflow", "split", "--batch-size", 4096],
    "concat_split": lambda d: [d / "a.jsonl", d / "b.parquet", "--strategy", "concat_split"],
    "extra columns, parquet": lambda d: [d / "c.jsonl", "--column", "input_ids", "--column",
                                         "labels", "--format", "parquet"],
    "by reference": lambda d: [d / "b.parquet", "--format", "index", "--overflow", "split"],
}


@pytest.mark.parametrize("name", list(RUNS))
def test_a_dry_run_shows_what_the_run_records(data, tmp_path, name):
    args = [*RUNS[name](data), *ARGS]
    never = tmp_path / "never"
    dry = json.loads(invoke("pack", *args, "-o", never, "--dry-run", "--json").output)
    assert not never.exists()  # nothing written, not even the directory
    out = tmp_path / "out"
    invoke("pack", *args, "-o", out)
    run = json.loads(invoke("stats", out, "--json").output)
    assert dry["dry_run"] is True
    assert dry["stats"] == run["stats"]  # every figure, the order's balance and profile too
    assert dry["summary"] == run["summary"]
    assert dry["example_length_histogram"] == run["example_length_histogram"]
    assert dry["shapes"] == {k: v for k, v in run["shapes"].items() if k != "loss_tokens"}
    assert dry.get("mixture") == run.get("mixture")  # a mixture's shares per step
    if "steps of 8" in name:
        assert dry["mixture"]["step_rows"] == 8 and dry["mixture"]["steps"] > 1
    if "smaller than a step" in name:  # the whole output's shares (`stats` crashed on it)
        assert dry["mixture"]["whole"] and dry["mixture"]["steps"] == 1
    if "balanced" in name:
        assert dry["summary"]["best_fit_decreasing"]["step_max_over_mean"] is not None


def test_the_table_names_the_run_and_needs_no_output(data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = invoke("pack", data / "a.jsonl", *ARGS, "--dry-run", "--data-parallel", 2).output
    head = text.splitlines()[0]
    assert head.startswith("dry run (nothing written): would pack 1 input file(s): 300 "
                           "examples ->") and " at " not in head
    assert "step: ranks' max / mean" in text and "steps / epoch (batch 2)" in text
    assert list(tmp_path.iterdir()) == []
    sample = invoke("pack", "--dry-run", "--workers", 1).output
    assert sample.startswith("dry run (nothing written): would pack the built-in sample")


def test_bad_input_fails_the_dry_run_as_it_fails_the_run(data, tmp_path):
    args = [data / "b.parquet", *ARGS]  # examples longer than 128; overflow error by default
    dry = invoke("pack", *args, "--dry-run", ok=False)
    run = invoke("pack", *args, "-o", tmp_path / "o", ok=False)
    assert dry.exit_code == run.exit_code == 2
    assert "b.parquet" in dry.stderr and dry.stderr == run.stderr


def test_an_interrupted_dry_run_names_no_resume(data, tmp_path, monkeypatch):
    """Over an interrupted output, an interrupted run names the --resume that finishes it; a
    dry run writes nothing there, so its interruption does not."""
    from seqpack.pipelines import offline
    from seqpack.pipelines.offline import report

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    out = tmp_path / "o"
    invoke("pack", data / "a.jsonl", *ARGS, "-o", out)
    (out / "manifest.json").rename(out / "pack_intent.json")  # as an interrupted run leaves it
    monkeypatch.setattr(offline, "pack", interrupted)
    monkeypatch.setattr(report, "pack_dry_run", interrupted)
    run = invoke("pack", data / "a.jsonl", *ARGS, "-o", out, "--resume", ok=False)
    assert run.exit_code == 130 and "finish the run with: seqpack pack" in run.stderr
    dry = invoke("pack", data / "a.jsonl", *ARGS, "-o", out, "--dry-run", ok=False)
    assert dry.exit_code == 130 and "interrupted" in dry.stderr
    assert "--resume" not in dry.stderr and "finish the run" not in dry.stderr


@pytest.mark.parametrize("option", [["--resume"], ["--overwrite"], ["--fsync"]])
def test_options_of_a_writing_run_are_refused(data, option):
    result = invoke("pack", data / "a.jsonl", *ARGS, "--dry-run", *option, ok=False)
    assert result.exit_code == 2
    assert f"{option[0]} applies to a run that writes; --dry-run writes nothing" \
        in result.stderr, result.stderr
    result = invoke("pack", data / "a.jsonl", *ARGS, "--dry-run", "--spark-option", "master=x",
                    ok=False)
    assert result.exit_code == 2 and "--spark-option needs --runner spark" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("runner", ["beam", "spark"])
def test_a_dry_run_on_beam_or_spark_shows_the_local_figures(data, tmp_path, runner):
    """The blocks planned (64 examples each) and their figures summed by the runner's workers:
    the local dry run's every figure, nothing written; bad input fails as it fails locally."""
    pytest.importorskip("apache_beam" if runner == "beam" else "pyspark")
    never = tmp_path / "never"
    for name in ("balanced for 4 ranks", "a mixture in steps of 8 rows", "shuffled, split"):
        args = [*RUNS[name](data), *ARGS, "--block-size", 64, "-o", never, "--dry-run", "--json"]
        local = json.loads(invoke("pack", *args).output)
        assert json.loads(invoke("pack", *args, "--runner", runner).output) == local, name
    assert not never.exists()
    bad = ["pack", data / "b.parquet", *ARGS, "--dry-run"]
    local, remote = invoke(*bad, ok=False), invoke(*bad, "--runner", runner, ok=False)
    assert remote.exit_code == local.exit_code == 2 and remote.stderr == local.stderr
    # an empty input warned of, as locally (Spark checks the inputs in its driver first; Beam
    # warns from what the job found, once it has run)
    (tmp_path / "empty.jsonl").write_text("")
    empty = ["pack", tmp_path / "empty.jsonl", data / "a.jsonl", *ARGS, "--dry-run"]
    local, remote = run_cli(*empty), run_cli(*empty, "--runner", runner)  # its log too
    assert local.returncode == remote.returncode == 0
    assert "no tokens (0 examples)" in local.stderr and remote.stderr == local.stderr
    written = [*empty[:-1], "-o", tmp_path / f"out-{runner}"]
    remote = run_cli(*written, "--runner", runner)
    assert remote.returncode == 0 and "empty.jsonl: no tokens (0 examples)" in remote.stderr


@pytest.mark.slow
def test_a_dry_run_over_object_storage_shows_the_local_figures(data, tmp_path, s3):  # noqa: F811
    """Inputs and output on object storage: the same figures as the local inputs give, and
    nothing is written under the output prefix."""
    a, b = s3.upload(data / "a.jsonl", s3.url("in/a.jsonl")), s3.upload(data / "b.parquet",
                                                                         s3.url("in/b.parquet"))
    args = ["--overflow", "split", "--data-parallel", 2, *ARGS, "--dry-run", "--json"]
    local = json.loads(invoke("pack", data / "a.jsonl", data / "b.parquet", *args).output)
    remote = json.loads(invoke("pack", a, b, *args, "-o", s3.url("out/")).output)
    assert remote == local
    assert not s3.fs.exists(s3.url("out/").split("://", 1)[1])
