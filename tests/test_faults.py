"""Every fault of a `seqpack pack` run ends in one `Error:` line and a state `--resume` finishes.

Each case runs the real command (a subprocess in a session of its own, like a terminal's
foreground job), breaks it one way, and asserts the exit code, the one line (the file named, the
next step, no traceback), that no process of the run is left, and that `--resume` then writes
the bytes of a clean run: SIGTERM, Ctrl-C to the whole process group at several moments, a
worker killed by SIGKILL (what the kernel's OOM killer sends), a disk that fills up or runs out
of inodes (a small tmpfs in a mount namespace of its own; skipped where mounting is not
allowed), a shard the system refuses with the lock's cleanup failing too, many runs racing for
a killed run's lock, and a reader of stdout that goes away.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys

import pytest

from seqpack.pipelines.offline.job import SPILL_DIR
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
from tests.helpers.runs import finish, race, start, wait_for, workers

ARGS = ["--seq-len", 64, "--max-segments", 8, "--shard-rows", 8, "--overflow", "split"]
SLOW_WRITE = {"SEQPACK_TEST_SHARD_DELAY": "0.25"}  # seconds after each input read / shard


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[list[str], dict[str, bytes]]:
    """Three inputs and the bytes of their clean run."""
    d = tmp_path_factory.mktemp("faults")
    paths = [write_jsonl(d / f"{k}.jsonl", random_seqs(120, max_len=70, seed=k))
             for k in range(3)]
    result = run_cli("pack", *paths, "-o", d / "clean", *ARGS, "--workers", 2)
    assert result.returncode == 0, result.stderr
    return paths, dir_bytes(d / "clean")


def _one_line(err: str, *needles: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _resume(line: str, want: dict[str, bytes], out) -> None:
    """Runs the command the error names and checks the clean run's bytes."""
    command = shlex.split(line.split("finish the run with: ", 1)[1])
    assert command[:2] == ["seqpack", "pack"] and command[-1] == "--resume"
    result = run_cli(*command[1:])
    assert result.returncode == 0, result.stderr
    assert dir_bytes(out) == want


def _writing(out) -> bool:
    return out.is_dir() and any(n.endswith(DONE) for n in os.listdir(out))


@pytest.mark.slow
def test_sigterm_is_handled_like_ctrl_c(corpus, tmp_path):
    paths, want = corpus
    out = tmp_path / "out"
    run = start("pack", *paths, "-o", out, *ARGS, "--workers", 2, env=SLOW_WRITE)
    wait_for(lambda: _writing(out), run)
    run.send_signal(signal.SIGTERM)  # the main process only, as `timeout` and `kill` do
    took, err = finish(run)
    # Before: exit 143 with no message, a stale lock and a leftover spill.
    assert run.returncode == 143 and took < 5
    line = _one_line(err, "Error: terminated (SIGTERM); finish the run with: seqpack pack")
    assert not (out / LOCK).exists() and not (out / SPILL_DIR).exists()
    _resume(line, want, out)


@pytest.mark.parametrize("moment", [pytest.param("reading", marks=pytest.mark.slow), "writing"])
def test_ctrl_c_at_any_moment_exits_130_at_once(corpus, tmp_path, moment):
    paths, want = corpus
    out = tmp_path / "out"
    run = start("pack", *paths, "-o", out, *ARGS, "--workers", 2, env=SLOW_WRITE)
    if moment == "reading":
        wait_for(lambda: (out / SPILL_DIR).is_dir() and len(os.listdir(out / SPILL_DIR)) > 0, run)
    else:
        wait_for(lambda: _writing(out), run)
    os.killpg(run.pid, signal.SIGINT)  # Ctrl-C: every process of the terminal's group
    took, err = finish(run)
    # Before: worker tracebacks, "Fatal Python error: init_import_site", "EOFError: Ran out of
    # input" from the fork server, or a hang of minutes in the exit-time cleanup.
    assert run.returncode == 130 and took < 5, err
    if moment == "reading":
        _one_line(err, "Error: interrupted; nothing was written yet: run the same command again")
        assert run_cli("pack", *paths, "-o", out, *ARGS).returncode == 0
        assert dir_bytes(out) == want
    else:
        _resume(_one_line(err, "Error: interrupted; finish the run with: "), want, out)


