"""A new user's first hour, run as a user would (the CLI as a subprocess): nothing skipped or
mixed in silently, columns keep their meaning, counts that agree, --help in groups, and the
edges (Ctrl-C at any instant, options that do not apply, plots that say what they show)."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers.files import invoke, run_cli, write_jsonl, write_parquet

ROOT = pathlib.Path(__file__).resolve().parents[1]  # the repository


@pytest.mark.slow
def test_a_directory_names_what_it_leaves_out_and_refuses_text_among_token_files(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "_part-0.jsonl", [[1, 2, 3], [4, 5]])
    write_jsonl(data / "part-1.jsonl", [[6, 7]])
    (data / "_SUCCESS").write_text("")
    (data / ".hidden").write_text("x")
    result = run_cli("pack", data, "-o", tmp_path / "out", "--seq-len", 8)
    assert result.returncode == 0, result.stderr
    assert f"warning: {data / '_SUCCESS'}: left out: no known input format by its name" in \
        result.stderr
    assert ".hidden" not in result.stderr
    assert "2 input file(s): 3 examples" in result.stdout  # the "_" file is read
    (data / "notes.txt").write_text("a stray note\n")
    result = run_cli("pack", data, "-o", tmp_path / "out2", "--seq-len", 8)
    assert result.returncode == 2
    assert f"Error: {data / 'notes.txt'}: a text file among 2 token file(s) (jsonl)" in \
        result.stderr and "--input-format" in result.stderr
    result = run_cli("pack", data, "-o", tmp_path / "out3", "--seq-len", 8, "--input-format",
                     "jsonl")
    assert result.returncode == 0 and "notes.txt: left out: not of --input-format jsonl" in \
        result.stderr, result.stderr



@pytest.mark.parametrize("runner", ["local", pytest.param("beam", marks=pytest.mark.slow)])
def test_text_among_token_files_is_refused_however_the_inputs_are_named(tmp_path, runner):
    """A glob or a list is checked as a directory is, by the format each input is read as
    (a LICENSE without an extension is text by its content): pack (every runner) and the
    dry run refuse it, naming the file; without it, both run."""
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "part-0.jsonl", [[1, 2, 3], [4, 5]])
    (data / "LICENSE").write_text("Permission is hereby granted\n")
    want = f"{data / 'LICENSE'}: a text file among 1 token file(s) (jsonl)"
    for i, inputs in enumerate([[data / "*"], [data / "LICENSE", data / "part-0.jsonl"]]):
        result = invoke("pack", *inputs, "-o", tmp_path / f"out{i}", "--seq-len", 8,
                        "--runner", runner, ok=False)
        assert result.exit_code == 2 and want in result.output, result.output
        assert not (tmp_path / f"out{i}" / "manifest.json").exists()
    if runner == "local":
        result = invoke("stats", data / "*", "--seq-len", 8, ok=False)
        assert result.exit_code == 2 and want in result.output, result.output
        invoke("stats", data / "part-0.jsonl", "--seq-len", 8)

def test_empty_inputs_are_named(tmp_path):
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    full = write_jsonl(tmp_path / "full.jsonl", [[1, 2, 3]])
    result = run_cli("pack", empty, full, "-o", tmp_path / "out", "--seq-len", 8)
    assert result.returncode == 0
    warning = f"{empty}: no tokens (0 examples): nothing of it is packed"
    assert result.stderr.count(warning) == 1, result.stderr
    dry = run_cli("stats", empty, full, "--seq-len", 8)  # the dry run says what pack says
    assert dry.returncode == 0 and dry.stderr.count(warning) == 1, dry.stderr
    blank = write_jsonl(tmp_path / "blank.jsonl", [[], []])
    for args in (["pack", empty, blank, "-o", tmp_path / "out2"], ["stats", empty, blank]):
        result = run_cli(*args, "--seq-len", 8)
        assert result.returncode == 2
        assert f"Error: {empty}, {blank}: no tokens in any input (2 examples)" in result.stderr


def test_sft_columns_keep_their_names_and_labels_pad_with_minus_100(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "sft.parquet"
    pq.write_table(pa.table({"input_ids": [[5, 6, 7], [8, 9]],
                             "labels": [[-100, 6, 7], [-100, 9]]}), path)
    out = tmp_path / "out"
    result = run_cli("pack", path, "-o", out, "--seq-len", 8, "--column", "input_ids",
                     "--column", "labels")
    assert result.returncode == 0, result.stderr
    assert "key 'input_ids', column 'labels' (labels, padded with -100)" in result.stdout
    row = json.loads(run_cli("inspect", out, "--row", 0, "--json").stdout)
    assert row["input_ids"][:5] == [5, 6, 7, 8, 9] and row["labels"][5:] == [-100] * 3
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["feature"] == "input_ids"


@pytest.mark.slow
def test_counts_agree_across_the_table_the_json_and_the_training_pipeline(tmp_path, caplog):
    from seqpack.pipelines.datasets import Batching, PackedArrayRecordSource
    from seqpack.pipelines.datasets import make_training_pipeline as pipeline

    rng = np.random.default_rng(0)
    src = write_parquet(tmp_path / "a.parquet",
                        [rng.integers(1, 99, int(n)).tolist() for n in rng.integers(1, 40, 300)])
    out = tmp_path / "out"
    assert run_cli("pack", src, "-o", out, "--seq-len", 64, "--data-parallel", 4,
                   "--batch-size", 2).returncode == 0
    table = run_cli("stats", out).stdout
    steps = int(re.search(r"steps / epoch \(batch 8\) +(\d+)", table).group(1))
    summary = json.loads(run_cli("stats", out, "--json").stdout)["summary"]
    assert summary["best_fit_decreasing"]["steps_per_epoch"] == steps
    rows = PackedArrayRecordSource(str(out))
    read = sum(1 for _ in pipeline(rows, batch=Batching(8, shard_index=0, shard_count=1),
                                   shuffle_seed=0, num_epochs=1))
    assert read == steps == len(rows) // 8
    assert "row cost p50 (token-equivalents)" in table
    assert "steps / epoch" not in run_cli("stats", src, "--seq-len", 64).stdout  # no batch
    plain = tmp_path / "plain"
    assert run_cli("pack", src, "-o", plain, "--seq-len", 64).returncode == 0
    source = PackedArrayRecordSource(str(plain))
    left = len(source) % 8
    assert left  # (the corpus is chosen so that a batch of 8 leaves rows over)
    with caplog.at_level("WARNING", logger="seqpack"):
        batches = list(pipeline(source, batch=Batching(8, shard_index=0, shard_count=1),
                                shuffle_seed=0, num_epochs=1))
    assert len(batches) == len(source) // 8
    assert f"the last {left} packed rows (a partial global step; {left} of them" in caplog.text
    assert "tokens, this host's) are dropped" in caplog.text


def test_pack_help_comes_in_groups():
    text = run_cli("pack", "--help").stdout
    groups = ["Inputs:", "Packing:", "Output:", "Order and balance:", "Run:", "Distributed:"]
    at = [text.index(f"  {g}") for g in groups]
    assert at == sorted(at)
    assert text.index("--seq-len") < text.index("Output:") < text.index("--fsync") < \
        text.index("Distributed:") < text.index("--beam-option")


def test_ctrl_c_while_the_options_are_parsed_is_130_with_one_line(monkeypatch, capsys):
    from seqpack import cli
    from seqpack.pipelines.console import Group

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Group, "make_context", interrupted)
    with pytest.raises(SystemExit) as e:
        cli.seqpack.main(["pack", "--help"], prog_name="seqpack")
    assert e.value.code == 130
    assert capsys.readouterr().err.strip() == "Error: interrupted"


def test_options_that_do_not_apply_are_refused_or_said(tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "a.jsonl", [[1, 2, 3]] * 4)
    result = run_cli("pack", src, "-o", tmp_path / "o", "--strategy", "concat_split",
                     "--overflow", "truncate")
    assert result.returncode == 2 and "--overflow truncate does not apply to --strategy " \
        "concat_split" in result.stderr
    assert "overflow does not apply" in run_cli("stats", src, "--seq-len", 8).stdout
    for cmd in ("pack", "stats"):
        out = ("-o", tmp_path / "o2") if cmd == "pack" else ()
        result = invoke(cmd, src, *out, "--seq-len", 8, "--text-unit", "line", ok=False)
        assert result.exit_code == 2 and "--text-unit applies to text inputs; these are " \
            "jsonl" in result.output, result.output
        result = invoke(cmd, src, *out, "--seq-len", 8, "--cost-model", "tokens", "--d-model",
                        64, ok=False)
        assert result.exit_code == 2 and "--d-model applies to --cost-model attention" in \
            result.output
    text = tmp_path / "t.txt"
    text.write_text("one line\nanother\n")
    invoke("stats", text, "--seq-len", 8, "--text-unit", "line")  # where it applies
    # plots carry the data's name and the row length
    from seqpack.pipelines.offline import report

    seen = {}
    monkeypatch.setattr(report, "plot_stats", lambda *a, **k: seen.update(k))
    invoke("stats", src, "--seq-len", 8, "--plot", tmp_path / "p.png")
    assert src in seen["title"] and "seq_len 8" in seen["title"]


@pytest.mark.slow
def test_one_install_reads_parquet_and_builds_the_training_pipeline(tmp_path):
    """`pip install seqpack` (here: the clone) brings Parquet and the Grain pipeline."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    py = venv / "bin" / "python"
    subprocess.run([py, "-m", "pip", "install", "-q", ROOT], check=True, timeout=1200,
                   capture_output=True)
    src = write_parquet(tmp_path / "a.parquet", [[1, 2, 3], [4, 5]])
    out = subprocess.run([venv / "bin" / "seqpack", "pack", src, "-o", tmp_path / "out",
                          "--seq-len", "8"], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    code = ("from seqpack.pipelines import datasets; from seqpack.packer import PackConfig\n"
            "rows = datasets.PackedArrayRecordSource('out')\n"
            "print(len(list(datasets.make_training_pipeline(rows, batch=1, shuffle_seed=0, "
            "num_epochs=1))))")
    got = subprocess.run([py, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert got.returncode == 0 and got.stdout.strip() == "1", got.stderr
    shutil.rmtree(venv)


def test_the_readme_picture_is_drawn_from_a_packed_row(tmp_path):
    """docs/figures/packed_row.png comes from a script that packs its row with seqpack."""
    pytest.importorskip("matplotlib")
    result = subprocess.run([sys.executable, ROOT / "docs" / "figures" / "packed_row.py",
                             tmp_path / "row.png"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "row.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (ROOT / "docs" / "figures" / "packed_row.png").is_file()
    assert "docs/figures/packed_row.png" in (ROOT / "README.md").read_text()
