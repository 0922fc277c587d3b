"""A packed directory is checked, not trusted: digests, repair on --resume, names, one writer.

Each case damages a real output (or races a second run against it) and ends either in a
verified-correct directory or in a clear error; never exit 0 with bad data.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from seqpack.pipelines.formats.manifest import INTENT, MANIFEST, signed
from seqpack.pipelines.offline.outdir import DONE, LOCK
from tests.helpers.files import (
    ROOT,
    dir_bytes,
    invoke,
    random_seqs,
    run_cli,
    write_jsonl,
    write_parquet,
)

ARGS = ["--seq-len", 64, "--max-segments", 8, "--shard-rows", 10, "--workers", 1]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    d = tmp_path_factory.mktemp("clean")
    src = write_jsonl(d / "a.jsonl", random_seqs(300, max_len=60, seed=4))
    invoke("pack", src, "-o", d / "out", *ARGS)
    return src, d / "out"


def _copy(clean, tmp_path):
    src, out = clean
    shutil.copytree(out, tmp_path / "out")
    return src, tmp_path / "out"


def _manifest(out) -> dict:
    return json.loads((out / MANIFEST).read_text())


def _flip(path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0x01
    path.write_bytes(bytes(data))


def test_the_manifest_records_each_shards_size_and_digest(clean):
    _, out = clean
    m = _manifest(out)
    assert len(m["shard_bytes"]) == len(m["shard_sha256"]) == len(m["shards"]) >= 5
    for name, size in zip(m["shards"], m["shard_bytes"]):
        assert (out / name).stat().st_size == size
    assert "manifest_sha256" in m and not any(n.endswith(DONE) for n in os.listdir(out))
    assert LOCK not in os.listdir(out)


def test_a_bit_flip_in_the_manifest_is_refused_everywhere(clean, tmp_path):
    from seqpack.pipelines.datasets import PackedArrayRecordSource
    from seqpack.pipelines.errors import InputError

    src, out = _copy(clean, tmp_path)
    text = (out / MANIFEST).read_text()
    (out / MANIFEST).write_text(text.replace('"num_rows": ', '"num_rows": 1', 1))
    for cmd in (["stats", out], ["inspect", out, "--row", 0], ["verify", out, src]):
        result = invoke(*cmd, ok=False)
        assert result.exit_code == 2 and "does not match its content" in result.stderr, cmd
    with pytest.raises(InputError, match="does not match its content"):
        PackedArrayRecordSource(out)


def test_a_flipped_shard_fails_verify_and_resume_rewrites_it(clean, tmp_path):
    src, out = _copy(clean, tmp_path)
    name = _manifest(out)["shards"][2]
    _flip(out / name)
    result = invoke("verify", out, src, ok=False)
    assert result.exit_code == 1 and f"{name}: size or sha256 differs" in result.stdout
    invoke("pack", src, "-o", out, *ARGS, "--resume")
    assert dir_bytes(out) == dir_bytes(clean[1])
    assert invoke("verify", out, src).stdout.startswith("OK:")


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_a_missing_or_short_shard_is_refused_then_restored(clean, tmp_path, damage):
    src, out = _copy(clean, tmp_path)
    name = _manifest(out)["shards"][-1]
    if damage == "delete":
        (out / name).unlink()
    else:
        (out / name).write_bytes((out / name).read_bytes()[:100])
    result = invoke("stats", out, ok=False)
    assert result.exit_code == 2 and name in result.stderr and "--resume" in result.stderr
    invoke("pack", src, "-o", out, *ARGS, "--resume")
    assert dir_bytes(out) == dir_bytes(clean[1])


@pytest.mark.parametrize("bad", ["../evil.arrayrecord", "/etc/passwd", "gs://b/x.arrayrecord",
                                 "sub/rows.arrayrecord"])
def test_shard_names_that_leave_the_directory_are_refused(clean, tmp_path, bad):
    src, out = _copy(clean, tmp_path)
    m = _manifest(out)
    m["shards"][0] = bad
    (out / MANIFEST).write_text(json.dumps(signed(m)))
    result = invoke("stats", out, ok=False)
    assert result.exit_code == 2 and "not a file name inside the directory" in result.stderr
    intent = {k: v for k, v in m.items() if k not in (
        "shard_num_rows", "stats", "example_length_histogram", "shard_bytes", "shard_sha256",
        "manifest_sha256")}
    (out / MANIFEST).unlink()
    (out / INTENT).write_text(json.dumps(intent))
    result = invoke("pack", src, "-o", out, *ARGS, "--resume", ok=False)
    assert result.exit_code == 2 and "not a file name inside the directory" in result.stderr


def test_overwrite_removes_only_what_seqpack_wrote(clean, tmp_path):
    src, out = _copy(clean, tmp_path)
    (out / "notes.txt").write_text("mine")
    invoke("pack", src, "-o", out, "--seq-len", 128, "--overwrite", "--workers", 1)
    assert (out / "notes.txt").read_text() == "mine"
    assert _manifest(out)["seq_len"] == 128


def test_overwrite_removes_every_formats_shards_and_completion_records(tmp_path):
    src = write_parquet(tmp_path / "a.parquet", random_seqs(300, max_len=60, seed=4))
    out = tmp_path / "out"
    invoke("pack", src, "-o", out, *ARGS, "--format", "index")
    stale = sorted(n for n in os.listdir(out) if n.endswith(".index"))
    assert len(stale) >= 5
    (out / (stale[0] + DONE)).write_text("{}")  # as a killed run leaves one
    invoke("pack", src, "-o", out, "--seq-len", 128, "--shard-rows", 1000, "--workers", 1,
           "--format", "index", "--overwrite")
    names = os.listdir(out)
    assert not any(n.endswith(DONE) for n in names)
    assert [n for n in names if n.endswith(".index")] == _manifest(out)["shards"] != stale
    assert run_cli("verify", out, src).returncode == 0


def test_a_file_url_output_is_created_and_a_dead_runs_lock_there_is_taken_over(clean, tmp_path):
    import socket

    src, local = clean
    out = tmp_path / "new" / "out"
    url = out.as_uri()
    invoke("pack", src, "-o", url, *ARGS)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / LOCK).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    invoke("pack", src, "-o", url, *ARGS, "--overwrite")
    assert dir_bytes(out) == dir_bytes(local) and LOCK not in os.listdir(out)


def _start(args, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "seqpack.cli", *map(str, args)], cwd=ROOT,
                            env=dict(os.environ, **(env or {})), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_second_run_into_the_same_directory_fails_at_once(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", random_seqs(300, max_len=60, seed=8))
    out = tmp_path / "out"
    first = _start(["pack", src, "-o", out, *ARGS], {"SEQPACK_TEST_SHARD_DELAY": "0.2"})
    deadline = time.time() + 30
    while not (out / INTENT).exists() and time.time() < deadline:
        time.sleep(0.01)
    t = time.perf_counter()
    second = run_cli("pack", src, "-o", out, "--seq-len", 128, "--overwrite")
    assert second.returncode == 2 and "another seqpack run" in second.stderr
    assert time.perf_counter() - t < 20
    assert first.wait(timeout=60) == 0, first.stderr.read()
    assert _manifest(out)["seq_len"] == 64  # the first run's output, whole
    assert run_cli("verify", out, src).returncode == 0


@pytest.mark.slow
def test_a_stale_lock_is_taken_over_after_a_kill(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", random_seqs(300, max_len=60, seed=9))
    clean = tmp_path / "clean"
    assert run_cli("pack", src, "-o", clean, *ARGS).returncode == 0
    out = tmp_path / "out"
    run = _start(["pack", src, "-o", out, *ARGS], {"SEQPACK_TEST_SHARD_DELAY": "0.2"})
    deadline = time.time() + 30
    while not any(n.endswith(DONE) for n in (os.listdir(out) if out.exists() else [])) \
            and time.time() < deadline:
        time.sleep(0.01)
    run.send_signal(signal.SIGKILL)
    run.wait()
    assert (out / LOCK).exists()  # left behind by the killed run
    done = sorted(n for n in os.listdir(out) if n.endswith(DONE))
    _flip(out / done[0].removesuffix(DONE))  # and a complete shard damaged before the resume
    result = run_cli("pack", src, "-o", out, *ARGS, "--resume")
    assert result.returncode == 0, result.stderr
    assert dir_bytes(out) == dir_bytes(clean)


def test_an_input_edited_between_kill_and_resume_is_refused(tmp_path):
    src = tmp_path / "a.jsonl"
    write_jsonl(src, random_seqs(300, max_len=60, seed=10))
    out = tmp_path / "out"
    run = _start(["pack", src, "-o", out, *ARGS], {"SEQPACK_TEST_SHARD_DELAY": "0.2"})
    deadline = time.time() + 30
    while not (out / INTENT).exists() and time.time() < deadline:
        time.sleep(0.01)
    run.send_signal(signal.SIGKILL)
    run.wait()
    data = bytearray(src.read_bytes())
    i = data.index(b"[") + 1
    data[i : i + 1] = b"9" if data[i : i + 1] != b"9" else b"8"  # same size, one id changed
    src.write_bytes(bytes(data))
    result = run_cli("pack", src, "-o", out, *ARGS, "--resume")
    assert result.returncode == 2 and "cannot resume: inputs differ" in result.stderr
    assert f"(input 0, {src}: its " in result.stderr and "sha256" in result.stderr