def test_an_interrupt_after_the_run_completed_says_so(corpus, tmp_path, monkeypatch):
    from seqpack.pipelines import offline

    real = offline.pack

    def pack_then_ctrl_c(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(offline, "pack", pack_then_ctrl_c)
    paths, want = corpus
    result = invoke("pack", *paths, "-o", tmp_path / "out", *ARGS, "--workers", 1, ok=False)
    assert result.exit_code == 130
    assert result.stderr.strip() == f"Error: interrupted; the output at {tmp_path / 'out'} is " \
        "complete"
    assert dir_bytes(tmp_path / "out") == want


@pytest.mark.slow
def test_a_worker_killed_by_the_oom_killer_is_one_line(corpus, tmp_path):
    paths, want = corpus
    out = tmp_path / "out"
    run = start("pack", *paths, "-o", out, *ARGS, "--workers", 2, env=SLOW_WRITE)
    wait_for(lambda: _writing(out) and len(workers(run)) == 2, run)
    os.kill(workers(run)[0], signal.SIGKILL)
    took, err = finish(run)
    assert run.returncode == 2 and took < 5, err  # before: a BrokenProcessPool traceback
    line = _one_line(err, "a worker process was killed by SIGKILL (SIGKILL: often the kernel's "
                          "out-of-memory killer) while writing shards",
                     "pass fewer --workers or a smaller --shard-rows", "finish the run with:")
    _resume(line, want, out)


_FILL = """
set -e
mount -t tmpfs -o {opts} tmpfs "$DISK"
set +e
"$PY" -m seqpack.cli pack {inputs} -o "$DISK/out" {args} 2> "$LOG"
echo $? > "$CODE"
set -e
mount -o remount,size=64m,nr_inodes=10000 "$DISK"
"$PY" -m seqpack.cli pack {inputs} -o "$DISK/out" {args} --resume > /dev/null
cp -r "$DISK/out" "$KEEP"
umount "$DISK"
"""


@pytest.mark.slow
@pytest.mark.parametrize("limit", ["size=96k", "nr_inodes=12"], ids=["disk-full", "no-inodes"])
def test_a_full_disk_names_the_file_and_resume_finishes(corpus, tmp_path, limit):
    paths, want = corpus
    if not shutil.which("unshare") or subprocess.run(
            ["unshare", "-m", "sh", "-c", f"mount -t tmpfs tmpfs {tmp_path}"],
            capture_output=True).returncode:
        pytest.skip("mounting a tmpfs in a mount namespace is not allowed here")
    (tmp_path / "disk").mkdir()
    args = " ".join(map(str, [*ARGS, "--workers", 2]))
    script = _FILL.format(opts=limit, inputs=" ".join(map(shlex.quote, paths)), args=args)
    env = dict(os.environ, DISK=str(tmp_path / "disk"), PY=sys.executable,
               LOG=str(tmp_path / "log"), CODE=str(tmp_path / "code"), KEEP=str(tmp_path / "kept"))
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # Before: a RuntimeError traceback from the shard writer, naming neither the shard nor
    # the way back.
    assert (tmp_path / "code").read_text().strip() == "2"
    reason = "No space left on device"
    line = _one_line((tmp_path / "log").read_text(), f"{tmp_path / 'disk' / 'out'}/", reason,
                     "free space on that disk")
    assert "finish the run with:" in line or "run the same command again" in line
    assert dir_bytes(tmp_path / "kept") == want


def test_a_refused_shard_is_the_error_even_when_cleanup_fails_too(corpus, tmp_path,
                                                                  monkeypatch):
    from seqpack.pipelines.offline import outdir

    def refuse(self, local, name):
        raise PermissionError(13, "Permission denied", self.path(name))

    def refuse_lock(self, name):
        raise PermissionError(13, "Permission denied", self.path(name))

    monkeypatch.setattr(outdir.OutputDir, "publish", refuse)
    monkeypatch.setattr(outdir.OutputDir, "remove", refuse_lock)
    paths, _ = corpus
    out = tmp_path / "out"
    result = invoke("pack", *paths, "-o", out, *ARGS, "--workers", 1, ok=False)
    # Before: the cleanup's "Permission denied: .../pack.lock" replaced the real error.
    _one_line(result.stderr, f"{out}/rows-00000-of-", "cannot write the shard (Permission "
              "denied); make it writable", "finish the run with:")


def test_many_runs_racing_for_a_stale_lock_let_exactly_one_in(tmp_path):
    (tmp_path / LOCK).write_text(json.dumps({"pid": 2**22 + 7, "host": os.uname().nodename,
                                             "started": "1"}))  # a killed run's: pid gone
    got = race(str(tmp_path), 8)
    # Before: each racer read the dead owner, removed "its" stale lock (another's fresh one) and
    # went on, so several held the lock and deleted each other's spill.
    assert sum(got) == 1, got
    assert not (tmp_path / LOCK).exists()


@pytest.mark.slow
def test_resumes_started_together_on_a_killed_run_give_the_clean_bytes(corpus, tmp_path):
    paths, want = corpus
    out = tmp_path / "out"
    run = start("pack", *paths, "-o", out, *ARGS, "--workers", 1, env=SLOW_WRITE)
    wait_for(lambda: _writing(out), run)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    racers = [start("pack", *paths, "-o", out, *ARGS, "--workers", 1, "--resume",
                    env=SLOW_WRITE) for _ in range(6)]
    outcomes = []
    for r in racers:
        _, err = finish(r, timeout=120)
        outcomes.append(r.returncode)
        if r.returncode:
            _one_line(err, "another seqpack run", "is writing here")
    assert set(outcomes) <= {0, 2} and 0 in outcomes and 2 in outcomes, outcomes
    assert dir_bytes(out) == want
    assert run_cli("verify", out).returncode == 0


def test_a_reader_that_goes_away_ends_the_command_quietly(corpus, tmp_path):
    paths, _ = corpus
    run = start("stats", *paths, "--seq-len", 64, "--overflow", "split")
    run.stdout.close()  # `| head` that has already exited
    _, err = finish(run)
    # Before: "Error: [Errno 32] Broken pipe" and exit 2.
    assert run.returncode == 141 and err == "", err


def test_a_failed_beam_job_names_its_cause():
    pytest.importorskip("apache_beam")
    from seqpack.pipelines.offline.runners.beam import cause as _cause

    try:
        try:
            raise MemoryError("worker 3 ran out of memory")
        except MemoryError as inner:
            raise RuntimeError("0") from inner  # what a runner re-raises with: "failed: 0"
    except RuntimeError as e:
        assert _cause(e) == "MemoryError: worker 3 ran out of memory"


def test_an_interrupt_wrapped_while_a_module_loads_is_one_line(corpus, tmp_path, monkeypatch):
    """Ctrl-C while `pack` imports the offline job can land inside class creation, which wraps
    it (`RuntimeError: Error calling __set_name__ ...` caused by the KeyboardInterrupt)."""
    from seqpack.pipelines import offline

    def interrupted_import(*args, **kwargs):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as e:
            raise RuntimeError("Error calling __set_name__ on 'Field' instance 'read_options' "
                               "in 'PackJob'") from e

    monkeypatch.setattr(offline, "pack", interrupted_import)
    paths, _ = corpus
    result = invoke("pack", *paths, "-o", tmp_path / "out", *ARGS, ok=False)
    # Before: the RuntimeError's traceback and exit 1, verify's code for violations.
    assert result.exit_code == 130, result.output
    assert result.stderr.strip() == "Error: interrupted; nothing was written yet: run the " \
        "same command again"


def _parquet_corpus(d) -> list[str]:
    """Four Parquet inputs that `--workers 2` packs in about a second."""
    return [write_parquet(d / f"part{k}.parquet", random_seqs(2500, max_len=600, seed=k))
            for k in range(4)]


@pytest.mark.slow
def test_sigint_to_the_main_process_at_many_moments_ends_it_with_one_line(tmp_path):
    """SIGINT to the main process alone (`kill -INT`, `timeout -s INT`) at 24 moments of a
    ~1 s pack of four Parquet files with two workers, from the imports to the manifest: each run
    exits within 20 s with exit 130 and one `Error:` line, or ends as if the signal came after
    it (0, or killed by the signal while the interpreter exits, which resets its handlers:
    silent, the output complete), and leaves no process. Before: a run in ~300 stayed alive
    after its message (the worker pool's exit-time join, waiting on a queue whose readers were
    killed); a signal while a dataclass was made exited -2 after its message; one that landed
    in a weakref callback was swallowed ("Exception ignored in ...") and the run went on."""
    import time

    from seqpack.pipelines.formats.manifest import MANIFEST

    paths = _parquet_corpus(tmp_path)
    for k in range(24):
        out = tmp_path / f"out{k}"
        run = start("pack", *paths, "-o", out, "--seq-len", 2048, "--overflow", "split",
                    "--workers", 2)
        time.sleep(0.15 + 0.055 * k)  # from the CLI's own imports on (not the interpreter's)
        run.send_signal(signal.SIGINT)
        _, err = finish(run, timeout=20)
        if run.returncode in (0, -signal.SIGINT):
            assert err == "" and (out / MANIFEST).exists(), (k, run.returncode, err)
            continue
        assert run.returncode == 130, (k, run.returncode, err)
        _one_line(err, "Error: interrupted")
