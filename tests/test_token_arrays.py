"""Token-array inputs (`formats.arrays`): Megatron-LM's indexed datasets (.bin + .idx), .npz
(tokens with offsets or lengths, extra columns beside them; stored or compressed) and 2-D
.npy, read as the same examples as any other input, memory-mapped; bad files refused, named;
packed by reference (`--format index`) bit for bit as a copy, a changed .idx refused."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.pipelines.errors import InputError
from seqpack.pipelines.formats.arrays import TokenArrays
from seqpack.pipelines.formats.inputs import ReadOptions, expand_inputs, read_corpus
from seqpack.pipelines.offline.shards import read_shard
from tests.helpers.files import invoke, random_seqs, write_jsonl, write_megatron


def write_npz(path, seqs, *, compressed=False, lengths=False, **columns) -> str:
    tokens = np.concatenate([np.asarray(s, np.int32) for s in seqs] or [np.zeros(0, np.int32)])
    n = np.array([len(s) for s in seqs], np.int64)
    bounds = {"lengths": n} if lengths else {"offsets": np.concatenate(([0], np.cumsum(n)))}
    (np.savez_compressed if compressed else np.savez)(path, tokens=tokens, **bounds, **columns)
    return str(path)


def _corpus(paths, **kw):
    c = read_corpus(paths, ReadOptions(**kw))
    return [c.values[a:b].tolist() for a, b in zip(c.offsets[:-1], c.offsets[1:])], c


SEQS = random_seqs(60, max_len=40, seed=4) + [[]]


@pytest.mark.parametrize("kind", ["megatron", "npz", "npz_compressed", "npz_lengths"])
def test_arrays_read_as_the_same_examples(tmp_path, kind):
    if kind == "megatron":
        path = write_megatron(tmp_path / "d_text_document", SEQS)
    else:
        path = write_npz(tmp_path / "d.npz", SEQS, compressed=kind == "npz_compressed",
                         lengths=kind == "npz_lengths")
    got, corpus = _corpus([path])
    assert got == [list(s) for s in SEQS]
    info = corpus.files[0]
    assert info["format"] == kind.split("_")[0] and info["num_examples"] == len(SEQS)
    if kind == "megatron":  # the pair is one input, fingerprinted as one
        assert info["companion"]["path"] == str(tmp_path / "d_text_document.idx")
        assert _corpus([str(tmp_path / "d_text_document.idx")])[0] == got
        assert expand_inputs([str(tmp_path)]) == [path]  # the .idx beside it: not a 2nd input
        assert expand_inputs([str(tmp_path / "d_text_document")]) == [path]  # the prefix
    else:
        arr = TokenArrays(path, "npz")
        assert isinstance(arr.values.base, np.memmap) == (kind != "npz_compressed")  # mapped


def test_npz_extra_columns_and_npy(tmp_path):
    labels = np.arange(sum(len(s) for s in SEQS), dtype=np.int64) - 5
    path = write_npz(tmp_path / "l.npz", SEQS, labels=labels)
    c = read_corpus([path], ReadOptions(extra_columns=("labels",)))
    assert np.array_equal(c.extra_values["labels"], labels)
    square = np.arange(30, dtype=np.int32).reshape(5, 6)
    np.save(tmp_path / "fixed.npy", square)
    got, _ = _corpus([str(tmp_path / "fixed.npy")])
    assert got == square.tolist()


def _raises(path, match, **kw):
    with pytest.raises(InputError, match=match):
        read_corpus([str(path)], ReadOptions(**kw))


def test_bad_arrays_are_refused_by_name(tmp_path):
    bin_path = write_megatron(tmp_path / "m", SEQS)
    with open(bin_path, "ab") as f:
        f.write(b"\0\0")
    _raises(bin_path, "m.bin: .* bytes, its index")
    idx = tmp_path / "m.idx"
    idx.write_bytes(idx.read_bytes()[:40])
    _raises(bin_path, "truncated Megatron index")
    write_megatron(tmp_path / "f", [[1, 2]], dtype=np.float32)
    _raises(tmp_path / "f.bin", "float32 values, not integer")
    os.remove(write_megatron(tmp_path / "alone", SEQS))
    _raises(tmp_path / "alone.idx", "needs .*alone.bin beside it")
    _raises(write_npz(tmp_path / "neg.npz", [[1, 2], [3, -4]]), "neg.npz record 1: token id -4")
    np.savez(tmp_path / "nobounds.npz", tokens=np.arange(4))
    _raises(tmp_path / "nobounds.npz", "no 'offsets'")
    np.savez(tmp_path / "badoff.npz", tokens=np.arange(4), offsets=np.array([0, 3, 2, 4]))
    _raises(tmp_path / "badoff.npz", r"never decreasing \(record 1: offsets\[2\] = 2 < offsets")
    np.savez(tmp_path / "both.npz", tokens=np.arange(4), offsets=np.array([0, 1, 4]),
             lengths=np.array([2, 2]))
    _raises(tmp_path / "both.npz", "both 'offsets' and 'lengths', and they disagree")
    np.savez(tmp_path / "agree.npz", tokens=np.arange(4), offsets=np.array([0, 1, 4]),
             lengths=np.array([1, 3]))
    assert TokenArrays(str(tmp_path / "agree.npz"), "npz").num_records == 2
    write_npz(tmp_path / "short.npz", [[1, 2]], labels=np.zeros(1, np.int64))
    _raises(tmp_path / "short.npz", "'labels' holds 1 values", extra_columns=("labels",))
    np.save(tmp_path / "flat.npy", np.arange(5))
    _raises(tmp_path / "flat.npy", r"\[examples, tokens\]")
    _raises(write_npz(tmp_path / "t.npz", SEQS), "no array 'ids'", column="ids")


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(0, 9), max_size=30), batch=st.integers(1, 7))
def test_chunks_hold_every_example_in_order(tmp_path_factory, lengths, batch):
    seqs = [list(range(i, i + n)) for i, n in enumerate(lengths)]
    path = write_npz(tmp_path_factory.mktemp("p") / "x.npz", seqs)
    arr = TokenArrays(path, "npz")
    got = [c.values[c.offsets[i]:c.offsets[i + 1]].tolist()
           for c in arr.chunks(batch) for i in range(c.num_records)]
    assert got == seqs
    picks = np.arange(len(seqs))[::-1]
    assert [t.tolist() for t, _ in arr.examples(picks)] == [seqs[i] for i in picks]


def _rows(out) -> dict[str, np.ndarray]:
    names = json.loads((out / "manifest.json").read_text())["shards"]
    parts = [read_shard(str(out), n) for n in names]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def test_arrays_by_reference_are_the_copy(tmp_path):
    pytest.importorskip("array_record.python.array_record_module")
    inputs = [write_megatron(tmp_path / "m", random_seqs(80, max_len=70, seed=5)),
              write_npz(tmp_path / "n.npz", random_seqs(70, max_len=70, seed=6)),
              str(tmp_path / "q.npy")]
    np.save(inputs[2], np.arange(40 * 16, dtype=np.int64).reshape(40, 16) % 997)
    args = ["--seq-len", 64, "--overflow", "split", "--shard-rows", 8]
    invoke("pack", *inputs, "-o", tmp_path / "rows", *args)
    invoke("pack", *inputs, "-o", tmp_path / "index", *args, "--format", "index")
    copy, index = _rows(tmp_path / "rows"), _rows(tmp_path / "index")
    assert sorted(copy) == sorted(index)
    for k in copy:
        assert copy[k].dtype == index[k].dtype and np.array_equal(copy[k], index[k]), k
    shapes = [json.loads((tmp_path / o / "manifest.json").read_text())["shapes"]
              for o in ("rows", "index")]
    assert shapes[0] == shapes[1]  # loss tokens from the plan alone, as the copy counts them
    invoke("verify", tmp_path / "index")
    idx = tmp_path / "m.idx"
    st_ = os.stat(idx)
    os.utime(idx, ns=(st_.st_atime_ns, st_.st_mtime_ns + 10**9))
    with pytest.raises(InputError, match="m.idx: changed since it was packed by reference"):
        _rows(tmp_path / "index")


def test_megatron_beside_jsonl_packs_as_jsonl(tmp_path):
    seqs = random_seqs(50, max_len=30, seed=7)
    a = invoke("pack", write_megatron(tmp_path / "m", seqs, np.int32), "-o", tmp_path / "a",
               "--seq-len", 64)
    b = invoke("pack", write_jsonl(tmp_path / "j.jsonl", seqs), "-o", tmp_path / "b",
               "--seq-len", 64)
    assert a.exit_code == b.exit_code == 0
    ra, rb = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    for k in ra:
        assert np.array_equal(ra[k], rb[k]), k


def test_token_array_source_packs_online(tmp_path):
    from seqpack.packer import PackConfig
    from seqpack.pipelines.datasets import PackIterDataset, TokenArraySource

    seqs = random_seqs(40, max_len=30, seed=8)
    labels = np.arange(sum(len(s) for s in seqs), dtype=np.int32)
    src = TokenArraySource([write_megatron(tmp_path / "m", seqs)[:-4],  # by its prefix
                            write_npz(tmp_path / "n.npz", seqs, labels=labels)],
                           aligned_columns=())
    assert len(src) == 80 and src[41]["tokens"].tolist() == seqs[1]
    with_labels = TokenArraySource(str(tmp_path / "n.npz"), aligned_columns=("labels",))
    a, b = with_labels[2]["labels"], labels[len(seqs[0]) + len(seqs[1]):][:len(seqs[2])]
    assert np.array_equal(a, b)
    rows = list(PackIterDataset(src.to_iter_dataset(), PackConfig(64)))
    packed = sum(int(r["tokens_segment_lengths"].sum()) for r in rows)
    assert packed == 2 * sum(len(s) for s in seqs)
    with pytest.raises(InputError, match="not a token array by its name"):
        TokenArraySource(str(tmp_path / "x.parquet"))


@pytest.mark.slow  # two packs of 12.9M tokens, every row read back (~20 s)
def test_real_corpora_by_reference_are_the_copy(tmp_path):
    """The shared real corpora (../shared/data: .npz of tokens and offsets, read as they are):
    every row of the index bit for bit the copy's row; skipped where the folder is absent."""
    pytest.importorskip("array_record.python.array_record_module")
    data = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")
    inputs = [os.path.join(data, n) for n in ("chat_dev.npz", "gsm8k_train.npz")]
    if not all(os.path.isfile(p) for p in inputs):
        pytest.skip("../shared/data holds no chat_dev.npz / gsm8k_train.npz here")
    args = ["--seq-len", 2048, "--overflow", "split", "--shard-rows", 1024]
    invoke("pack", *inputs, "-o", tmp_path / "rows", *args)
    invoke("pack", *inputs, "-o", tmp_path / "index", *args, "--format", "index")
    copy, index = _rows(tmp_path / "rows"), _rows(tmp_path / "index")
    assert sorted(copy) == sorted(index) and len(copy["tokens"]) > 5000
    for k in copy:
        assert copy[k].dtype == index[k].dtype and np.array_equal(copy[k], index[k]), k
