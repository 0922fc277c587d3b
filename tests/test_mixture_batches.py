"""A mixture's weights in every batch: online (PackIterDataset / make_training_pipeline over a
`Mixture`: tiny beside long documents, repetition, stop and continue, three datasets, tokens
and loss tokens, worker processes, edited weights at a resume) and offline (`--mix` with
`--batch-size`: every step of rows); the feature a mixture counts; one loss-token definition."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.packer import PackConfig
from seqpack.packer.mixing import carries_loss, slot_counts
from seqpack.packer.order.mix_steps import mixture_steps
from seqpack.pipelines.datasets import (
    ArraySource,
    Columns,
    Mixture,
    PackIterDataset,
    Prefetch,
    make_training_pipeline,
)
from seqpack.pipelines.formats.inputs import LossCount, ReadOptions, scan_file
from seqpack.pipelines.offline.shards import read_shard
from tests.helpers.files import invoke, write_parquet

L, B = 4096, 64


def _source(n, lo, hi, seed, loss=False):
    """n documents of lengths in [lo, hi]; with `loss`, labels -100 on a random prompt."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(lo, hi + 1, n)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    values = rng.integers(0, 1000, offsets[-1]).astype(np.int32)
    if not loss:
        return ArraySource.from_ragged(values, offsets)
    labels = values.astype(np.int64)
    for a, b in zip(offsets[:-1], offsets[1:]):
        labels[a:a + int(rng.integers(0, b - a + 1))] = -100
    return ArraySource({"tokens": (values, offsets), "labels": (labels, offsets)},
                       value_columns=["labels"])


def _units(rows, K, unit="tokens"):
    """f64[R, K]: each row's units per dataset (tokens, or loss tokens from `labels`)."""
    ids = np.stack([r["segment_dataset_id"] for r in rows])
    n = np.stack([r["tokens_segment_lengths"] for r in rows])
    if unit == "loss_tokens":
        marks = carries_loss([(np.stack([r["labels"] for r in rows]), "labels")],
                             (len(rows), rows[0]["tokens"].size))
        n = slot_counts(marks, np.stack([r["tokens_segment_offsets"] for r in rows]), n)
    return np.stack([(n * (ids == k)).sum(1) for k in range(K)], 1).astype(float)


def _batch_shares(units, rows_per_batch=B):
    m = len(units) // rows_per_batch
    per = units[:m * rows_per_batch].reshape(m, rows_per_batch, -1).sum(1)
    return per / per.sum(1, keepdims=True)


def _check(units, weights, *, points=0.02, run=0.005):
    """The worst dataset within `points` of its weight in 95% of batches; the run within
    `run`."""
    w = np.asarray(weights, float)
    dev = np.abs(_batch_shares(units) - w).max(1)
    assert np.percentile(dev, 95) <= points, np.round(dev, 3)
    assert np.abs(units.sum(0) / units.sum() - w).max() <= run, units.sum(0) / units.sum()


def _rows(ds, batches):
    it = iter(ds)
    return [r for _, r in zip(range(batches * B), it)]


