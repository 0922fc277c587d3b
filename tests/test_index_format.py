"""`seqpack pack --format index`: rows stored as references into the inputs, read back bit for
bit as `--format arrayrecord` stores them (every shard, the Grain source, the training
pipeline), with every option that plans rows; inputs that cannot be read at random and inputs
that changed are refused, named; verify, stats and inspect work on an index."""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.pipelines.datasets import Batching, PackedSource, make_training_pipeline
from seqpack.pipelines.errors import InputError
from seqpack.pipelines.formats.manifest import file_digest, signed
from seqpack.pipelines.offline.shards import read_shard
from tests.helpers.files import (
    dir_bytes,
    invoke,
    random_seqs,
    write_arrayrecord,
    write_jsonl,
    write_megatron,
    write_parquet,
)

pytest.importorskip("array_record.python.array_record_module")


def _write_arrow(path, seqs) -> str:
    """An Arrow IPC stream (what HF `datasets` writes) in batches of 50 records."""
    table = pa.table({"tokens": pa.array(seqs, pa.list_(pa.int32()))})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        for batch in table.to_batches(max_chunksize=50):
            w.write_batch(batch)
    return str(path)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Parquet, Arrow and ArrayRecord inputs, 360 examples up to 90 tokens."""
    d = tmp_path_factory.mktemp("index_inputs")
    return [write_parquet(d / "a.parquet", random_seqs(150, max_len=90, seed=1)),
            _write_arrow(d / "b.arrow", random_seqs(120, max_len=90, seed=2)),
            write_arrayrecord(d / "c.arrayrecord", random_seqs(90, max_len=90, seed=3))]


def _rows(out) -> dict[str, np.ndarray]:
    names = json.loads((out / "manifest.json").read_text())["shards"]
    parts = [read_shard(str(out), n) for n in names]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


OPTIONS = {
    "split": ["--seq-len", 64, "--max-segments", 8, "--overflow", "split"],
    "data_parallel": ["--seq-len", 128, "--data-parallel", 2, "--batch-size", 2],
    "context_parallel": ["--seq-len", 128, "--context-parallel", 2, "--overflow", "truncate"],
}


@pytest.mark.parametrize("case", list(OPTIONS))
def test_index_rows_are_the_arrayrecord_rows(tmp_path, inputs, case):
    args = [*OPTIONS[case], "--shard-rows", 16]
    invoke("pack", *inputs, "-o", tmp_path / "rows", *args)
    invoke("pack", *inputs, "-o", tmp_path / "index", *args, "--format", "index")
    _same(_rows(tmp_path / "rows"), _rows(tmp_path / "index"))
    rows, index = PackedSource(str(tmp_path / "rows")), PackedSource(str(tmp_path / "index"))
    assert len(rows) == len(index)
    for j in (0, len(rows) // 2, len(rows) - 1):
        _same(rows[j], index[j])
    batching = Batching(4, shard_index=0, shard_count=1)  # one host of the two ranks' rows
    batches = [next(iter(make_training_pipeline(src, batch=batching, shuffle_seed=1,
                                                num_epochs=1))) for src in (rows, index)]
    _same(*batches)
    token_bytes = sum(os.path.getsize(p) for p in (tmp_path / "rows").glob("*.arrayrecord"))
    index_bytes = sum(os.path.getsize(p) for p in (tmp_path / "index").glob("*.index"))
    assert index_bytes < 0.2 * token_bytes, (index_bytes, token_bytes)  # tiny shards: zip headers


def test_a_mixture_by_reference_is_the_mixture_stored(tmp_path, inputs):
    args = ["--mix", f"p={inputs[0]}", "--mix", f"q={inputs[1]}", "--mix", f"r={inputs[2]}",
            "--weights", "p=0.5,q=0.3,r=0.2", "--mix-tokens", 30000, "--seq-len", 64,
            "--overflow", "split", "--shard-rows", 16]
    invoke("pack", "-o", tmp_path / "rows", *args)
    invoke("pack", "-o", tmp_path / "index", *args, "--format", "index")
    _same(_rows(tmp_path / "rows"), _rows(tmp_path / "index"))


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 60), max_len=st.integers(1, 150), seq_len=st.sampled_from([16, 48, 96]),
       seed=st.integers(0, 999))
def test_any_corpus_reads_back_bit_for_bit(tmp_path_factory, n, max_len, seq_len, seed):
    d = tmp_path_factory.mktemp("any")
    seqs = random_seqs(n, max_len=max_len, seed=seed)
    seqs[0] = [7, *seqs[0]]  # a corpus holds one token at least
    src = write_parquet(d / "in.parquet", seqs)
    args = ["--seq-len", seq_len, "--max-segments", 4, "--overflow", "split", "--shard-rows", 5,
            "--workers", 1]
    invoke("pack", src, "-o", d / "rows", *args)
    invoke("pack", src, "-o", d / "index", *args, "--format", "index")
    _same(_rows(d / "rows"), _rows(d / "index"))


def test_an_input_that_cannot_be_read_at_random_is_refused_with_what_to_run(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", random_seqs(20, seed=1))
    result = invoke("pack", src, "-o", tmp_path / "out", "--seq-len", 64, "--format", "index",
                    ok=False)
    assert result.exit_code == 2
    assert f"{src}: a jsonl input cannot be read at random" in result.stderr
    assert "--format arrayrecord" in result.stderr


def test_a_changed_input_is_refused_never_read_as_other_tokens(tmp_path, inputs):
    local = [shutil.copy(p, tmp_path / os.path.basename(p)) for p in inputs]
    invoke("pack", *local, "-o", tmp_path / "index", "--seq-len", 64, "--overflow", "split",
           "--format", "index")
    source = PackedSource(str(tmp_path / "index"))
    first = source[0]
    st_ = os.stat(local[0])
    os.utime(local[0], ns=(st_.st_atime_ns, st_.st_mtime_ns + 10**9))  # touched: refused
    with pytest.raises(InputError, match=rf"{local[0]}: changed since it was packed"):
        PackedSource(str(tmp_path / "index"))[0]
    os.utime(local[0], ns=(st_.st_atime_ns, st_.st_mtime_ns))
    _same(PackedSource(str(tmp_path / "index"))[0], first)
    os.remove(local[1])
    with pytest.raises(InputError, match=rf"{local[1]}: the input the rows refer to is gone"):
        for j in range(len(source)):
            PackedSource(str(tmp_path / "index"))[j]


def test_verify_stats_and_inspect_read_an_index(tmp_path, inputs):
    local = [shutil.copy(p, tmp_path / os.path.basename(p)) for p in inputs]
    out = tmp_path / "index"
    invoke("pack", *local, "-o", out, "--seq-len", 64, "--overflow", "split", "--format",
           "index")
    assert "format index" in invoke("stats", out).output
    assert "segment_source_index" in invoke("inspect", out, "--row", 1).output
    assert invoke("verify", out).exit_code == 0
    # same size, same stamp, other bytes: only verify's sha256 sees it
    data = bytearray(open(local[2], "rb").read())
    st_ = os.stat(local[2])
    data[-100] ^= 1
    open(local[2], "wb").write(bytes(data))
    os.utime(local[2], ns=(st_.st_atime_ns, st_.st_mtime_ns))
    result = invoke("verify", out, ok=False)
    assert result.exit_code == 1 and "sha256" in result.output


def test_verify_refuses_an_edited_reference(tmp_path, inputs):
    out = tmp_path / "index"
    invoke("pack", *inputs, "-o", out, "--seq-len", 64, "--overflow", "split", "--format",
           "index", "--shard-rows", 16)
    manifest = json.loads((out / "manifest.json").read_text())
    name = manifest["shards"][1]
    with np.load(out / name) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["start"] = arrays["start"].copy()
    i = int(np.argmax(arrays["length"] > 1))
    arrays["start"][i] += 1  # a piece that starts one token late
    arrays["length"] = arrays["length"].astype(np.int64)
    arrays["length"][i] -= 1
    with open(out / name, "wb") as f:
        np.savez_compressed(f, **arrays)
    k = manifest["shards"].index(name)
    manifest["shard_bytes"][k], manifest["shard_sha256"][k] = file_digest(str(out / name))
    (out / "manifest.json").write_text(json.dumps(signed(manifest)))
    result = invoke("verify", out, ok=False)
    assert result.exit_code == 1, result.output
    assert re.search(r"piece\(s\) hold (\d+) tokens but do not tile its tokens \[0, \1\) \(a gap",
                     result.output), result.output
    assert "tokens are not in any row" in result.output


def test_a_resumed_index_run_keeps_its_shards_and_writes_the_same_bytes(tmp_path, inputs):
    """The last shard gone from a complete run: --resume keeps the others (their loss tokens
    counted from the plan, without reading the inputs) and the output is byte for byte the
    uninterrupted run's."""
    args = ["--seq-len", 64, "--overflow", "split", "--shard-rows", 8, "--format", "index"]
    invoke("pack", *inputs, "-o", tmp_path / "whole", *args)
    out = tmp_path / "out"
    shutil.copytree(tmp_path / "whole", out)
    names = json.loads((out / "manifest.json").read_text())["shards"]
    os.remove(out / names[-1])
    kept = {n: os.stat(out / n).st_mtime_ns for n in names[:-1]}
    invoke("pack", *inputs, "-o", out, *args, "--resume")
    assert dir_bytes(out) == dir_bytes(tmp_path / "whole")
    assert {n: os.stat(out / n).st_mtime_ns for n in kept} == kept


