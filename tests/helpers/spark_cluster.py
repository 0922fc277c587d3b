"""A real Spark standalone cluster for tests and benchmarks: a master and worker daemons.

`standalone_cluster(directory, workers=2)` starts, through `spark-class` from the pyspark
package (with the machine's `java`), a master bound to 127.0.0.1 on a free port and `workers`
worker daemons of one core each, waits until the master's JSON page lists them all alive, yields
a `Cluster` (its `spark://` URL, the daemons) and then stops every process it started: the
daemons, and the executors they launched. Logs and the workers' scratch space go to
`directory`. Every process is started in a session of its own, so `Cluster.processes()` finds
them all (executors and their Python workers included) and the end of the `with` block checks
that none is left. The daemons inherit the environment, PYTHONPATH included: their executors'
Python workers import seqpack through it. A test module wraps it in a fixture:

    @pytest.fixture(scope="module")
    def cluster(tmp_path_factory):
        with standalone_cluster(tmp_path_factory.mktemp("spark")) as c:
            yield c
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

from tests.helpers.cloud import _free_port
from tests.helpers.runs import session

_STARTUP_S = 120


def spark_class() -> str | None:
    """The pyspark package's `spark-class` script, or None when pyspark or java is missing."""
    try:
        import pyspark
    except ImportError:
        return None
    if shutil.which("java") is None:
        return None
    path = pathlib.Path(pyspark.__file__).parent / "bin" / "spark-class"
    return str(path) if path.exists() else None


def environment(directory: pathlib.Path) -> dict[str, str]:
    """What the daemons run with: loopback only, logs and scratch space in `directory`, this
    Python for the executors' workers, and seqpack importable."""
    repo_parent = str(pathlib.Path(__file__).resolve().parents[2].parent)
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_LOG_DIR": str(directory),
            "SPARK_WORKER_DIR": str(directory / "work"), "PYSPARK_PYTHON": sys.executable,
            "SPARK_LOCAL_DIRS": str(directory / "local"),
            "PYTHONPATH": os.pathsep.join(pythonpath or [repo_parent])}


@dataclasses.dataclass
class Cluster:
    url: str  # spark://127.0.0.1:PORT
    ui: str  # the master's web UI (its /json/ page lists workers and applications)
    daemons: list[subprocess.Popen]
    env: dict[str, str]

    def state(self) -> dict:
        with urllib.request.urlopen(f"{self.ui}/json/", timeout=5) as r:
            return json.loads(r.read())

    def processes(self) -> list[int]:
        """Every live process of the cluster: daemons, executors, their Python workers."""
        return sorted({p for d in self.daemons for p in session(d.pid)})

    def executors(self) -> list[int]:
        """The pids of the executor JVMs running now."""
        found = []
        for pid in self.processes():
            with contextlib.suppress(OSError):
                if b"CoarseGrainedExecutorBackend" in pathlib.Path(
                        f"/proc/{pid}/cmdline").read_bytes():
                    found.append(pid)
        return found


def _daemon(args: list[str], log: pathlib.Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def _wait_alive(cluster: Cluster, workers: int, directory: pathlib.Path) -> None:
    deadline = time.monotonic() + _STARTUP_S
    while True:
        dead = [d for d in cluster.daemons if d.poll() is not None]
        if dead:
            logs = "\n".join(p.read_text(errors="replace")[-1500:]
                             for p in sorted(directory.glob("*.log")))
            raise RuntimeError(f"a Spark daemon exited with {dead[0].returncode}:\n{logs}")
        with contextlib.suppress(OSError, ValueError):
            alive = [w for w in cluster.state().get("workers", []) if w.get("state") == "ALIVE"]
            if len(alive) >= workers:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the Spark master did not see {workers} workers in "
                               f"{_STARTUP_S} s (logs in {directory})")
        time.sleep(0.2)


def _stop(cluster: Cluster) -> None:
    """SIGTERM to every process of the cluster's sessions, then SIGKILL to what is left."""
    for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        for pid in cluster.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while cluster.processes() and time.monotonic() < deadline:
            for d in cluster.daemons:
                d.poll()  # reaps the daemons themselves
            time.sleep(0.1)
    for d in cluster.daemons:
        with contextlib.suppress(subprocess.TimeoutExpired):
            d.wait(5)


@contextlib.contextmanager
def standalone_cluster(directory: pathlib.Path, *, workers: int = 2, memory: str = "2g"
                       ) -> Iterator[Cluster]:
    """A master and `workers` one-core workers of `memory` each (see the module docstring)."""
    script = spark_class()
    if script is None:
        import pytest

        pytest.skip("a Spark cluster needs pyspark and java (pip install '.[spark]')")
    directory.mkdir(parents=True, exist_ok=True)
    env = environment(directory)
    port, ui = _free_port(), _free_port()
    url = f"spark://127.0.0.1:{port}"
    daemons = [_daemon([script, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                        "--port", str(port), "--webui-port", str(ui)],
                       directory / "master.log", env)]
    cluster = Cluster(url, f"http://127.0.0.1:{ui}", daemons, env)
    try:
        for k in range(workers):
            daemons.append(_daemon(
                [script, "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                 "--cores", "1", "--memory", memory, "--webui-port", str(_free_port()),
                 "--work-dir", str(directory / "work"), url],
                directory / f"worker-{k}.log", env))
        _wait_alive(cluster, workers, directory)
        yield cluster
    finally:
        _stop(cluster)
    left = cluster.processes()
    assert not left, f"Spark processes left behind: {left}"
