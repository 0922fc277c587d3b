"""The CLI as a real process: pack -> verify -> stats, SIGKILL + --resume, bad input, imports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.helpers.files import ROOT, dir_bytes, random_seqs, run_cli, write_jsonl, write_parquet


def test_help_is_fast_and_lists_the_commands():
    t = time.perf_counter()
    result = run_cli("--help")
    elapsed = time.perf_counter() - t
    assert result.returncode == 0
    for command in ("pack", "stats", "verify", "inspect"):
        assert command in result.stdout
    assert elapsed < 1.0, f"seqpack --help took {elapsed:.2f} s"


def test_commands_never_import_jax_or_grain(tmp_path):
    src = write_parquet(tmp_path / "a.parquet", random_seqs(50, seed=3))
    out = tmp_path / "out"
    code = f"""
import sys
from seqpack import cli
for args in (["pack", {str(src)!r}, "-o", {str(out)!r}, "--seq-len", "64"],
             ["stats", {str(src)!r}, "--seq-len", "64"], ["stats", {str(out)!r}],
             ["verify", {str(out)!r}], ["inspect", {str(out)!r}, "--row", "0"]):
    try:
        cli.main(args)
    except SystemExit as e:
        assert e.code in (0, None), (args, e.code)
print("MODULES", " ".join(sorted({{m.split(".")[0] for m in sys.modules}} | set(sys.modules))))
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    modules = set(result.stdout.split("MODULES", 1)[1].split())
    assert "pyarrow" in modules and "array_record" in modules  # the commands did run
    assert not modules & {"jax", "jaxlib", "grain", "seqpack.kernels", "torch"}, modules


@pytest.mark.slow
def test_pack_verify_stats_inspect(tmp_path):
    seqs = random_seqs(800, max_len=120, seed=4) + [list(range(300))]
    src = write_jsonl(tmp_path / "a.jsonl", seqs)
    out = tmp_path / "out"
    result = run_cli("pack", src, "-o", out, "--seq-len", 128, "--max-segments", 16,
                     "--overflow", "split", "--shard-rows", 25)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # no progress bar when stderr is not a terminal
    assert "efficiency" in result.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stats"]["counters"]["split_examples"] == 1
    result = run_cli("verify", out, src)
    assert result.returncode == 0 and result.stdout.startswith("OK:"), result.stderr
    assert f"{sum(map(len, seqs)):,} tokens checked" in result.stdout
    result = run_cli("stats", out, "--json")
    assert json.loads(result.stdout)["stats"]["best_fit_decreasing"] == manifest["stats"]
    result = run_cli("stats", src, "--seq-len", 128, "--overflow", "split")
    assert result.returncode == 0 and "concat_split" in result.stdout
    result = run_cli("inspect", out, "--row", 3, "--count", 16)
    assert result.returncode == 0 and "segment_source_index" in result.stdout


@pytest.mark.slow  # seconds of subprocesses (tests/test_faults.py covers the fast path)
def test_sigkill_mid_run_then_resume_gives_the_same_bytes(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", random_seqs(3000, max_len=200, seed=5))
    args = ["--seq-len", 256, "--max-segments", 8, "--shard-rows", 40]
    clean = tmp_path / "clean"
    assert run_cli("pack", src, "-o", clean, *args).returncode == 0
    num_shards = len(json.loads((clean / "manifest.json").read_text())["shards"])
    assert num_shards >= 10

    out = tmp_path / "out"
    env = dict(os.environ, SEQPACK_TEST_SHARD_DELAY="0.25")
    proc = subprocess.Popen([sys.executable, "-m", "seqpack.cli", "pack", src, "-o", out,
                             *map(str, args)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    done: list[str] = []
    while not done and time.time() < deadline and proc.poll() is None:
        if out.exists():
            done = [n for n in os.listdir(out) if n.endswith(".arrayrecord.done")]
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    names = os.listdir(out)
    # Complete: shards with their completion record (a shard renamed in the instant of the kill,
    # before its record was written, is rewritten by the resume).
    complete = sorted(n for n in names if n.endswith(".arrayrecord") and n + ".done" in names)
    assert "manifest.json" not in names and "pack_intent.json" in names
    assert 1 <= len(complete) < num_shards
    kept = {n: os.stat(out / n).st_mtime_ns for n in complete}

    assert run_cli("pack", src, "-o", out, *args).returncode == 2  # exists: needs a flag
    result = run_cli("pack", src, "-o", out, *args, "--resume")
    assert result.returncode == 0, result.stderr
    assert {n: os.stat(out / n).st_mtime_ns for n in complete} == kept  # not rewritten
    assert dir_bytes(out) == dir_bytes(clean)
    assert run_cli("verify", out, src).returncode == 0


def test_bad_input_as_a_process(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tokens": [1, 2]}\n{"tokens": [3,\n')
    out = tmp_path / "out"
    result = run_cli("pack", bad, "-o", out)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("Error: ")
    assert "bad.jsonl:2: not valid JSON" in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == "" and not (out / "manifest.json").exists()
    result = run_cli("verify", tmp_path / "missing-dir")
    assert result.returncode == 2 and result.stderr.startswith("Error: ")
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_progress_bar_on_a_terminal(tmp_path):
    import pty

    srcs = [write_jsonl(tmp_path / f"{i}.jsonl", random_seqs(200, max_len=200, seed=i))
            for i in range(10)]
    leader, follower = pty.openpty()
    env = dict(os.environ, COLUMNS="120", TERM="xterm", SEQPACK_TEST_SHARD_DELAY="0.05")
    proc = subprocess.Popen([sys.executable, "-m", "seqpack.cli", "pack", *srcs,
                             "-o", tmp_path / "out", "--seq-len", "256", "--shard-rows", "50"],
                            cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=follower)
    os.close(follower)
    seen = bytearray()

    def drain():  # read the terminal while the run writes to it, so the child never blocks
        while True:
            try:
                chunk = os.read(leader, 1 << 16)
            except OSError:  # the terminal closed
                return
            if not chunk:
                return
            seen.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    stdout = proc.communicate(timeout=120)[0]
    reader.join(timeout=10)
    os.close(leader)
    assert proc.returncode == 0
    assert b"tokens/s" in seen and b"rows" in seen and b"writing" in seen and b"eta" in seen
    assert b"reading" in seen and b"MB/s" in seen  # pass 1 has its own bar
    assert b"tokens/s" not in stdout and b"efficiency" in stdout  # the bar stays on stderr
