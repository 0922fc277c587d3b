"""Real `seqpack` runs for fault tests: started in a session of their own, signalled, watched."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable

from tests.helpers.files import ROOT


def start(*args, env: dict | None = None) -> subprocess.Popen:
    """`python -m seqpack.cli ARGS` in a new session (its process group is the terminal's
    stand-in: `os.killpg(p.pid, SIGINT)` is Ctrl-C)."""
    return subprocess.Popen([sys.executable, "-m", "seqpack.cli", *map(str, args)], cwd=ROOT,
                            env=dict(os.environ, **(env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for(check: Callable[[], bool], proc: subprocess.Popen | None = None,
             timeout: float = 60) -> None:
    """Polls `check` until it holds; AssertionError on timeout or if `proc` ends first."""
    deadline = time.time() + timeout
    while not check():
        assert proc is None or proc.poll() is None, "the run ended first: " + (
            proc.stderr.read() if proc.stderr else "")
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def session(sid: int) -> list[int]:
    """The live (not zombie) processes of session `sid`."""
    live = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.getsid(int(name)) != sid:
                continue
        except OSError:
            continue
        st = _stat(int(name))
        if st is not None and st[0] != "Z":
            live.append(int(name))
    return live


def workers(proc: subprocess.Popen) -> list[int]:
    """The worker processes of a run: the children of its fork server."""
    pids = session(proc.pid)
    servers = {p for p in pids if (_stat(p) or ("", 0))[1] == proc.pid and
               b"forkserver" in open(f"/proc/{p}/cmdline", "rb").read()}
    return [p for p in pids if (_stat(p) or ("", 0))[1] in servers]


def finish(proc: subprocess.Popen, timeout: float = 30) -> tuple[float, str]:
    """Waits for the run: (seconds it took, stderr); then every process of its session is gone
    (or a zombie: this container's init does not reap orphans)."""
    t = time.time()
    _, err = proc.communicate(timeout=timeout)
    took = time.time() - t
    deadline = time.time() + 5
    while session(proc.pid) and time.time() < deadline:
        time.sleep(0.05)
    assert not session(proc.pid), f"processes left: {session(proc.pid)}"
    return took, err


def race_for_lock(location: str, go, results, done) -> None:
    """One racer for a run's lock (a `multiprocessing` target): waits at the barrier `go`, tries
    `DirLock(location)`, puts True or False on `results`, and a winner holds the lock until
    `done` is set."""
    from seqpack.pipelines.errors import UsageError
    from seqpack.pipelines.offline.lock import DirLock

    lock = DirLock(location)
    go.wait()
    try:
        lock.acquire()
    except UsageError:
        results.put(False)
        return
    results.put(True)
    done.wait(30)
    lock.release()


def race(location: str, n: int) -> list[bool]:
    """`n` processes started together, each racing for the lock at `location`; who got it."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    go, results, done = ctx.Barrier(n), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=race_for_lock, args=(location, go, results, done))
             for _ in range(n)]
    for p in procs:
        p.start()
    got = [results.get(timeout=60) for _ in range(n)]
    done.set()
    for p in procs:
        p.join(timeout=30)
    return got