def test_parquet_groups_kept_on_disk_read_as_the_copy(tmp_path, inputs, monkeypatch):
    """SEQPACK_INDEX_DISK_CACHE: each decoded Parquet row group is written once (keyed by the
    input's sha256) and mapped from then on: the rows are the copy's, and a reader made later
    maps the groups without decoding one."""
    from seqpack.pipelines.formats.parquet import ParquetTokens

    cache = tmp_path / "groups"
    monkeypatch.setenv("SEQPACK_INDEX_DISK_CACHE", str(cache))
    args = ["--seq-len", 64, "--overflow", "split", "--shard-rows", 16]
    invoke("pack", inputs[0], "-o", tmp_path / "rows", *args)
    invoke("pack", inputs[0], "-o", tmp_path / "index", *args, "--format", "index")
    _same(_rows(tmp_path / "rows"), _rows(tmp_path / "index"))
    sha = json.loads((tmp_path / "index" / "manifest.json").read_text())["inputs"]["files"][0]
    files = sorted(os.listdir(cache / sha["sha256"]))
    assert files and all(f.endswith(".npz") for f in files), files

    def no_decode(self, g):
        raise AssertionError(f"row group {g} decoded again")

    monkeypatch.setattr(ParquetTokens, "read_group", no_decode)
    _same(_rows(tmp_path / "rows"), _rows(tmp_path / "index"))


