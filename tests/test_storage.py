"""Object storage (gs://, s3://) for everything that reads, against real local servers.

gcp-storage-emulator and moto run as subprocesses (tests/helpers/cloud.py); every test runs on
both. Inputs, the CLI (stats, pack, verify) and the Grain sources must give what the same files
give locally, and errors name the URL.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from seqpack.pipelines import storage
from seqpack.pipelines.errors import InputError
from tests.helpers.cloud import gcs, gcs_server, s3, s3_server  # noqa: F401
from tests.helpers.files import (
    ROOT,
    dir_bytes,
    invoke,
    random_seqs,
    run_cli,
    write_jsonl,
    write_megatron,
    write_parquet,
)


@pytest.fixture(params=["gs", "s3"])
def store(request):
    return request.getfixturevalue("gcs" if request.param == "gs" else "s3")


@pytest.fixture
def inputs(tmp_path):
    """Two Parquet files and a JSONL file, locally."""
    d = tmp_path / "in"
    d.mkdir()
    return [write_parquet(d / "a.parquet", random_seqs(60, seed=1)),
            write_parquet(d / "b.parquet", random_seqs(50, seed=2)),
            write_jsonl(d / "c.jsonl", random_seqs(40, seed=3))]


def test_glob_size_exists_and_local_copy(store, inputs, tmp_path):
    base = store.upload(os.path.dirname(inputs[0]), store.url("in"))
    assert storage.is_url(base) and not storage.is_url(inputs[0])
    found = storage.expand(base + "/*.parquet")
    assert found == [base + "/a.parquet", base + "/b.parquet"]
    # local paths (their globs included: the shell's job) and plain URLs stay as they are
    assert storage.expand([inputs[2], str(tmp_path / "*.x"), found[0]]) == \
        [inputs[2], str(tmp_path / "*.x"), found[0]]
    assert storage.exists(found[0]) and not storage.exists(base + "/nope.parquet")
    assert storage.size(found[1]) == os.path.getsize(inputs[1])
    with storage.local_copy(found[0], dir=str(tmp_path)) as local:
        assert pathlib.Path(local).read_bytes() == pathlib.Path(inputs[0]).read_bytes()
    assert not os.path.exists(local)
    assert [n for n in os.listdir(tmp_path) if n != "in"] == []  # nothing left behind


def test_cached_copy_is_reused_until_the_object_changes(store, inputs, tmp_path):
    url = store.upload(inputs[2], store.url("c.jsonl"))
    cache = tmp_path / "cache"
    first = storage.cached_copy(url, cache_dir=cache)
    assert pathlib.Path(first).read_bytes() == pathlib.Path(inputs[2]).read_bytes()
    os.utime(first, (1, 1))  # a download would give a new mtime
    assert storage.cached_copy(url, cache_dir=cache) == first
    assert os.stat(first).st_mtime == 1
    store.fs.pipe_file(url.split("://", 1)[1], b'{"tokens": [1, 2]}\n')  # a new version
    again = storage.cached_copy(url, cache_dir=cache)
    assert again != first and pathlib.Path(again).read_bytes() == b'{"tokens": [1, 2]}\n'


def test_read_ranges_of_several_objects_and_the_version_of_one(store, inputs):
    """Byte ranges of two objects in one call, in the order asked; a range past an object's
    end is refused, named; a new write of an object gives it a new version."""
    base = store.upload(os.path.dirname(inputs[0]), store.url("in"))
    a, b = base + "/a.parquet", base + "/c.jsonl"
    data = {a: pathlib.Path(inputs[0]).read_bytes(), b: pathlib.Path(inputs[2]).read_bytes()}
    asked = [(b, 5, 40), (a, 0, 4), (b, 0, 1), (a, 100, 100 + 3)]
    got = storage.read_ranges([u for u, _, _ in asked], [s for _, s, _ in asked],
                              [e for _, _, e in asked])
    assert got == [data[u][s:e] for u, s, e in asked]
    with pytest.raises(InputError, match=f"{a}: bytes .* shorter than its manifest entry"):
        storage.read_ranges(a, [0], [len(data[a]) + 10])
    before = storage.version(b)
    assert before
    store.fs.pipe_file(b.split("://", 1)[1], b'{"tokens": [1, 2]}\n')
    assert storage.version(b) != before


def test_a_missing_object_names_its_url(store, tmp_path):
    url = store.url("nope/missing.parquet")
    for call in (lambda: storage.size(url), lambda: storage.read_json(url),
                 lambda: storage.cached_copy(url, cache_dir=tmp_path),
                 lambda: storage.local_copy(url).__enter__(),
                 lambda: storage.version(url), lambda: storage.read_ranges(url, [0], [4])):
        with pytest.raises(InputError, match=f"{url}: no such object"):
            call()
    with pytest.raises(InputError, match="no objects match"):
        storage.expand(store.url("nope/*.parquet"))
    result = invoke("stats", url, ok=False)
    assert result.exit_code == 2 and url in result.output, result.output
    bad = store.url("bad.jsonl")  # a bad record: the error names the URL, not the local copy
    store.fs.pipe_file(bad.split("://", 1)[1], b'{"tokens": [1]}\n{"tokens": [2, "x"]}\n')
    result = invoke("stats", bad, ok=False)
    assert result.exit_code == 2 and f"{bad}:2" in result.output, result.output


def test_stats_dry_run_on_urls_equals_local(store, inputs):
    base = store.upload(os.path.dirname(inputs[0]), store.url("in"))
    args = ["--seq-len", 64, "--max-segments", 8, "--overflow", "split", "--json"]
    local = json.loads(invoke("stats", *inputs, *args).stdout)
    remote = json.loads(invoke("stats", base + "/*.parquet", base + "/c.jsonl", *args).stdout)
    assert remote == local


@pytest.mark.slow  # over 7 s on 2 cores: .ci/run runs it
def test_pack_from_urls_gives_the_local_shards_and_verifies(store, inputs, tmp_path):
    base = store.upload(os.path.dirname(inputs[0]), store.url("in"))
    args = ["--seq-len", 64, "--max-segments", 8, "--overflow", "split", "--shard-rows", 10]
    invoke("pack", *inputs, "-o", tmp_path / "local", *args, "--workers", 1)
    urls = [base + "/*.parquet", base + "/c.jsonl"]
    # a real subprocess: the writer's forkserver workers take the environment of the process
    # that starts the forkserver (once per process), so this one must carry the server's
    done = run_cli("pack", *urls, "-o", tmp_path / "remote", *args, "--workers", 2)
    assert done.returncode == 0, done.stderr
    local, remote = dir_bytes(tmp_path / "local"), dir_bytes(tmp_path / "remote")
    assert local.keys() == remote.keys() and len(local) > 3
    shards = [n for n in local if n.endswith(".arrayrecord")]
    assert all(local[n] == remote[n] for n in shards)
    m_local, m_remote = json.loads(local["manifest.json"]), json.loads(remote["manifest.json"])
    paths = [f["path"] for f in m_remote["inputs"]["files"]]
    assert paths == [base + "/a.parquet", base + "/b.parquet", base + "/c.jsonl"]
    for m in (m_local, m_remote):  # the manifests differ only in the inputs' paths
        del m["manifest_sha256"]
        for f in m["inputs"]["files"]:
            del f["path"]
    assert m_local == m_remote
    # --resume of the complete run re-reads the URLs and keeps every byte
    invoke("pack", *urls, "-o", tmp_path / "remote", *args, "--workers", 1, "--resume")
    assert dir_bytes(tmp_path / "remote") == remote
    # verify reads the manifest's URLs (a real subprocess: the environment carries the server)
    done = run_cli("verify", tmp_path / "remote")
    assert done.returncode == 0 and done.stdout.startswith("OK"), done.stdout + done.stderr
    # ... and a changed remote input is a violation naming it
    store.fs.pipe_file(paths[2].split("://", 1)[1], b'{"tokens": [1, 2, 3]}\n')
    result = invoke("verify", tmp_path / "remote", ok=False)
    assert result.exit_code == 1 and paths[2] in result.output, result.output


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A local `seqpack pack` output of two Parquet files, 3+ shards."""
    d = tmp_path_factory.mktemp("packed")
    srcs = [write_parquet(d / f"{i}.parquet", random_seqs(80, seed=i)) for i in range(2)]
    invoke("pack", *srcs, "-o", d / "out", "--seq-len", 64, "--max-segments", 8, "--overflow",
           "split", "--shard-rows", 12, "--workers", 1)
    return d / "out"


