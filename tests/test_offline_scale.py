"""The offline job at scale: two passes through a spill, blocks, workers, bounded memory.

Every run here is compared with an in-memory reference: `packer.plan` + `packer.assemble` on the
whole corpus (the same bytes the writer made before it streamed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from seqpack.packer import PackConfig, assemble, plan
from seqpack.packer.order import CostModel, RowOrder
from seqpack.packer.plan import plan_rows
from seqpack.packer.stats import stats
from seqpack.pipelines.formats.inputs import ReadOptions
from seqpack.pipelines.formats.manifest import INTENT
from seqpack.pipelines.offline import PackJob, WriteOptions
from seqpack.pipelines.offline.job import SPILL_DIR
from seqpack.pipelines.offline.runners import pack_to_dir
from seqpack.pipelines.offline.shards import read_shard
from tests.helpers.files import (
    ROOT,
    dir_bytes,
    random_seqs,
    run_cli,
    write_arrayrecord,
    write_jsonl,
    write_parquet,
)


def _corpus(tmp_path, n_files: int = 3, n: int = 400, max_len: int = 120):
    """Inputs in three formats (int32, int64 and uint16 ids), and their examples back to back."""
    import pyarrow as pa

    seqs, paths = [], []
    for i in range(n_files):
        part = random_seqs(n, max_len=max_len, seed=10 + i)
        kind = i % 3
        if kind == 0:
            paths.append(write_parquet(tmp_path / f"{i}.parquet", part, value_type=pa.uint16()))
        elif kind == 1:
            paths.append(write_jsonl(tmp_path / f"{i}.jsonl", part))
        else:
            paths.append(write_arrayrecord(tmp_path / f"{i}.arrayrecord", part))
        seqs += part
    lengths = np.array([len(s) for s in seqs], np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    values = np.concatenate([np.asarray(s, np.int64) for s in seqs])
    return paths, values, offsets


def _rows(out) -> dict[str, np.ndarray]:
    manifest = json.loads((out / "manifest.json").read_text())
    parts = [read_shard(str(out), name, n)
             for name, n in zip(manifest["shards"], manifest["shard_num_rows"])]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


@pytest.mark.parametrize("block_size", [None, 97])
def test_two_passes_give_the_in_memory_rows(tmp_path, block_size):
    paths, values, offsets = _corpus(tmp_path)
    config = PackConfig(64, max_segments=6, overflow="split")
    out = tmp_path / "out"
    manifest = pack_to_dir(PackJob(paths, out, config, workers=1, order=RowOrder("plan"),
                                   block_size=block_size or plan_rows([], config).block_size))
    p = plan(np.diff(offsets), config, block_size=block_size)
    want = assemble(values.astype(np.int32), offsets, p, config)
    got = _rows(out)
    for key in ("tokens", "tokens_segment_lengths", "tokens_segment_offsets",
                "segment_source_index", "segment_source_start"):
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    assert got["tokens"].dtype == np.int32  # uint16, int64 (narrowed) and int32 inputs together
    got_stats = dict(manifest.stats)
    tenths = got_stats.pop("along_output")["rows"]
    assert sum(tenths) == p.num_rows and max(tenths) - min(tenths) <= 1
    want_stats = stats(p, seq_len=64, max_segments=6, cost=CostModel()).to_dict()
    for key in ("cost_total", "row_cost_max_over_mean"):  # costs summed block by block
        assert got_stats.pop(key) == pytest.approx(want_stats.pop(key))
    assert got_stats == want_stats
    assert manifest.plan_block_size == (block_size or plan_rows([], config).block_size)
    assert not (out / SPILL_DIR).exists()
    if block_size:  # blocks are planned apart: a few more rows than one global plan
        assert p.num_rows >= plan(np.diff(offsets), config).num_rows


def test_one_and_two_workers_write_the_same_bytes(tmp_path):
    paths, _, _ = _corpus(tmp_path, n_files=4, n=300)
    config = PackConfig(48, max_segments=4, overflow="truncate")
    options = dict(read_options=ReadOptions())
    pack_to_dir(PackJob(paths, tmp_path / "one", config, workers=1, **options))
    small = WriteOptions(shard_rows=37)
    pack_to_dir(PackJob(paths, tmp_path / "two", config, workers=2, write_options=small,
                        **options))
    pack_to_dir(PackJob(paths, tmp_path / "one-small", config, workers=1, write_options=small,
                        **options))
    assert dir_bytes(tmp_path / "two") == dir_bytes(tmp_path / "one-small")
    assert _rows(tmp_path / "two")["tokens"].tobytes() == _rows(tmp_path / "one")[
        "tokens"].tobytes()


def test_blocks_planned_in_two_workers_write_the_bytes_of_one(tmp_path, monkeypatch):
    """Past one block the plan is made in the worker processes, as many blocks at once as the
    memory holds: the same bytes as one worker planning the blocks in turn."""
    from seqpack.pipelines.offline.runners import local as local_mod
    from seqpack.pipelines.offline.runners import workers as workers_mod

    paths, _, _ = _corpus(tmp_path, n_files=4, n=300)
    config = PackConfig(48, max_segments=4, overflow="split")
    seen = []
    real = workers_mod.Workers.map

    def spy(self, fn, calls, count, *, what="working", in_flight=None):
        seen.append((what, count, self.n, in_flight))
        return real(self, fn, calls, count, what=what, in_flight=in_flight)

    monkeypatch.setattr(workers_mod.Workers, "map", spy)
    for name, n in (("one", 1), ("two", 2)):
        pack_to_dir(PackJob(paths, tmp_path / name, config, workers=n, block_size=97,
                            write_options=WriteOptions(shard_rows=37)))
    blocks = [s[1:] for s in seen if s[0] == "planning blocks"]
    assert len(blocks) == 1 and blocks[0][1:] == (2, 2)  # one worker: planned in this process
    assert blocks[0][0] > 2  # several blocks of 97 examples
    assert dir_bytes(tmp_path / "two") == dir_bytes(tmp_path / "one")
    # memory for one block's plan only: planned in this process, one block after the other
    monkeypatch.setattr(local_mod, "available_memory", lambda: 97 * local_mod._PLAN_BYTES)
    seen.clear()
    pack_to_dir(PackJob(paths, tmp_path / "short", config, workers=2, block_size=97,
                        write_options=WriteOptions(shard_rows=37)))
    assert "planning blocks" not in [s[0] for s in seen]
    assert dir_bytes(tmp_path / "short") == dir_bytes(tmp_path / "one")


@pytest.mark.parametrize("n,dtype", [(0, np.int32), (1, np.int32), (16, np.int32),
                                     (1001, np.int32), (300, np.int64)])
def test_example_starts_are_the_offsets_of_the_lengths(n, dtype):
    """The local runner's example starts (the lengths and every 16th start) give the offsets
    an i64 cumsum gives, for every example and any order of them."""
    from seqpack.pipelines.offline.runners.spill import ExampleStarts

    rng = np.random.default_rng(n)
    lengths = rng.integers(0, 3000, n).astype(dtype)
    if dtype == np.int64 and n:
        lengths[::7] += 2**33  # past i32 sums and lengths
    offsets = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
    starts = ExampleStarts.of(lengths)
    every = np.arange(n)
    assert np.array_equal(starts(every), offsets[:-1])
    shuffled = rng.permutation(n)
    assert np.array_equal(starts(shuffled), offsets[shuffled])


def test_a_failed_read_leaves_no_directory_behind(tmp_path):
    good = write_jsonl(tmp_path / "a.jsonl", random_seqs(20))
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"tokens": [1, -2]}\n')
    out = tmp_path / "out"
    result = run_cli("pack", good, bad, "-o", out)
    assert result.returncode == 2 and "b.jsonl" in result.stderr
    assert not out.exists()


def _kill_when(cmd: list, out, ready, env: dict) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "seqpack.cli", *map(str, cmd)], cwd=ROOT,
                            env=dict(os.environ, **env), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None and not ready():
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_sigkill_in_the_read_pass_then_resume(tmp_path, workers):
    paths = [write_jsonl(tmp_path / f"{i}.jsonl", random_seqs(300, max_len=90, seed=i))
             for i in range(6)]
    args = ["--seq-len", 128, "--max-segments", 8, "--shard-rows", 30, "--workers", workers]
    clean = tmp_path / "clean"
    assert run_cli("pack", *paths, "-o", clean, *args).returncode == 0
    out = tmp_path / "out"
    spill = out / SPILL_DIR

    def reading():  # inputs spilled, nothing planned yet
        return spill.is_dir() and len(os.listdir(spill)) >= 2 and not (out / INTENT).exists()

    _kill_when(["pack", *paths, "-o", out, *args], out, reading,
               {"SEQPACK_TEST_SHARD_DELAY": "0.3"})
    assert spill.is_dir() and not (out / INTENT).exists() and not (out / "manifest.json").exists()
    result = run_cli("pack", *paths, "-o", out, *args, "--resume")
    assert result.returncode == 0, result.stderr
    assert dir_bytes(out) == dir_bytes(clean)


@pytest.mark.slow  # seconds of subprocesses; the fault tests cover the fast path
def test_sigkill_in_the_write_pass_with_workers_then_resume(tmp_path):
    paths = [write_jsonl(tmp_path / f"{i}.jsonl", random_seqs(400, max_len=120, seed=i))
             for i in range(3)]
    args = ["--seq-len", 128, "--max-segments", 8, "--shard-rows", 20, "--workers", 2]
    clean = tmp_path / "clean"
    assert run_cli("pack", *paths, "-o", clean, *args).returncode == 0
    out = tmp_path / "out"

    def writing():
        return out.is_dir() and any(n.endswith(".arrayrecord") for n in os.listdir(out))

    _kill_when(["pack", *paths, "-o", out, *args], out, writing,
               {"SEQPACK_TEST_SHARD_DELAY": "0.3"})
    time.sleep(0.2)  # the workers die with the run (no shard appears after the kill)
    names = set(os.listdir(out))
    time.sleep(1.0)  # in-flight shards would land by now if a worker outlived the run
    assert set(os.listdir(out)) == names
    assert (out / INTENT).exists() and not (out / "manifest.json").exists()
    result = run_cli("pack", *paths, "-o", out, *args, "--resume")
    assert result.returncode == 0, result.stderr
    assert dir_bytes(out) == dir_bytes(clean)


@pytest.mark.slow  # over 7 s on 2 cores: .ci/run runs it
def test_memory_is_bounded_by_examples_not_tokens(tmp_path):
    """A corpus 4x the RSS budget it is packed and verified in (peak RSS over a tiny run of
    the same shape)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    tiny, big = tmp_path / "tiny", tmp_path / "big"
    tiny.mkdir()
    big.mkdir()
    budget = 32 << 20
    lengths = rng.integers(100, 400, 12_000)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    values = pa.array(rng.integers(0, 50_000, int(offsets[-1]), dtype=np.int32))
    table = pa.table({"tokens": pa.ListArray.from_arrays(pa.array(offsets), values)})
    num_files = 12  # 12 x 3M tokens x 4 bytes: 144 MB of token ids, 4.3x the budget
    for i in range(num_files):
        pq.write_table(table, big / f"{i:02d}.parquet")
    pq.write_table(table.slice(0, 200), tiny / "0.parquet")
    assert num_files * int(offsets[-1]) * 4 >= 4 * budget

    def peak_rss(*args) -> int:
        code = ("import resource, sys; from seqpack.cli import main\n"
                "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code\n"
                "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
        result = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        return int(result.stdout.split()[-1]) * 1024

    def pack(src) -> int:
        files = sorted(str(p) for p in src.glob("*.parquet"))
        return peak_rss("pack", *files, "-o", src / "out", "--seq-len", "512", "--max-segments",
                        "16", "--workers", "1", "--json")

    base, peak = pack(tiny), pack(big)
    print(f"pack: peak RSS {peak >> 20} MiB, {(peak - base) >> 20} MiB over a tiny run")
    assert peak - base <= budget, (base >> 20, peak >> 20)
    base, peak = peak_rss("verify", tiny / "out"), peak_rss("verify", big / "out")
    print(f"verify: peak RSS {peak >> 20} MiB, {(peak - base) >> 20} MiB over a tiny run")
    assert peak - base <= budget, (base >> 20, peak >> 20)
    manifest = json.loads((big / "out" / "manifest.json").read_text())
    assert manifest["inputs"]["num_tokens"] == num_files * int(offsets[-1])
