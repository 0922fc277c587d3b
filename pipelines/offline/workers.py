"""Worker processes of a packing run: a pool that starts only when there is work for it.

The processes come from multiprocessing's fork server (which preloads the writer, so each worker
is a fork with numpy, pyarrow and array_record already imported), run calls in order with at
most two per process in flight, and exit with the run: each watches the run's pid, so a killed
`seqpack pack` leaves no writer behind.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any


def default_workers() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _init_worker(run_pid: int) -> None:
    """Worker processes die with the run: a killed `seqpack pack` leaves no writer behind.

    A worker's parent is the fork server, not the run, so it watches the run's process itself
    (a pidfd where Linux has one, else it polls) and exits when the run is gone.
    """
    import threading

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


class Workers:
    """Runs calls in up to `n` worker processes, in order, at most 2 per process in flight (so
    results never pile up). The processes start on the first `map` with more than one call;
    with n == 1, or one call, everything runs in this process."""

    def __init__(self, n: int):
        self.n = n
        self.pool: Any = None

    def map(self, fn: Callable[..., Any], calls: Iterable[tuple], count: int) -> Iterator[Any]:
        """fn(*call) for each of the `count` calls (made lazily: a shard's call holds its
        pieces), results in order."""
        if self.pool is None and self.n > 1 and count > 1:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            context: Any
            if "forkserver" in multiprocessing.get_all_start_methods():
                context = multiprocessing.get_context("forkserver")
                # The fork server imports the writer (numpy, pyarrow, array_record) once; each
                # worker is a fork of it.
                context.set_forkserver_preload(["seqpack.pipelines.offline.writer",
                                                "pyarrow.parquet"])
            else:  # pragma: no cover - not on Linux
                context = multiprocessing.get_context("spawn")
            self.pool = ProcessPoolExecutor(self.n, mp_context=context,
                                            initializer=_init_worker, initargs=(os.getpid(),))
        if self.pool is None:
            for args in calls:
                yield fn(*args)
            return
        from collections import deque

        pending: deque = deque()
        for args in calls:
            pending.append(self.pool.submit(fn, *args))
            if len(pending) >= 2 * self.n:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
