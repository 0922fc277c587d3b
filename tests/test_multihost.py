"""Real multi-process JAX runs on one machine: 2 and 4 processes on loopback, CPU devices.

Each process (tests/helpers/multihost_worker.py) reads its shard with make_training_pipeline,
assembles global batches with jax.make_array_from_process_local_data and runs a jitted step
with the segment kernels over a mesh spanning every process. Checked: the global batches equal
bit for bit those of one process reading every shard itself (and, for packed rows, those of one
host with the whole global batch); every row / example of an epoch is read exactly once across
the processes; every process resumes exactly from its own state; a packed state of 2 processes
restores 4; online packing saved on 4 processes resumes on 2 and 3, and on 2 grows to 4, with
every example once. Processes run in a session of their own, each wait has a timeout, and the
session is killed in a `finally` (a failing test leaves nothing behind).
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import pickle
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers.packed_rows import B, D, balanced_dir, packed_dir

pytest.importorskip("array_record.python.array_record_module")
pytestmark = pytest.mark.slow
TIMEOUT = 240
ROOT = pathlib.Path(__file__).resolve().parents[1]  # the tree: `tests` imports from it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path, *, processes: int, devices: int, name: str, **args) -> list[dict]:
    """Runs the worker as `processes` JAX processes of `devices` CPU devices each; their
    outputs, in process order. Every process is killed (its session) when this returns."""
    port, procs = _free_port(), []
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    outs = [tmp_path / f"{name}_{i}.pkl" for i in range(processes)]
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in args.items()]
    try:
        for i in range(processes):
            log = open(tmp_path / f"{name}_{i}.log", "w")  # noqa: SIM115 - closed by the child
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.helpers.multihost_worker", *flags,
                 f"--processes={processes}", f"--process-id={i}", f"--port={port}",
                 f"--out={outs[i]}"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True))
            log.close()
        for i, p in enumerate(procs):
            try:
                rc = p.wait(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                rc = "timeout"
            assert rc == 0, (f"process {i} of {name}: {rc}\n"
                             + (tmp_path / f"{name}_{i}.log").read_text()[-3000:])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
    results = []
    for out in outs:
        with open(out, "rb") as f:
            results.append(pickle.load(f))
    return results


def _assert_batches_equal(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].dtype == y[k].dtype and np.array_equal(x[k], y[k]), k


MODES = {  # mode -> (global batch, steps, save at)
    "packed": (8, 6, 2),
    "balanced": (D * B, 4, 1),
    "online": (8, 6, 3),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    packed = tmp_path_factory.mktemp("packed")
    balanced = tmp_path_factory.mktemp("balanced")
    return {"packed": (packed, packed_dir(packed, n=300)),
            "balanced": (balanced, balanced_dir(balanced)[0]), "online": ("", None)}


@pytest.mark.parametrize("processes", [2, 4])
@pytest.mark.parametrize("mode", list(MODES))
def test_processes_make_the_global_batches_of_one(tmp_path, data, mode, processes):
    G, steps, save_at = MODES[mode]
    path, stored = data[mode]
    devices = D // processes if mode == "balanced" else 2
    kw = dict(mode=mode, data=path, global_batch=G, steps=steps, save_at=save_at)
    runs = launch(tmp_path, processes=processes, devices=devices, name="multi", **kw)
    ref = launch(tmp_path, processes=1, devices=devices * processes, name="ref",
                 simulate=processes, **kw)[0]
    assert len(ref["batches"]) == steps and ref["batches"][0]["tokens"].shape[0] == G
    for r in runs:  # every process sees the same global batches: one process's, bit for bit
        _assert_batches_equal(r["batches"], ref["batches"])
        assert np.allclose(r["losses"], ref["losses"], rtol=1e-6) and np.isfinite(r["losses"]).all()
        _assert_batches_equal(r["resumed"], r["batches"][save_at:])  # resumed exactly
    if mode != "online":  # rows: one host with the whole global batch reads the same
        one = launch(tmp_path, processes=1, devices=devices * processes, name="one", **kw)[0]
        _assert_batches_equal(runs[0]["batches"], one["batches"])
    # every row / example of the epoch read exactly once across the processes
    seen = collections.Counter(x for r in runs for x in r["epoch"])
    if mode == "online":
        assert sorted(seen) == list(range(400)) and set(seen.values()) == {1}
    else:
        whole = len(stored) // (D * B) * D * B if mode == "balanced" else len(stored)
        index = {tuple(r["segment_source_index"].tolist()): i for i, r in enumerate(stored)}
        assert sorted(index[t] for t in seen) == list(range(whole))
        assert set(seen.values()) == {1}


def test_worker_processes_in_every_process_change_nothing(tmp_path, data):
    """Packed rows with 2 worker processes per JAX process: the same global batches as one
    process without workers, and each process resumes from its own (per-worker) state."""
    path, _ = data["packed"]
    kw = dict(mode="packed", data=path, global_batch=8, steps=5, save_at=2)
    runs = launch(tmp_path, processes=2, devices=2, name="workers", workers=2, **kw)
    one = launch(tmp_path, processes=1, devices=4, name="one", **kw)[0]
    for r in runs:
        _assert_batches_equal(r["batches"], one["batches"])
        _assert_batches_equal(r["resumed"], r["batches"][2:])


def test_a_packed_state_of_two_processes_restores_four(tmp_path, data):
    path, _ = data["packed"]
    kw = dict(mode="packed", data=path, global_batch=8)
    two = launch(tmp_path, processes=2, devices=2, name="two", steps=5, save_at=2, **kw)
    state = tmp_path / "state.json"
    state.write_text(json.dumps(two[1]["state"]))  # any host's state
    four = launch(tmp_path, processes=4, devices=1, name="four", steps=3,
                  resume_state=state, **kw)
    for r in four:
        _assert_batches_equal(r["batches"], two[0]["batches"][2:])


@pytest.mark.parametrize("before,after", [(4, 2), (4, 3), (2, 4)])
def test_online_packing_saved_on_some_processes_resumes_on_others(tmp_path, before, after):
    """Online packing on `before` processes saves through Orbax's Grain handler (one file a
    process) after 3 global steps; `after` processes restore from all of them
    (`ElasticCheckpointHandler`), make 3 global steps and read their rows to the end: every
    example of the epoch once, in the global batches before and after or the rows after."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    kw = dict(mode="online", global_batch=12, steps=3, save_at=3, drain=1)
    first = launch(tmp_path, processes=before, devices=1, name="save", save_dir=ckpt, **kw)
    assert sorted(p.name for p in ckpt.iterdir()) == [f"process_{i}-of-{before}.json"
                                                      for i in range(before)]
    second = launch(tmp_path, processes=after, devices=1, name="restore", restore_dir=ckpt,
                    **kw)
    ids = lambda batches: [int(t[o]) - 1000 for b in batches for t, offs, ns in zip(  # noqa: E731
        b["tokens"], b["tokens_segment_offsets"], b["tokens_segment_lengths"], strict=True)
        for o, n in zip(offs, ns, strict=True) if n]
    for r in second:  # every process assembled the same global batches
        _assert_batches_equal(r["batches"], second[0]["batches"])
    seen = collections.Counter(ids(first[0]["batches"]) + ids(second[0]["batches"])
                               + [i for r in second for i in r["drained"]])
    assert sorted(seen) == list(range(400)) and set(seen.values()) == {1}


def test_a_failing_process_stops_them_all(tmp_path):
    """A process that cannot start (no data) fails the launch; the others, left waiting for
    it at the coordinator, are killed with their sessions: none is left running."""
    with pytest.raises(AssertionError, match="process 0 of broken"):
        launch(tmp_path, processes=2, devices=1, name="broken", mode="packed",
               data=tmp_path / "missing", global_batch=4, steps=2)
    left = subprocess.run(["pgrep", "-f", f"multihost_worker.*{tmp_path}"],
                          capture_output=True, text=True)
    assert left.stdout.strip() == ""