def test_a_replaced_object_is_read_as_packed_or_refused_never_as_other_tokens(
        tmp_path, inputs, monkeypatch):
    """A URL input (file://, read through fsspec like gs:// or s3://) replaced in its store by
    other bytes of the same size: a reader whose cache holds the packed bytes reads them; a
    reader with an empty cache refuses the object, named (its download is checked against the
    manifest's sha256)."""
    pytest.importorskip("fsspec")
    local = shutil.copy(inputs[2], tmp_path / "c.arrayrecord")
    url = "file://" + os.path.abspath(local)
    invoke("pack", url, "-o", tmp_path / "index", "--seq-len", 64, "--overflow", "split",
           "--format", "index")
    monkeypatch.setenv("SEQPACK_CACHE_DIR", str(tmp_path / "warm"))
    rows = [PackedSource(str(tmp_path / "index"))[j] for j in range(2)]
    data = bytearray(open(local, "rb").read())
    data[len(data) // 2] ^= 0xFF  # one byte of a record: same size, other tokens
    with open(local, "wb") as f:
        f.write(bytes(data))
    for j, row in enumerate(rows):
        _same(PackedSource(str(tmp_path / "index"))[j], row)
    monkeypatch.setenv("SEQPACK_CACHE_DIR", str(tmp_path / "cold"))
    with pytest.raises(InputError, match=rf"{url}: changed since it was packed by reference"):
        PackedSource(str(tmp_path / "index"))[0]


def _url_inputs(tmp_path) -> tuple[list[str], list[str]]:
    """(local paths, file:// URLs) of a Megatron pair (named by its .idx) and a 2-D .npy."""
    d = tmp_path / "in"
    d.mkdir()
    write_megatron(d / "m", random_seqs(80, max_len=90, seed=4))
    np.save(d / "f.npy", np.random.default_rng(5).integers(0, 30000, (40, 24), np.int32))
    local = [str(d / "m.idx"), str(d / "f.npy")]
    return local, ["file://" + p for p in local]


def test_an_index_reads_object_inputs_by_range_without_a_copy(tmp_path, monkeypatch):
    """Megatron and .npy inputs given as URLs (file://, through fsspec as gs:// or s3://): the
    index reads each example's bytes by range, the rows are the copy's, and the only object
    copied into the cache is the Megatron .idx (`SEQPACK_INDEX_REMOTE=ranges`); by default
    ("copy") whole copies are read, the same rows."""
    pytest.importorskip("fsspec")
    local, urls = _url_inputs(tmp_path)
    args = ["--seq-len", 64, "--overflow", "split", "--shard-rows", 16]
    invoke("pack", *local, "-o", tmp_path / "copy", *args)
    invoke("pack", *urls, "-o", tmp_path / "index", *args, "--format", "index")
    files = json.loads((tmp_path / "index" / "manifest.json").read_text())["inputs"]["files"]
    assert all(f["version"] for f in files) and files[0]["companion"]["version"]
    for mode in ("ranges", "copy"):
        cache = tmp_path / f"cache-{mode}"
        monkeypatch.setenv("SEQPACK_CACHE_DIR", str(cache))
        monkeypatch.setenv("SEQPACK_INDEX_REMOTE", mode)
        _same(_rows(tmp_path / "copy"), _rows(tmp_path / "index"))
        copied = sorted(p.name for p in cache.rglob("*") if p.is_file())
        assert copied == (["m.idx"] if mode == "ranges" else ["f.npy", "m.bin", "m.idx"])
        # rows that wait on the store are read 16 at once by the training pipeline
        assert PackedSource(str(tmp_path / "index")).read_threads == (16 if mode == "ranges"
                                                                     else 0)
    assert PackedSource(str(tmp_path / "copy")).read_threads == 0
    monkeypatch.setenv("SEQPACK_INDEX_REMOTE", "ranges")
    assert PackedSource(str(tmp_path / "index")).read_threads == 16
    batching = Batching(4, shard_index=0, shard_count=1, drop_remainder=False)
    a, b = (list(make_training_pipeline(PackedSource(str(tmp_path / out)), batch=batching,
                                        shuffle_seed=3, num_epochs=1))
            for out in ("copy", "index"))  # the index's rows by 16 threads, ranges
    assert len(a) == len(b) > 1
    for x, y in zip(a, b):
        _same(x, y)


@pytest.mark.parametrize("which", [0, 1])
def test_an_object_replaced_after_packing_is_refused_when_read_by_range(tmp_path, monkeypatch,
                                                                       which):
    """The object's version (here its modification time) is checked before any range is
    read: the same size with other bytes, a Megatron .bin as an .npy, is refused, named."""
    pytest.importorskip("fsspec")
    local, urls = _url_inputs(tmp_path)
    invoke("pack", *urls, "-o", tmp_path / "index", "--seq-len", 64, "--overflow", "split",
           "--format", "index")
    monkeypatch.setenv("SEQPACK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SEQPACK_INDEX_REMOTE", "ranges")
    target = local[0].replace(".idx", ".bin") if which == 0 else local[1]
    data = bytearray(open(target, "rb").read())
    data[-1] ^= 0x01
    st_ = os.stat(target)
    with open(target, "wb") as f:
        f.write(bytes(data))
    os.utime(target, ns=(st_.st_atime_ns, st_.st_mtime_ns + 10**9))
    with pytest.raises(InputError, match=rf"file://{target}: changed since it was packed"):
        source = PackedSource(str(tmp_path / "index"))
        for j in range(len(source)):
            source[j]


def test_packed_source_copies_an_index_s_url_inputs_into_its_cache_dir(tmp_path, monkeypatch):
    """`PackedSource(cache_dir=)` is where every copy of a read goes: an index's input objects
    too, not the default cache."""
    pytest.importorskip("fsspec")
    local, urls = _url_inputs(tmp_path)
    args = ["--seq-len", 64, "--overflow", "split"]
    invoke("pack", *local, "-o", tmp_path / "copy", *args)
    invoke("pack", *urls, "-o", tmp_path / "index", *args, "--format", "index")
    monkeypatch.setenv("SEQPACK_CACHE_DIR", str(tmp_path / "default"))
    source = PackedSource(str(tmp_path / "index"), cache_dir=tmp_path / "mine")
    copy = PackedSource(str(tmp_path / "copy"))
    assert len(source) == len(copy)
    for j in range(len(copy)):
        _same(source[j], copy[j])
    assert sorted(p.name for p in (tmp_path / "mine").rglob("*") if p.is_file()) == \
        ["f.npy", "m.bin", "m.idx"]
    assert not (tmp_path / "default").exists()


def test_a_damaged_index_shard_is_refused_naming_it(tmp_path, inputs):
    """Any byte of a shard flipped: its rows read as packed (a byte no row depends on) or an
    InputError naming the shard, never another exception."""
    out = tmp_path / "index"
    invoke("pack", *inputs, "-o", out, "--seq-len", 64, "--overflow", "split", "--format",
           "index", "--shard-rows", 64)
    shard = out / json.loads((out / "manifest.json").read_text())["shards"][0]
    good, want = shard.read_bytes(), _rows(out)
    for pos in np.linspace(0, len(good) - 1, 80).astype(int).tolist():
        bad = bytearray(good)
        bad[pos] ^= 0x10
        shard.write_bytes(bytes(bad))
        try:
            _same(_rows(out), want)
        except InputError as e:
            assert str(shard) in str(e), (pos, e)
    shard.write_bytes(good)


def test_an_input_rewritten_in_place_while_read_is_refused(tmp_path, monkeypatch):
    """A memory-mapped input rewritten in place (same size, new stamp) under an open reader:
    its next read after the recheck interval refuses it, never returns other tokens."""
    from seqpack.pipelines.formats.encodings import index

    bin_path = write_megatron(tmp_path / "m", random_seqs(80, max_len=40, seed=5))
    out = tmp_path / "index"
    invoke("pack", bin_path, "-o", out, "--seq-len", 64, "--overflow", "split", "--format",
           "index")
    source = PackedSource(str(out))
    first = source[0]
    monkeypatch.setattr(index, "RECHECK_S", 0.0)
    _same(source[0], first)  # unchanged: read as packed, also when checked again
    size = os.path.getsize(bin_path)
    with open(bin_path, "r+b") as f:  # the same file, new bytes
        f.write(b"\0" * size)
    st_ = os.stat(bin_path)
    os.utime(bin_path, ns=(st_.st_atime_ns, st_.st_mtime_ns + 10**9))
    with pytest.raises(InputError, match=rf"{bin_path}: changed since it was packed"):
        source[0]