def _rows(src) -> list[dict]:
    return [src[i] for i in range(len(src))]


@pytest.mark.slow
def test_packed_source_reads_a_remote_packed_dir(store, packed, tmp_path):
    from seqpack.pipelines.datasets import ArrayRecordSource, PackedArrayRecordSource

    url = store.upload(packed, store.url("packed"))
    local = _rows(PackedArrayRecordSource(str(packed)))
    src = PackedArrayRecordSource(url + "/", cache_dir=tmp_path / "cache")
    assert src.seq_len == 64 and len(src) == len(local)
    for a, b in zip(local, _rows(src)):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    cached = sorted(str(p) for p in (tmp_path / "cache").rglob("*.arrayrecord"))
    assert len(cached) == len(src.manifest.shards)
    # stats (the manifest) and inspect (one shard) read a remote packed dir too
    for args in (["stats", "--json"], ["inspect", "--row", -1, "--json"]):
        a = invoke(args[0], packed, *args[1:]).stdout
        assert invoke(args[0], url, *args[1:]).stdout == a
    # a bit flipped in a remote shard (same size): refused, the shard named
    name = src.manifest.shards[1]
    key = f"{store.prefix}/packed/{name}"
    data = bytearray(store.fs.cat_file(key))
    data[len(data) // 2] ^= 1
    store.fs.pipe_file(key, bytes(data))
    with pytest.raises(InputError, match=f"{url}/{name}: .*damaged or replaced"):
        PackedArrayRecordSource(url, cache_dir=tmp_path / "fresh")
    # the checked copies already cached are still the manifest's bytes: served as they are
    assert len(PackedArrayRecordSource(url, cache_dir=tmp_path / "cache")) == len(local)
    store.fs.rm_file(key)  # a missing remote shard: named too
    with pytest.raises(InputError, match=f"{url}/{name}: missing"):
        PackedArrayRecordSource(url, cache_dir=tmp_path / "fresh")
    # a prefix with no manifest: not a complete pack output; no shards either: nothing to read
    with pytest.raises(InputError, match=f"{store.url('empty')}/manifest.json: missing"):
        PackedArrayRecordSource(store.url("empty"), cache_dir=tmp_path / "cache")
    with pytest.raises(InputError, match="no manifest.json and no"):
        ArrayRecordSource(store.url("empty"), cache_dir=tmp_path / "cache")


def test_file_sources_read_urls_like_files(store, inputs, tmp_path):
    from seqpack.pipelines.datasets import JsonlSource, ParquetSource

    base = store.upload(os.path.dirname(inputs[0]), store.url("in"))
    cache = tmp_path / "cache"
    for make, local, remote in [
        (ParquetSource, inputs[:2], [base + "/a.parquet", base + "/b.parquet"]),
        (JsonlSource, inputs[2], base + "/c.jsonl"),
    ]:
        a, b = _rows(make(local)), _rows(make(remote, cache_dir=cache))
        assert len(a) == len(b) > 0
        assert all(np.array_equal(x["tokens"], y["tokens"]) for x, y in zip(a, b))
    bad = store.url("bad.jsonl")
    store.fs.pipe_file(bad.split("://", 1)[1], b'{"tokens": [1]}\n{"tokens": [2, "x"]}\n')
    with pytest.raises(InputError, match=f"{bad}:2"):
        JsonlSource(bad, cache_dir=cache)[1]


def test_a_url_without_the_cloud_extra_names_it(tmp_path):
    code = ("import sys; sys.modules['fsspec'] = None\n"
            "from seqpack.pipelines import storage\n"
            "storage.size('gs://bucket/a.parquet')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    last = result.stderr.strip().splitlines()[-1]
    assert "MissingDependency" in last and "pip install 'seqpack[cloud]'" in last, last


def test_a_remote_output_path_is_never_written_locally(tmp_path, monkeypatch, store):
    monkeypatch.chdir(tmp_path)
    result = invoke("verify", store.url("nothing-here/"), ok=False)
    assert result.exit_code == 2 and "nothing-here" in result.output, result.output
    assert os.listdir(tmp_path) == []  # no ./gs: or ./s3: directory



def _objects(store, url: str) -> dict[str, bytes]:
    fs = store.fs
    inside = url.split("://", 1)[1].rstrip("/")
    found = fs.ls(inside, detail=False, refresh=True)
    return {p.rsplit("/", 1)[-1]: fs.cat(p) for p in sorted(found)}


@pytest.mark.slow  # seconds of subprocesses; the fault tests cover the fast path
def test_pack_to_object_storage_gives_the_local_bytes(store, inputs, tmp_path):
    local = tmp_path / "local"
    args = ["--seq-len", 64, "--max-segments", 8, "--shard-rows", 10, "--workers", 2]
    assert run_cli("pack", *inputs, "-o", local, *args).returncode == 0
    out = store.url("packed/")
    result = run_cli("pack", *inputs, "-o", out, *args)
    assert result.returncode == 0, result.stderr
    assert _objects(store, out) == dir_bytes(local)  # no lock, records or staging left behind
    assert run_cli("stats", out).returncode == 0
    result = run_cli("verify", out)  # the remote output against the local inputs it names
    assert result.returncode == 0 and result.stdout.startswith("OK:"), result.stderr
    from seqpack.pipelines.datasets import PackedArrayRecordSource

    src = PackedArrayRecordSource(out, cache_dir=tmp_path / "cache")
    assert len(src) == json.loads(dir_bytes(local)["manifest.json"])["num_rows"]
    again = run_cli("pack", *inputs, "-o", out, *args)  # not empty: needs a flag
    assert again.returncode == 2 and "--overwrite" in again.stderr
    assert run_cli("pack", *inputs, "-o", out, *args, "--resume").returncode == 0
    assert _objects(store, out) == dir_bytes(local)


@pytest.mark.slow  # seconds of subprocesses (tests/test_faults.py covers the fast path)
def test_a_damaged_remote_shard_is_rewritten_by_resume_and_a_lock_refuses(store, inputs,
                                                                          tmp_path):
    local = tmp_path / "local"
    args = ["--seq-len", 64, "--max-segments", 8, "--shard-rows", 10, "--workers", 1]
    assert run_cli("pack", *inputs, "-o", local, *args).returncode == 0
    out = store.url("packed/")
    assert run_cli("pack", *inputs, "-o", out, *args).returncode == 0
    inside = out.split("://", 1)[1]
    name = json.loads(dir_bytes(local)["manifest.json"])["shards"][1]
    data = bytearray(store.fs.cat(inside + name))
    data[len(data) // 2] ^= 1
    store.fs.pipe(inside + name, bytes(data))
    result = run_cli("verify", out)
    assert result.returncode == 1 and f"{name}: size or sha256 differs" in result.stdout
    result = run_cli("pack", *inputs, "-o", out, *args, "--resume")
    assert result.returncode == 0, result.stderr
    assert _objects(store, out) == dir_bytes(local)
    store.fs.pipe(inside + "pack.lock", json.dumps({"pid": 1, "host": "elsewhere"}).encode())
    result = run_cli("pack", *inputs, "-o", out, *args, "--overwrite")
    assert result.returncode == 2 and "another seqpack run" in result.stderr


@pytest.mark.slow  # seconds of subprocesses; the fault tests cover the fast path
def test_sigkill_mid_run_on_object_storage_then_resume(store, tmp_path):
    import signal
    import time

    seqs = [random_seqs(300, max_len=60, seed=i) for i in range(3)]
    paths = [write_jsonl(tmp_path / f"{i}.jsonl", s) for i, s in enumerate(seqs)]
    args = ["--seq-len", 64, "--max-segments", 8, "--shard-rows", 20, "--workers", 1]
    local = tmp_path / "local"
    assert run_cli("pack", *paths, "-o", local, *args).returncode == 0
    out = store.url("packed/")
    inside = out.split("://", 1)[1].rstrip("/")
    proc = subprocess.Popen([sys.executable, "-m", "seqpack.cli", "pack", *paths, "-o", out,
                             *map(str, args)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                            env=dict(os.environ, SEQPACK_TEST_SHARD_DELAY="0.3"))
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        try:
            found = store.fs.ls(inside, detail=False, refresh=True)
            if any(p.endswith(".done") for p in found):
                break
        except FileNotFoundError:
            pass
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    names = _objects(store, out)
    assert "manifest.json" not in names and "pack_intent.json" in names
    result = run_cli("pack", *paths, "-o", out, *args, "--resume")  # the stale lock is taken
    assert result.returncode == 0, result.stderr
    assert _objects(store, out) == dir_bytes(local)


@pytest.mark.slow
def test_url_to_url_round_trips_local_and_beam_give_the_local_bytes(store, inputs, tmp_path):
    pytest.importorskip("apache_beam")
    from seqpack.packer import PackConfig
    from seqpack.pipelines.offline import PackJob, WriteOptions
    from seqpack.pipelines.offline.runners import pack_beam, pack_to_dir

    urls = [store.upload(p, store.url("in/" + os.path.basename(p))) for p in inputs]
    config, write = PackConfig(64, max_segments=8, overflow="split"), WriteOptions(shard_rows=9)
    pack_to_dir(PackJob(urls, tmp_path / "local", config, write_options=write, workers=1))
    want = dir_bytes(tmp_path / "local")
    out = store.url("beam/")
    pack_beam(PackJob(urls, out, config, write_options=write, workers=2), quiet=True)
    assert _objects(store, out) == want
    out = store.url("cli/")
    result = run_cli("pack", *urls, "-o", out, "--seq-len", 64, "--max-segments", 8,
                     "--overflow", "split", "--shard-rows", 9, "--workers", 2)
    assert result.returncode == 0, result.stderr
    assert _objects(store, out) == want
    assert run_cli("verify", out).returncode == 0  # remote output against remote inputs


@pytest.mark.slow
def test_racers_for_a_stale_lock_on_s3_let_exactly_one_in(s3):  # noqa: F811
    """Take-over replaces the stale lock only if it is still the object that was read (S3
    If-Match on its ETag), so of many racers one wins. (The GCS emulator ignores preconditions,
    so this runs on S3 only; real GCS honours the delete's ifGenerationMatch.)"""
    import socket

    from tests.helpers.runs import race

    out = s3.url("racy/")
    inside = out.split("://", 1)[1].rstrip("/")
    s3.fs.pipe(inside + "/pack.lock", json.dumps(
        {"pid": 2**22 + 11, "host": socket.gethostname(), "started": "1"}).encode())
    got = race(out, 6)
    assert sum(got) == 1, got


@pytest.mark.slow  # two packs through the emulators, ~8 s
def test_an_index_of_url_inputs_in_object_storage_reads_as_the_copy(store, inputs, tmp_path,
                                                                    monkeypatch):
    """`--format index` with inputs and output on object storage: the Grain source reads each
    referenced example from a cached copy of its packed bytes (Parquet), or by byte range
    (the Megatron .bin: only its .idx is copied), row for row the copy's rows; a remote input
    replaced since is read from the packed bytes already cached, refused, named, on a cold
    cache (its sha256) or read by range (its version)."""
    from seqpack.pipelines.datasets import PackedSource

    monkeypatch.setenv("SEQPACK_CACHE_DIR", str(tmp_path / "default"))  # cache_dir= serves
    monkeypatch.setenv("SEQPACK_INDEX_REMOTE", "ranges")

    base = store.upload(os.path.dirname(inputs[0]), store.url("in"))
    mega = write_megatron(tmp_path / "m", random_seqs(40, max_len=50, seed=9))
    for name in ("m.bin", "m.idx"):  # a Megatron pair, named by its .idx
        store.upload(tmp_path / name, base + "/" + name)
    urls = [base + "/a.parquet", base + "/b.parquet", base + "/m.idx"]
    assert os.path.isfile(mega)
    args = ["--seq-len", 64, "--max-segments", 8, "--overflow", "split", "--shard-rows", 10]
    for fmt in ("arrayrecord", "index"):
        done = run_cli("pack", *urls, "-o", store.url(fmt), *args, "--format", fmt)
        assert done.returncode == 0, done.stderr
    copy = PackedSource(store.url("arrayrecord"), cache_dir=tmp_path / "c1")
    index = PackedSource(store.url("index"), cache_dir=tmp_path / "c2")
    assert len(copy) == len(index)
    for j in range(len(copy)):
        a, b = copy[j], index[j]
        assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a), j
    copied = {p.name for p in (tmp_path / "c2").rglob("*") if p.is_file()}
    assert copied & {"a.parquet", "b.parquet", "m.bin", "m.idx"} == \
        {"a.parquet", "b.parquet", "m.idx"}, copied
    store.fs.pipe_file(urls[1].split("://", 1)[1], open(inputs[0], "rb").read())
    warm = PackedSource(store.url("index"), cache_dir=tmp_path / "c2")
    assert all(np.array_equal(warm[j]["tokens"], copy[j]["tokens"]) for j in range(len(copy)))
    with pytest.raises(InputError, match=rf"{urls[1]}: changed since it was packed"):
        fresh = PackedSource(store.url("index"), cache_dir=tmp_path / "c4")
        for j in range(len(fresh)):
            fresh[j]
    store.fs.pipe_file(urls[1].split("://", 1)[1],
                       open(os.path.join(os.path.dirname(inputs[0]), "b.parquet"), "rb").read())
    bin_url, data = base + "/m.bin", bytearray(open(tmp_path / "m.bin", "rb").read())
    data[-1] ^= 0x01  # the same size, other bytes: a new generation / ETag
    store.fs.pipe_file(bin_url.split("://", 1)[1], bytes(data))
    with pytest.raises(InputError, match=rf"{bin_url}: changed since it was packed"):
        fresh = PackedSource(store.url("index"), cache_dir=tmp_path / "c5")
        for j in range(len(fresh)):
            fresh[j]
    assert not (tmp_path / "default").exists()  # every copy went to its reader's cache_dir


def test_scratch_directories_of_gone_processes_are_swept_and_others_kept(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "from seqpack.pipelines import storage; "
                           "print(storage.scratch_dir('stage'))"], capture_output=True,
                          text=True, check=True, env=dict(os.environ, TMPDIR=str(tmp_path)))
    left = gone.stdout.strip()
    open(os.path.join(left, "spill.bin"), "wb").write(b"x" * 1000)
    mine = storage.scratch_dir("copy")
    other = tmp_path / "seqpack-sample-abc"  # not a scratch directory: never touched
    other.mkdir()
    assert os.path.dirname(left) == str(tmp_path) and os.path.isdir(left)
    assert storage.sweep_scratch() == 1
    assert not os.path.exists(left) and os.path.isdir(mine) and other.is_dir()
    with storage.scratch("verify") as path:
        assert os.path.isdir(path)
    assert not os.path.exists(path)
