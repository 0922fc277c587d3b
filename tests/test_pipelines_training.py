"""make_training_pipeline: contract batches, sharding covers every example once, exact resume."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from seqpack import packer
from seqpack.pipelines.datasets import (
    ArraySource,
    Batching,
    Columns,
    PackedArrayRecordSource,
    Prefetch,
    Window,
    make_training_pipeline,
)
from seqpack.pipelines.formats.records import encode_row
from tests.helpers.files import write_manifest
from tests.helpers.pipelines import assert_rows_equal, random_lengths, unique_corpus

ar = pytest.importorskip("array_record.python.array_record_module")


def _source(n: int = 300, seed: int = 0, high: int = 100):
    lengths = random_lengths(np.random.default_rng(seed), n, high=high)
    values, offsets = unique_corpus(lengths)
    return ArraySource.from_ragged(values, offsets), values, offsets


def _examples_in(batch: dict, values, offsets) -> list[int]:
    """Example index of every segment (identified by its unique tokens)."""
    out = []
    B = batch["tokens"].shape[0]
    for b in range(B):
        for j in np.flatnonzero(batch["tokens_segment_lengths"][b]):
            o, m = batch["tokens_segment_offsets"][b, j], batch["tokens_segment_lengths"][b, j]
            first = int(batch["tokens"][b, o])
            e = int(np.searchsorted(values, first))  # values are 1..N in order
            e = int(np.searchsorted(offsets, e, side="right")) - 1
            np.testing.assert_array_equal(batch["tokens"][b, o : o + m],
                                          values[offsets[e] : offsets[e + 1]])
            out.append(e)
    return out


def test_batches_are_contract_batches():
    src, values, offsets = _source()
    config = packer.PackConfig(128, max_segments=16)
    kw = dict(pack=config, shuffle_seed=1, num_epochs=1)
    batches = list(make_training_pipeline(
        src, batch=Batching(4, drop_remainder=False, shard_index=0, shard_count=1), **kw))
    for batch in batches:
        B = batch["tokens"].shape[0]
        assert batch["tokens"].shape == (B, 128)
        assert batch["tokens_segment_lengths"].shape == (B, 16)
        packer.validate(batch, config)
    assert [b["tokens"].shape[0] for b in batches[:-1]] == [4] * (len(batches) - 1)
    seen = [e for b in batches for e in _examples_in(b, values, offsets)]
    assert sorted(seen) == list(range(300))
    dropped = list(make_training_pipeline(  # drop_remainder=True: full batches only
        src, batch=Batching(4, shard_index=0, shard_count=1), **kw))
    assert len(dropped) == len(batches) - (batches[-1]["tokens"].shape[0] < 4)


@pytest.mark.parametrize("shard_count", [1, 3])
def test_shards_cover_every_example_exactly_once(shard_count):
    src, values, offsets = _source(n=200, seed=2)
    seen = []
    for shard in range(shard_count):
        ds = make_training_pipeline(src, pack=packer.PackConfig(128),
                                    batch=Batching(1, shard_index=shard, shard_count=shard_count),
                                    shuffle_seed=3, num_epochs=1)
        seen += [e for b in ds for e in _examples_in(b, values, offsets)]
    assert sorted(seen) == list(range(200))



def test_a_last_short_batch_is_dropped_with_its_rows_and_tokens_named(caplog):
    """Online, as for packed rows: the rows a last batch drops are said, with their tokens
    (every token of the epoch is in a batch or in that count); kept with drop_remainder=False."""
    src, values, _ = _source(n=200, seed=4)
    make = lambda drop: make_training_pipeline(  # noqa: E731
        src, pack=packer.PackConfig(128), batch=Batching(4, drop_remainder=drop,
                                                         shard_index=0, shard_count=1),
        shuffle_seed=0, num_epochs=1)
    kept = list(make(False))
    assert kept[-1]["tokens"].shape[0] < 4  # (the corpus leaves a short batch)
    with caplog.at_level("WARNING", logger="seqpack"):
        batches = list(make(True))
    assert len(batches) == len(kept) - 1
    rows = kept[-1]["tokens"].shape[0]
    tokens = int(kept[-1]["tokens_segment_lengths"].sum())
    assert sum(int(b["tokens_segment_lengths"].sum()) for b in batches) + tokens == values.size
    assert f"the last {rows} packed rows ({tokens} tokens) are dropped" in caplog.text

def test_defaults_shard_from_jax_and_epochs_reshuffle():
    src, values, offsets = _source(n=60, seed=4)
    ds = make_training_pipeline(src, pack=packer.PackConfig(128),
                                batch=Batching(1, drop_remainder=False), shuffle_seed=5,
                                num_epochs=2)  # jax: process 0 of 1
    seen = [e for b in ds for e in _examples_in(b, values, offsets)]
    assert sorted(seen) == sorted(list(range(60)) * 2)


@pytest.mark.parametrize("worker_count", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_resume_after_n_steps_is_exact(worker_count):
    src, _, _ = _source(n=240, seed=6)
    kw = dict(pack=packer.PackConfig(128), batch=Batching(2, shard_index=0, shard_count=1),
              shuffle_seed=7, num_epochs=1, prefetch=Prefetch(worker_count=worker_count),
              window=Window(window=16))
    it = iter(make_training_pipeline(src, **kw))
    full = list(it)
    it.close()
    for n in (0, 3, len(full) - 2):
        it = iter(make_training_pipeline(src, **kw))
        for _ in range(n):
            next(it)
        state = json.loads(json.dumps(it.get_state()))
        it.close()
        resumed = iter(make_training_pipeline(src, **kw))
        resumed.set_state(state)
        assert_rows_equal(list(resumed), full[n:])
        resumed.close()


def test_packed_arrayrecord_input_skips_packing(tmp_path):
    config = packer.PackConfig(64, max_segments=8)
    rng = np.random.default_rng(8)
    seqs = [np.arange(1, 1 + int(m)) for m in rng.integers(1, 64, 50)]
    batch = packer.pack(seqs, config)
    rows = [{k: v[r] for k, v in batch.items()} for r in range(batch["tokens"].shape[0])]
    w = ar.ArrayRecordWriter(str(tmp_path / "rows-00000.arrayrecord"), "group_size:1")
    for r in rows:
        w.write(encode_row(r))
    w.close()
    write_manifest(tmp_path, ["rows-00000.arrayrecord"], [len(rows)], seq_len=64,
                   max_segments=8)
    src = PackedArrayRecordSource(tmp_path)
    ds = make_training_pipeline(src, pack=config,
                                batch=Batching(3, drop_remainder=False, shard_index=0,
                                               shard_count=1),
                                shuffle_seed=0, num_epochs=1)
    out = list(ds)
    got = np.concatenate([b["segment_source_index"] for b in out])
    assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, batch["segment_source_index"]
                                                          .tolist()))
    for b in out:
        packer.validate(b, config)
    with pytest.raises(ValueError, match="seq_len=128 but the packed rows have seq_len=64"):
        make_training_pipeline(src, pack=packer.PackConfig(128, max_segments=8), batch=3,
                               shuffle_seed=0, num_epochs=1)


def test_bad_arguments():
    src, _, _ = _source(n=10)
    base = dict(pack=packer.PackConfig(128), shuffle_seed=0, num_epochs=1)
    with pytest.raises(ValueError, match="batch_size"):
        make_training_pipeline(src, batch=0, **base)
    with pytest.raises(ValueError, match="shard_index=3"):
        make_training_pipeline(src, batch=Batching(1, shard_index=3, shard_count=2), **base)
    with pytest.raises(ValueError, match="both or neither"):
        make_training_pipeline(src, batch=Batching(1, shard_index=0), **base)
    for seed in (None, -1, 1.5, True, "0"):
        with pytest.raises(ValueError, match=rf"shuffle_seed={seed!r} must be an int >= 0"):
            make_training_pipeline(src, batch=1, **{**base, "shuffle_seed": seed})
    make_training_pipeline(src, batch=1, **{**base, "shuffle_seed": np.int64(3)})


@pytest.mark.slow
def test_jsonl_source_in_worker_processes(tmp_path):
    from seqpack.pipelines.datasets import JsonlSource

    lengths = random_lengths(np.random.default_rng(9), 120, high=60)
    values, offsets = unique_corpus(lengths)
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"tokens": values[offsets[i] : offsets[i + 1]].tolist()})
                            + "\n" for i in range(120)))
    ds = make_training_pipeline(JsonlSource(path), pack=packer.PackConfig(128),
                                batch=Batching(2, drop_remainder=False, shard_index=0,
                                               shard_count=1),
                                shuffle_seed=0, num_epochs=1, prefetch=Prefetch(worker_count=2))
    it = iter(ds)
    seen = [e for b in it for e in _examples_in(b, values, offsets)]
    it.close()
    assert sorted(seen) == list(range(120))


def test_batching_and_prefetch_are_checked_and_name_the_field():
    with pytest.raises(ValueError, match="batch_size=0 must be an int >= 1"):
        Batching(0)
    with pytest.raises(ValueError, match="batch_size=True must be an int >= 1"):
        Batching(True)
    with pytest.raises(ValueError, match="drop_remainder=0 must be a bool"):
        Batching(2, drop_remainder=0)
    with pytest.raises(ValueError, match="pass both or neither of shard_index=None and "
                                         "shard_count=2"):
        Batching(2, shard_count=2)
    with pytest.raises(ValueError, match="shard_index=-1 must be an int >= 0"):
        Batching(2, shard_index=-1, shard_count=2)
    with pytest.raises(ValueError, match="shard_index=2 must be in \\[0, shard_count=2\\)"):
        Batching(2, shard_index=2, shard_count=2)
    assert Batching(2, shard_index=1, shard_count=2).shard() == (1, 2, None)
    with pytest.raises(ValueError, match="worker_count=-1 must be an int >= 0"):
        Prefetch(worker_count=-1)
    with pytest.raises(ValueError, match="worker_buffer_size=0 must be an int >= 1"):
        Prefetch(worker_buffer_size=0)
    with pytest.raises(ValueError, match="buffer_size=-1 must be an int >= 0"):
        Prefetch(buffer_size=-1)


def test_options_of_the_wrong_kind_name_the_option():
    src, _, _ = _source(n=10)
    base = dict(pack=packer.PackConfig(128), batch=2, shuffle_seed=0, num_epochs=1)
    assert len(list(make_training_pipeline(src, **base))) >= 1  # batch=2 is Batching(2)
    for name, bad, kind in (("pack", 128, "PackConfig"), ("batch", "2", "Batching"),
                            ("columns", ["labels"], "Columns"), ("window", 16, "Window"),
                            ("prefetch", 2, "Prefetch"), ("balance", 4, "Balance")):
        with pytest.raises(ValueError, match=re.escape(f"{name}={bad!r} must be a {kind}")):
            make_training_pipeline(src, **{**base, name: bad})
    with pytest.raises(ValueError, match="num_epochs=0 must be >= 1"):
        make_training_pipeline(src, **{**base, "num_epochs": 0})
    with pytest.raises(ValueError, match="pack=None: pass the packing config"):
        make_training_pipeline(src, **{**base, "pack": None})


def test_an_element_without_the_packed_feature_names_its_keys_and_the_fix():
    from seqpack.pipelines.errors import InputError

    src = ArraySource.from_sequences([[1, 2, 3], [4, 5]], feature="input_ids")
    kw = dict(batch=1, shuffle_seed=0, num_epochs=1)
    with pytest.raises(InputError, match=r"element 0 of the source lacks the packed feature "
                                         r"'tokens' \(its keys: \['input_ids'\]\); name the key "
                                         r"of the token ids in the pack config: "
                                         r"PackConfig\(\.\.\., feature='input_ids'\)"):
        make_training_pipeline(src, pack=packer.PackConfig(8), **kw)
    rows = list(make_training_pipeline(src, pack=packer.PackConfig(8, feature="input_ids"),
                                       **kw))
    assert sum(int(b["input_ids_segment_lengths"].sum()) for b in rows) == 5


def test_a_bad_later_element_is_named_by_its_example_in_the_source():
    """Past the first element, a missing feature or a bad array names the example of the
    source (or the dataset and example of a mixture) it came from, not only its position in
    the shuffled stream."""
    from seqpack.pipelines.datasets import Mixture
    from seqpack.pipelines.errors import InputError

    good = [{"tokens": np.arange(1, 5)} for _ in range(20)]
    kw = dict(pack=packer.PackConfig(16), batch=Batching(2, shard_index=0, shard_count=1),
              shuffle_seed=0, num_epochs=1)
    for bad, what in (({"text": np.arange(3)}, "lacks one of the features"),
                      ({"tokens": np.ones(3)}, "'tokens' must be a 1-D array of integer")):
        src = [*good[:7], bad, *good[8:]]
        with pytest.raises(InputError, match=rf"element \d+( of the parent)? \(example 7 of "
                                             rf"the source\):? {what}"):
            list(make_training_pipeline(src, **kw))
    mix = Mixture({"a": good, "b": [*good[:5], {"tokens": np.ones(2)}]},
                  weights={"a": 1, "b": 1})
    with pytest.raises(InputError, match=r"\(dataset 'b', example 5\): 'tokens' must be"):
        list(make_training_pipeline(mix, **kw))
    labels = [{"tokens": np.arange(1, 5), "labels": np.arange(4)} for _ in range(20)]
    labels[9] = {"tokens": np.arange(1, 5), "labels": np.arange(3)}  # one label short
    with pytest.raises(InputError, match=r"example 9 of the source: column 'labels' has "
                                         r"length 3 but the feature 'tokens'"):
        list(make_training_pipeline(labels, **kw, columns=Columns(labels=["labels"])))
