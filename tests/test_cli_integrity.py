"""The CLI's exit codes and bounds: click's usage errors are one `Error:` line (exit 2);
`inspect --row -1` is the last row; --seq-len is bounded (int32, memory) before anything is
written; Ctrl-C exits with 130 and names the `--resume` command that finishes the run."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.files import ROOT, invoke, random_seqs, run_cli, write_jsonl


@pytest.mark.parametrize("args, message", [
    (["pack", "--bogus"], "No such option '--bogus'"),
    (["--bogus"], "No such option '--bogus'"),
    (["nope"], "No such command 'nope'"),
    (["pack", "--seq-len", "x"], "Invalid value for '--seq-len'"),
    (["pack", "--strategy", "worst"], "Invalid value for '--strategy'"),
    (["inspect"], "Missing argument 'OUTPUT_DIR'"),
    (["inspect", "out"], "Missing option '--row'"),
])
def test_click_usage_errors_are_one_error_line(args, message):
    result = invoke(*args, ok=False)  # before: "Usage: ...", "Try ... for help.", "", "Error:"
    assert result.exit_code == 2
    assert result.output.startswith("Error: ") and result.output.count("\n") == 1, result.output
    assert message in result.output


def test_inspect_negative_row_is_counted_from_the_end(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", random_seqs(80, max_len=40, seed=1))
    invoke("pack", src, "-o", tmp_path / "out", "--seq-len", 64, "--shard-rows", 10)
    n = int(invoke("inspect", tmp_path / "out", "--row", 0).output.split(" of ")[1].split()[0])
    last = invoke("inspect", tmp_path / "out", "--row", -1).output
    assert last.startswith(f"row {n - 1} of {n} (")  # before: "row -1 of N"
    assert last.split(":", 1)[1] == invoke("inspect", tmp_path / "out", "--row", n - 1
                                           ).output.split(":", 1)[1]
    for bad in (n, -n - 1):
        result = invoke("inspect", tmp_path / "out", "--row", bad, ok=False)
        assert result.exit_code == 2 and "out of range" in result.output


def test_seq_len_bounds_are_checked_before_anything_is_written(tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "a.jsonl", [[1, 2, 3]])
    out = tmp_path / "out"
    # Before: a traceback, and pack_intent.json left behind.
    result = invoke("pack", src, "-o", out, "--seq-len", 3_000_000_000, ok=False)
    assert result.exit_code == 2 and result.output.count("\n") == 1
    assert "--seq-len 3000000000 must be in [1, 2147483647]" in result.output
    from seqpack.pipelines.offline import job

    monkeypatch.setattr(job, "available_memory", lambda: 2**30)
    result = invoke("pack", src, "-o", out, "--seq-len", 100_000_000, ok=False)
    assert result.exit_code == 2
    assert "--seq-len 100000000, --max-segments 64: one packed row needs 1.5 GiB, more than " \
        "the 1.0 GiB" in result.output
    result = invoke("pack", src, "-o", out, "--seq-len", 1024, "--max-segments", 50_000_000,
                    ok=False)  # the per-segment arrays count too
    assert result.exit_code == 2
    assert "--seq-len 1024, --max-segments 50000000: one packed row needs 2.2 GiB" \
        in result.output and "or --max-segments" in result.output
    result = invoke("pack", src, "-o", out, "--seq-len", 1_000_000, "--workers", 2, ok=False)
    assert result.exit_code == 2  # 1024 rows of 16 MB in each of 2 workers: 32 GiB
    assert "--shard-rows 1024 x (--seq-len 1000000, --max-segments 64) x 2 worker(s) needs " \
        "30.5 GiB" in result.output
    assert "pass --shard-rows 33 or fewer" in result.output
    assert not out.exists()


@pytest.mark.slow  # seconds of subprocesses (tests/test_faults.py covers the fast path)
def test_ctrl_c_exits_130_and_names_the_resume_command(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", random_seqs(1500, max_len=100, seed=2))
    out = tmp_path / "out"
    args = ["pack", src, "-o", out, "--seq-len", 128, "--shard-rows", 20]
    env = dict(os.environ, SEQPACK_TEST_SHARD_DELAY="0.2")
    proc = subprocess.Popen([sys.executable, "-m", "seqpack.cli", *map(str, args)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None and not (
            out.exists() and any(n.endswith(".arrayrecord") for n in os.listdir(out))):
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err  # before: 1, the code verify uses for violations
    assert err.count("\n") == 1 and err.startswith("Error: interrupted; finish the run with: ")
    command = shlex.split(err.split("finish the run with: ", 1)[1])
    assert command[:2] == ["seqpack", "pack"] and command[-1] == "--resume"
    assert run_cli(*command[1:]).returncode == 0
    assert run_cli("verify", out).returncode == 0


def test_exit_codes_are_in_help():
    text = " ".join(invoke("--help").output.split())
    assert "0 ok; 1 verify found violations; 2 bad input" in text and "130 interrupted" in text