CASES = {  # name: (datasets (n, lo, hi), weights, on_exhausted)
    # a 42-token dataset of 300 documents beside ~450-token ones: repeated ~40 times
    "tiny_vs_long_repeat": ([(300, 10, 75), (3000, 100, 800)], [0.5, 0.5], "repeat"),
    "three_stop": ([(60000, 10, 80), (6000, 100, 900), (3000, 1000, 3000)], [.2, .3, .5],
                   "stop"),
    "four_continue": ([(40000, 5, 60), (6000, 100, 900), (3000, 1000, 3000), (9000, 200, 400)],
                      [.1, .2, .4, .3], "continue"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_batch_holds_the_weights(case):
    spec, weights, policy = CASES[case]
    src = {f"d{k}": _source(*s, seed=k) for k, s in enumerate(spec)}
    mix = Mixture(src, weights=dict(zip(src, weights)), on_exhausted=policy, seed=1)
    rows = _rows(PackIterDataset(mix, PackConfig(L, max_segments=256)), 24)
    assert len(rows) == 24 * B
    if case == "tiny_vs_long_repeat":  # the tiny dataset came round many times
        drawn = sum(n for r in rows for n in r["tokens_segment_lengths"][
            r["segment_dataset_id"] == 0])
        assert drawn > 20 * sum(len(src["d0"][i]["tokens"]) for i in range(300))
    _check(_units(rows, len(src)), weights)


def test_every_batch_holds_the_weights_in_loss_tokens():
    src = {"a": _source(8000, 10, 80, seed=0, loss=True),
           "b": _source(3000, 200, 1500, seed=1, loss=True)}
    mix = Mixture(src, weights={"a": 0.3, "b": 0.7}, unit="loss_tokens", labels="labels",
                  on_exhausted="repeat")
    rows = _rows(PackIterDataset(mix, PackConfig(L, max_segments=256),
                                 columns=Columns(labels=["labels"])), 16)
    _check(_units(rows, 2, "loss_tokens"), [0.3, 0.7])


def test_a_dataset_that_leaves_takes_its_last_examples_with_it():
    """`continue`: the window where a dataset leaves is cut there and its rows leave before
    the renormalized stage's: no batch after the one of the change holds any of it (they held
    5-7% of every batch, spread by the 128-row windows), and those before hold its weight."""
    src = {"a": _source(800, 10, 40, seed=0), "b": _source(1500, 50, 300, seed=1),
           "c": _source(500, 200, 1000, seed=2)}
    mix = Mixture(src, weights={"a": .2, "b": .3, "c": .5}, on_exhausted="continue")
    it = iter(PackIterDataset(mix, PackConfig(1024, max_segments=64)))
    shares = _batch_shares(_units([r for _, r in zip(range(16 * 16), it)], 3), 16)
    change = int(np.argmax(shares[:, 0] == 0)) - 1  # the batch where `a` left
    assert 3 <= change < 14 and not shares[change + 1:, 0].any(), np.round(shares[:, 0], 3)
    assert np.abs(shares[:change, 0] - 0.2).max() <= 0.06, np.round(shares[:, 0], 3)


def test_a_schedules_next_stage_holds_its_weights_from_the_batch_after_the_switch():
    """`schedule=`: the window where the next stage starts is cut there, as where a dataset
    leaves, and the old stage's rows leave first: one batch holds both stages, every other
    batch its own stage's weights (the window of ~8 batches' rows straddling the switch
    spread the new stage's draws back to batch 0: batches 0-7 were 8-18 points off)."""
    src = {"a": _source(3000, 10, 40, seed=0), "b": _source(3000, 50, 300, seed=1),
           "c": _source(1000, 200, 1000, seed=2)}
    w0, w1 = np.array([.2, .3, .5]), np.array([.6, .3, .1])
    mix = Mixture(src, schedule=[(0, dict(zip(src, w0))), (100_000, dict(zip(src, w1)))],
                  on_exhausted="repeat")
    it = iter(PackIterDataset(mix, PackConfig(1024, max_segments=64)))
    shares = _batch_shares(_units([r for _, r in zip(range(16 * 16), it)], 3), 16)
    off0, off1 = np.abs(shares - w0).max(1), np.abs(shares - w1).max(1)
    switch = [k for k in range(16)  # the one batch off both: 100,000 tokens, batch ~6
              if off0[:k].max(initial=0) <= 0.09 and off1[k + 1:].max(initial=0) <= 0.09]
    assert switch and 4 <= switch[0] <= 7, np.round(shares, 3)


@pytest.mark.parametrize("long", [(100, 800), (500, 4096)])
def test_a_resume_under_edited_weights_holds_them_from_the_first_batch(long):
    """Restored mid-window under 0.2 / 0.8 (from 0.5 / 0.5): the rows not yet emitted are
    planned again with the new stage's draws, which make up for them, so every batch from the
    first holds the new weights (long documents: a window's rows span several batches)."""
    src = {"a": _source(3000, 10, 75, seed=0), "b": _source(3000, *long, seed=1)}
    make = lambda w: PackIterDataset(  # noqa: E731
        Mixture(src, weights=w, on_exhausted="repeat"), PackConfig(L, max_segments=256))
    it = iter(make({"a": 0.5, "b": 0.5}))
    for at in (4 * B + 17, 5 * B + 44):
        while it.get_state().get("rows_emitted", 0) < at:
            next(it)
        resumed = iter(make({"a": 0.2, "b": 0.8}))
        resumed.set_state(it.get_state())
        shares = _batch_shares(_units([next(resumed) for _ in range(3 * B)], 2))
        assert np.abs(shares[:, 0] - 0.2).max() <= 0.02, (at, shares[:, 0])


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_training_pipeline_batches_hold_the_weights_with_worker_processes(workers):
    src = {"speech": _source(3000, 10, 75, seed=0), "chat": _source(3000, 100, 800, seed=1)}
    mix = Mixture(src, weights={"speech": 0.5, "chat": 0.5}, on_exhausted="repeat")
    ds = make_training_pipeline(mix, pack=PackConfig(L, max_segments=256), batch=B,
                                shuffle_seed=0, num_epochs=None,
                                prefetch=Prefetch(worker_count=workers))
    it = iter(ds)
    batches = [next(it) for _ in range(16)]
    rows = [{k: b[k][i] for k in ("segment_dataset_id", "tokens_segment_lengths")}
            for b in batches for i in range(B)]
    _check(_units(rows, 2), [0.5, 0.5])


@settings(max_examples=6, deadline=None)
@given(st.integers(2, 5), st.integers(0, 2**16))
def test_any_mixture_holds_its_weights_per_batch(K, seed):
    """Random lengths from 1 to L (a dataset's range drawn inside it), random weights: per
    batch within 2 points plus what the longest documents allow (a batch of whole-row
    documents moves by a row)."""
    rng = np.random.default_rng(seed)
    Ls = 1024
    src, top = {}, 0
    for k in range(K):
        hi = int(rng.integers(2, Ls + 1))
        lo = int(rng.integers(1, hi))
        src[f"d{k}"] = _source(4000, lo, hi, seed=seed + k)
        top = max(top, hi)
    w = rng.dirichlet(np.ones(K)) * (1 - 0.05 * K) + 0.05
    mix = Mixture(src, weights=dict(zip(src, w.tolist())), on_exhausted="repeat", seed=seed)
    it = iter(PackIterDataset(mix, PackConfig(Ls, max_segments=64)))
    units = _units([r for _, r in zip(range(12 * 32), it)], K)
    dev = np.abs(_batch_shares(units, 32) - w).max(1)
    assert np.percentile(dev, 95) <= 0.02 + 2 * top / (32 * Ls), np.round(dev, 3)


# -- offline: steps of --batch-size rows -----------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(st.integers(2, 5), st.integers(2, 64), st.integers(1, 400), st.integers(0, 2**16))
def test_mixture_steps_deal_every_row_once_and_hold_the_shares(K, G, n, seed):
    rng = np.random.default_rng(seed)
    units = rng.integers(0, 100, (n, K)) * (rng.random((n, K)) < 0.5)
    steps, rest = mixture_steps(units, G, np.random.default_rng(seed))
    assert steps.shape == (n // G, G) and rest.size == n % G
    assert sorted([*steps.reshape(-1).tolist(), *rest.tolist()]) == list(range(n))
    if units.sum() == 0 or not steps.size:
        return
    share = units.sum(0) / units.sum()
    got = units[steps].sum(1)
    gap = np.abs(got - share * got.sum(1, keepdims=True)).max()
    assert gap <= 2 * units.sum(1).max()  # within two rows' worth, whatever G and n


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    d = tmp_path_factory.mktemp("steps")
    rng = np.random.default_rng(0)
    a = [rng.integers(0, 1000, n).tolist() for n in rng.integers(100, 600, 6000)]
    b = [rng.integers(0, 1000, n).tolist() for n in rng.integers(1000, 3000, 1200)]
    return d, write_parquet(d / "a.parquet", a), write_parquet(d / "b.parquet", b)


def _pack_steps(corpora, name, *more):
    d, a, b = corpora
    out = d / name
    invoke("pack", "--mix", f"a={a}", "--mix", f"b={b}", "--weights", "a=0.3,b=0.7",
           "--seq-len", L, "--max-segments", 256, "-o", out, "--overwrite", *more)
    m = json.loads((out / "manifest.json").read_text())
    shards = [read_shard(str(out), n) for n in m["shards"]]
    rows = {k: np.concatenate([s[k] for s in shards]) for k in shards[0]}
    ids, n = rows["segment_dataset_id"], rows["tokens_segment_lengths"]
    return out, np.stack([(n * (ids == k)).sum(1) for k in (0, 1)], 1).astype(float)


@pytest.mark.parametrize("more", [("--batch-size", 32), ("--data-parallel", 2,
                                                          "--batch-size", 16)])
def test_offline_steps_hold_the_weights(corpora, more):
    _, shuffled = _pack_steps(corpora, "shuffled", "--workers", 1)
    out, units = _pack_steps(corpora, "steps", "--workers", 1, *more)
    share = _batch_shares(units, 32)[:, 0]
    assert np.percentile(np.abs(share - 0.3), 95) <= 0.02, share
    assert abs(units[:, 0].sum() / units.sum() - 0.3) < 0.005
    plain = np.abs(_batch_shares(shuffled, 32)[:, 0] - 0.3)
    assert np.percentile(plain, 95) > 0.05  # what a shuffle of these rows gives
    out2, again = _pack_steps(corpora, "steps2", "--workers", 2, *more)
    assert np.array_equal(units, again)  # the same rows for any number of workers
    assert json.loads((out / "manifest.json").read_text())["row_order"]["batch_size"] == \
        more[-1]


# -- the feature a mixture counts, and one loss-token definition ------------------------------

def test_a_mixture_takes_the_pack_configs_feature_unless_it_names_another():
    src = {"a": ArraySource.from_ragged(np.arange(30, dtype=np.int32), np.array([0, 10, 30]),
                                        feature="input_ids")}
    pack = PackConfig(64, feature="input_ids")
    rows = list(PackIterDataset(Mixture(src, weights={"a": 1}), pack))
    assert rows[0]["input_ids_segment_lengths"].sum() == 30
    it = iter(make_training_pipeline(Mixture(src, weights={"a": 1}), pack=pack, batch=1,
                                     shuffle_seed=0, num_epochs=1))
    assert next(it)["segment_dataset_id"].shape == (1, 64)
    with pytest.raises(ValueError, match=r"Mixture\(feature='tokens'\) but PackConfig\("
                                         r"feature='input_ids'\)"):
        PackIterDataset(Mixture(src, weights={"a": 1}, feature="tokens"), pack)


def test_loss_tokens_are_counted_alike_online_and_offline(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 40, 50)
    toks = [rng.integers(0, 100, n) for n in lengths]
    labels = [np.where(rng.random(n) < 0.4, -100, t) for n, t in zip(lengths, toks)]
    mask = [(rng.random(n) < 0.7).astype(np.int64) for n in lengths]
    path = str(tmp_path / "sft.parquet")
    pq.write_table(pa.table({"tokens": [t.tolist() for t in toks],
                             "labels": [x.tolist() for x in labels],
                             "loss_mask": [x.tolist() for x in mask]}), path)
    scan = scan_file(path, "parquet", ReadOptions(extra_columns=("labels", "loss_mask")),
                     loss_columns=LossCount({"labels": "labels", "loss_mask": "mask"}))
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    src = ArraySource({"tokens": (np.concatenate(toks), offsets),
                       "labels": (np.concatenate(labels), offsets),
                       "loss_mask": (np.concatenate(mask), offsets)},
                      value_columns=["labels", "loss_mask"])
    it = iter(Mixture({"d": src}, weights={"d": 1}, unit="loss_tokens", labels="labels",
                      mask="loss_mask"))
    list(it)
    both = sum(int(((x != -100) & (m != 0)).sum()) for x, m in zip(labels, mask))
    assert it.counters["d"]["loss_tokens"] == int(scan.loss_counts.sum()) == both
    assert scan.loss_counts.tolist() == [int(((x != -100) & (m != 0)).sum())
                                         for x, m in zip(labels, mask)]
