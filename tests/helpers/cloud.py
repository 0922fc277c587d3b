"""Real object-storage servers for tests: `gcp-storage-emulator` (GCS JSON API) and moto (S3).

Session-scoped fixtures start each server once, as a subprocess bound to 127.0.0.1 on a free
port, wait until it answers, create a bucket and stop the server at the end of the session.
The function-scoped fixtures `gcs` and `s3` point the standard variables at them for one test
(`STORAGE_EMULATOR_HOST`; `AWS_ENDPOINT_URL` with dummy credentials) and give it a fresh prefix:

    def test_x(gcs):
        url = gcs.url("data/a.parquet")        # gs://seqpack-test/<unique>/data/a.parquet
        gcs.upload(local_path, url)

Subprocesses started by a test (the CLI) inherit the variables. A test module using them imports
the fixtures: ``from tests.helpers.cloud import gcs, gcs_server, s3, s3_server  # noqa: F401``.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

BUCKET = "seqpack-test"
_STARTUP_S = 60
_prefixes = itertools.count()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _executable(name: str) -> str:
    """A console script of this Python's environment (or on PATH); skips the test if absent."""
    local = os.path.join(os.path.dirname(sys.executable), name)
    found = local if os.path.exists(local) else shutil.which(name)
    if not found:
        pytest.skip(f"{name} is not installed (pip install '.[test]')")
    return found


def _start(args: list[str], ready_url: str, log_path: str, *,
           env: dict[str, str] | None = None) -> subprocess.Popen:
    """Starts a server and waits until `ready_url` answers (any HTTP status)."""
    log = open(log_path, "wb")  # closed by _stop
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    proc.log = log  # type: ignore[attr-defined]
    deadline = time.monotonic() + _STARTUP_S
    while True:
        if proc.poll() is not None:
            log.close()
            with open(log_path, errors="replace") as f:
                raise RuntimeError(f"{args[0]} exited with {proc.returncode}: {f.read()[-2000:]}")
        try:
            urllib.request.urlopen(ready_url, timeout=1).close()
            return proc
        except urllib.error.HTTPError:
            return proc  # it answers
        except OSError:
            if time.monotonic() > deadline:
                _stop(proc)
                raise RuntimeError(
                    f"{args[0]} did not answer {ready_url} in {_STARTUP_S} s") from None
            time.sleep(0.1)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.log.close()  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory) -> Iterator[str]:
    """A gcp-storage-emulator (in memory) holding bucket `BUCKET`; yields its endpoint."""
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = str(tmp_path_factory.mktemp("gcs") / "server.log")
    proc = _start([_executable("gcp-storage-emulator"), "start", "--host", "127.0.0.1",
                   "--port", str(port), "--in-memory", "--default-bucket", BUCKET],
                  f"{endpoint}/storage/v1/b", log)
    yield endpoint
    _stop(proc)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Iterator[str]:
    """A moto S3 server holding bucket `BUCKET`; yields its endpoint."""
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = str(tmp_path_factory.mktemp("s3") / "server.log")
    proc = _start([_executable("moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                  f"{endpoint}/moto-api/", log)
    request = urllib.request.Request(f"{endpoint}/{BUCKET}", method="PUT")  # create the bucket
    urllib.request.urlopen(request, timeout=10).close()
    yield endpoint
    _stop(proc)


@dataclasses.dataclass
class Store:
    """One test's prefix in a server's bucket, and the fsspec filesystem to reach it."""

    scheme: str
    prefix: str  # bucket/unique-prefix

    def url(self, name: str = "") -> str:
        return f"{self.scheme}://{self.prefix}/{name}"

    @property
    def fs(self):
        import fsspec

        # A new instance: fsspec's cached one keeps the endpoint of the test that made it (each
        # test module that imports the fixtures has a server of its own).
        options = {"token": "anon"} if self.scheme == "gs" else {}
        return fsspec.filesystem(self.scheme, skip_instance_cache=True, **options)

    def upload(self, local: str | os.PathLike, url: str) -> str:
        """Uploads a file, or a directory's files (not recursive) under the prefix `url`."""
        local = os.fspath(local)
        if os.path.isdir(local):
            for name in sorted(os.listdir(local)):
                if os.path.isfile(os.path.join(local, name)):
                    self.upload(os.path.join(local, name), url.rstrip("/") + "/" + name)
            return url
        self.fs.put_file(local, url.split("://", 1)[1])
        return url


def _store(scheme: str) -> Store:
    import fsspec

    # The library's own fsspec instances are cached by their options, not by the endpoint
    # these variables name: one made for another module's server would still point there.
    fsspec.get_filesystem_class(scheme).clear_instance_cache()
    return Store(scheme, f"{BUCKET}/t{os.getpid()}-{next(_prefixes)}")


@pytest.fixture
def gcs(gcs_server, monkeypatch) -> Store:
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server)
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    return _store("gs")


@pytest.fixture
def s3(s3_server, monkeypatch) -> Store:
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    return _store("s3")
