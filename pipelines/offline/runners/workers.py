"""Worker processes of a packing run: a pool that starts only when there is work for it.

The processes come from multiprocessing's fork server (which preloads the local runner, so each
worker is a fork with numpy, pyarrow and array_record already imported), run calls in order
with at most two per process in flight, and end with the run:

- a worker ignores SIGINT and SIGTERM: Ctrl-C reaches every process of the terminal's group, but
  only the run decides what happens (it kills its workers and exits with one message). The fork
  server and multiprocessing's resource tracker are started with SIGINT ignored too (an
  interrupt while they import would print "Fatal Python error: init_import_site"), and with
  their stderr on /dev/null (a fork server that loses the run mid-request prints "EOFError: Ran
  out of input"), unless SEQPACK_DEBUG is set;
- each worker watches the run's pid and exits when the run is gone, so a killed `seqpack pack`
  leaves no writer behind;
- a worker that dies (the kernel's OOM killer, a signal) fails the run with `RunFailed` saying
  which signal and what to do, never a `BrokenProcessPool` traceback;
- `close(kill=True)` (an interrupted or failed run) kills the workers at once instead of waiting
  for their current shard, so an interrupt ends the run within a second.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from seqpack.pipelines.errors import RunFailed

_PRELOAD = ["seqpack.pipelines.offline.runners.local", "pyarrow.parquet"]
_RETRY = ("pass fewer workers= or a smaller shard_rows= if memory is short, then run the same "
          "job with existing='resume'")


def _init_worker(run_pid: int, environ: dict[str, str]) -> None:
    """Takes the run's environment as it is now (the fork server keeps the one of its start:
    credentials or emulator variables set since would be missing), ignores interrupts (the run
    handles them) and dies with the run.

    A worker's parent is the fork server, not the run, so it watches the run's process itself
    (a pidfd where Linux has one, else it polls) and exits when the run is gone.
    """
    import threading

    os.environ.clear()
    os.environ.update(environ)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def watch() -> None:
        try:
            fd = os.pidfd_open(run_pid)
        except (AttributeError, OSError):
            fd = None
        if fd is not None:
            import select

            select.select([fd], [], [])  # readable once the process has exited
        else:  # pragma: no cover - no pidfd (not Linux, or an old kernel)
            while True:
                time.sleep(0.5)
                try:
                    os.kill(run_pid, 0)
                except ProcessLookupError:
                    break
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="seqpack-run-watch").start()


def _start_forkserver(context: Any) -> None:
    """Starts multiprocessing's fork server (once per process) shielded from interrupts and,
    unless SEQPACK_DEBUG is set, with its stderr on /dev/null (see the module docstring)."""
    from multiprocessing import forkserver, resource_tracker

    context.set_forkserver_preload(_PRELOAD)
    saved = signal.signal(signal.SIGINT, signal.SIG_IGN)
    stderr = None
    if not os.environ.get("SEQPACK_DEBUG"):
        with contextlib.suppress(OSError):  # no fd 2 at all (`2>&-`): nothing to quiet
            stderr = os.dup(2)
    try:
        if stderr is not None:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 2)
            os.close(null)
        resource_tracker.ensure_running()
        forkserver.ensure_running()
    finally:
        if stderr is not None:
            os.dup2(stderr, 2)
            os.close(stderr)
        signal.signal(signal.SIGINT, saved)


def _unguarded_main() -> str:
    """A hint for a run started from a script: every worker process imports the script (as
    multiprocessing does), so a call at its top level runs again in each worker."""
    import sys

    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path or os.path.basename(path) in ("cli.py", "seqpack", "__main__.py"):
        return ""
    return (f"; or, if {path} calls pack() or verify() at its top level, put the call under "
            "`if __name__ == \"__main__\":` (each worker process imports the script)")


class Workers:
    """Runs calls in up to `n` worker processes, in order, at most 2 per process in flight (so
    results never pile up). The processes start on the first `map` with more than one call;
    with n == 1, or one call, everything runs in this process."""

    def __init__(self, n: int, *, retry: str = _RETRY):
        """`retry`: what the error of a dead worker tells the user to do."""
        self.n = n
        self.retry = retry
        self.pool: Any = None

    def _start(self) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        context: Any
        if "forkserver" in multiprocessing.get_all_start_methods():
            context = multiprocessing.get_context("forkserver")
            _start_forkserver(context)
        else:  # pragma: no cover - not on Linux
            context = multiprocessing.get_context("spawn")
        self.pool = ProcessPoolExecutor(self.n, mp_context=context, initializer=_init_worker,
                                        initargs=(os.getpid(), dict(os.environ)))

    def map(self, fn: Callable[..., Any], calls: Iterable[tuple], count: int, *,
            what: str = "working", in_flight: int | None = None) -> Iterator[Any]:
        """fn(*call) for each of the `count` calls (made lazily: a shard's call holds its
        pieces), results in order. `what` names the work in the error of a dead worker;
        `in_flight`: at most this many calls submitted at once (default 2 per process), so at
        most that many run at once."""
        if self.pool is None and self.n > 1 and count > 1:
            self._start()
        if self.pool is None:
            for args in calls:
                yield fn(*args)
            return
        from collections import deque
        from concurrent.futures.process import BrokenProcessPool

        pending: deque = deque()
        try:
            for args in calls:
                pending.append(self.pool.submit(fn, *args))
                if len(pending) >= (in_flight or 2 * self.n):
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        except BrokenProcessPool:
            raise RunFailed(0, self._death(what)) from None

    def _death(self, what: str) -> str:
        codes = [p.exitcode for p in list(getattr(self.pool, "_processes", {}).values())
                 if p.exitcode is not None]
        killed = [-c for c in codes if c < 0 and -c != signal.SIGTERM] or \
            [-c for c in codes if c < 0]
        how = f"was killed by {signal.Signals(killed[0]).name}" if killed else "died"
        oom = " (SIGKILL: often the kernel's out-of-memory killer)" \
            if killed and killed[0] == signal.SIGKILL else ""
        return f"a worker process {how}{oom} while {what}; {self.retry}{_unguarded_main()}"

    def close(self, *, kill: bool = False) -> None:
        """Ends the pool: waits for the calls in flight, or (`kill`) kills the workers now."""
        pool, self.pool = self.pool, None
        if pool is None:
            return
        if kill:
            processes = list(getattr(pool, "_processes", {}).values())
            for p in processes:
                with contextlib.suppress(OSError, AttributeError):
                    p.kill()
            # What the pool's calls queue holds would never be read: its feeder thread must not
            # be joined at exit (Python < 3.12 joins it, and hangs where the pipe was full).
            with contextlib.suppress(AttributeError):
                pool._call_queue.cancel_join_thread()
            pool.shutdown(wait=False, cancel_futures=True)
            for p in processes:
                p.join(timeout=5)
            return
        pool.shutdown(wait=True, cancel_futures=True)
