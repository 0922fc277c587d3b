"""A real local `dask.distributed` cluster for tests: `dask scheduler` + `dask worker --nworkers 2`.

`local_cluster(directory)` starts a scheduler bound to 127.0.0.1 on a free port (its HTTP
`/health` route, served without bokeh, says when it is up), then one `dask worker` process with
two worker processes, waits until the scheduler sees both, yields the scheduler's address
("127.0.0.1:PORT") and stops the workers, then the scheduler; logs and dask's scratch space go
to `directory`. A test module wraps it in a fixture:

    @pytest.fixture(scope="module")
    def dask_address(tmp_path_factory):
        with local_cluster(tmp_path_factory.mktemp("dask")) as address:
            yield address

The scheduler and the workers import the test modules' functions by name: they run with the
repository root on PYTHONPATH.

`one_output_per_bundle(address)` patches Beam's Dask runner on the workers for the duration of
a `with` block so that each DoFn bundle returns only its own outputs (see its docstring).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
from collections.abc import Iterator

from tests.helpers.cloud import _executable, _free_port, _start, _stop

_WORKERS = 2
_REPO = pathlib.Path(__file__).resolve().parents[2]  # the workers import tests.*


@contextlib.contextmanager
def local_cluster(d: pathlib.Path) -> Iterator[str]:
    from distributed import Client

    port, http = _free_port(), _free_port()
    address = f"127.0.0.1:{port}"
    env = {**os.environ, "DASK_TEMPORARY_DIRECTORY": str(d), "PYTHONPATH": os.pathsep.join(
        [str(_REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}  # scratch space in d
    scheduler = _start([_executable("dask"), "scheduler", "--host", "127.0.0.1", "--port",
                        str(port), "--dashboard-address", f"127.0.0.1:{http}"],
                       f"http://127.0.0.1:{http}/health", str(d / "scheduler.log"), env=env)
    try:
        log = open(d / "workers.log", "wb")  # closed by _stop
        workers = subprocess.Popen(
            [_executable("dask"), "worker", f"tcp://{address}", "--nworkers", str(_WORKERS),
             "--nthreads", "1", "--no-dashboard", "--host", "127.0.0.1"],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=d)
        workers.log = log  # type: ignore[attr-defined]
        try:
            with Client(address, timeout=30) as client:
                client.wait_for_workers(_WORKERS, timeout=60)
            yield address
        finally:
            _stop(workers)
    finally:
        _stop(scheduler)


def _set_receiver_reset(on: bool) -> None:
    """Run on each worker: wraps (or unwraps) the runner's bundle function."""
    from apache_beam.runners.dask import transform_evaluator as te

    original = getattr(te, "_seqpack_original", te.apply_dofn_to_bundle)
    te._seqpack_original = original

    def apply_dofn_to_bundle(items, invoker_args, invoker_kwargs, tagged_receivers):
        tagged_receivers.values.clear()  # the outputs of an earlier run of this op
        return original(items, invoker_args, invoker_kwargs, tagged_receivers)

    te.apply_dofn_to_bundle = apply_dofn_to_bundle if on else original


@contextlib.contextmanager
def one_output_per_bundle(address: str) -> Iterator[None]:
    """Beam's Dask runner with its one multiplicity fault mended on the cluster's workers.

    `transform_evaluator.ParDo.apply` makes one receiver list per ParDo when the graph is
    built and ships it inside the task graph; `apply_dofn_to_bundle` returns everything in it,
    never emptying it. A side input is recomputed inside the task that reads it, from a graph
    pickled after that task's main input already filled the list, so the side input gets every
    element twice. Emptying the list at the start of each bundle gives each output once (what
    Beam promises); the job then runs as on any runner that keeps that promise.
    """
    from distributed import Client

    with Client(address, timeout=30) as client:
        client.run(_set_receiver_reset, True)
        try:
            yield
        finally:
            client.run(_set_receiver_reset, False)
