"""Offline mixtures' selection (`offline.mixture`: `hashed`, the legacy one kept for older
manifests): each dataset's units against its target, the sample against a one-place oracle,
the stream however the inputs are cut and chunked, the takes a verify counts."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.pipelines.errors import UsageError
from seqpack.pipelines.offline.mixture import MixSpec, hashed, legacy

# -- the selection ---------------------------------------------------------------------------


@st.composite
def _datasets(draw):
    k = draw(st.integers(1, 4))
    lengths = [np.array(draw(st.lists(st.integers(0, 50), min_size=1, max_size=40)), np.int64)
               for _ in range(k)]
    for x in lengths:
        x[draw(st.integers(0, x.size - 1))] += 1  # every dataset holds a token
    loss = [np.minimum(x, draw(st.integers(1, 50))) for x in lengths]
    weights = {f"d{i}": draw(st.floats(0.05, 10)) for i in range(k)}
    return lengths, loss, weights


def _select(kind, spec, lengths, loss, block_size=1 << 22):
    """The stream of either selection, each dataset one input."""
    if kind == "legacy":
        return legacy.select(spec, lengths, loss)
    return hashed.select_inputs(spec, lengths, loss, block_size)


@settings(max_examples=150, deadline=None)
@given(_datasets(), st.sampled_from(["tokens", "loss_tokens", "examples"]),
       st.one_of(st.none(), st.floats(0.2, 3.9)), st.integers(0, 5),
       st.sampled_from(["legacy", "hashed"]), st.integers(1, 50))
def test_each_dataset_gets_its_target_within_one_example(case, unit, scale, seed, kind, block):
    lengths, loss, weights = case
    # (an example the rows keep no token of: no example of the hashed selection's either)
    units = [x if unit == "tokens" else y if unit == "loss_tokens" else np.ones_like(x)
             if kind == "legacy" else (x > 0).astype(np.int64) for x, y in zip(lengths, loss)]
    names = list(weights)
    w = np.array([weights[n] for n in names]) / sum(weights.values())
    avail = np.array([u.sum() for u in units], float)
    n_tokens = None if scale is None else max(1, int(scale * (avail / w).min()))
    spec = MixSpec([(n, [f"{n}.jsonl"]) for n in names], weights, mix_unit=unit,
                   mix_tokens=n_tokens, seed=seed)
    try:
        s = _select(kind, spec, lengths, loss, block)
    except UsageError as e:  # only past max_repetition
        assert n_tokens is not None and "max_repetition" in str(e)
        assert (w * n_tokens / avail).max() > spec.max_repetition
        return
    total = (avail / w).min() if n_tokens is None else n_tokens
    firsts = np.cumsum([0, *(x.size for x in lengths)])
    corpus = np.concatenate(lengths)
    times = np.bincount(s.ref, minlength=firsts[-1])
    np.testing.assert_array_equal(s.lengths, corpus[s.ref])
    for d, entry in enumerate(s.record["datasets"]):
        t = times[firsts[d] : firsts[d + 1]]
        got = int((units[d] * t).sum())
        assert entry["units"] == got and entry["examples"] == t.sum()
        assert entry["tokens"] == int((lengths[d] * t).sum())
        assert abs(got - w[d] * total) <= units[d].max() + 1e-6 * total, (d, got, w[d] * total)
        assert t.max() - t.min() <= 1  # whole epochs, then a sample without replacement
        assert entry["epochs"] == t.min() or entry["unused_examples"] == (t == 0).sum()
        if n_tokens is None:
            assert t.max() <= 1  # no repetition
    if n_tokens is None:  # the binding dataset is taken whole
        binding = int(np.argmin(avail / w))
        assert (times[firsts[binding] : firsts[binding + 1]] == 1).all()
    again = _select(kind, spec, lengths, loss, block)
    assert np.array_equal(again.ref, s.ref)  # seeded: the same again
    if kind == "hashed":  # what verify counts: each input's takes from the record alone
        mix = hashed.plan_of(s.record)
        np.testing.assert_array_equal(np.concatenate([
            mix.times(seed, d, 0, x.size) for d, x in enumerate(lengths)]), times)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=5), st.integers(0, 2**32),
       st.sampled_from(["tokens", "examples"]), st.integers(20, 400))
def test_the_hashed_stream_is_the_same_however_a_dataset_is_cut_into_inputs(cuts, seed, unit,
                                                                            block):
    rng = np.random.default_rng(seed)
    lengths = [rng.integers(0, 40, 700), rng.integers(1, 90, 150)]
    lengths[0][0] = 1
    spec = MixSpec([("a", ["a"]), ("b", ["b"])], {"a": 0.6, "b": 0.4}, mix_unit=unit,
                   mix_tokens=int(rng.integers(5_000, 40_000)), max_repetition=1000, seed=seed)
    whole = hashed.select_inputs(spec, lengths, [None, None], block)
    cuts = sorted(set(cuts))
    parts = np.split(lengths[0], cuts)
    split = MixSpec([("a", [f"a{i}" for i in range(len(parts))]), ("b", ["b"])],
                    spec.weights, mix_unit=unit, mix_tokens=spec.mix_tokens,
                    max_repetition=1000, seed=seed)
    cut = hashed.select_inputs(split, [*parts, lengths[1]], [None] * (len(parts) + 1), block)
    np.testing.assert_array_equal(cut.ref, whole.ref)
    assert [d["sample_below"] for d in cut.record["datasets"]] == \
        [d["sample_below"] for d in whole.record["datasets"]]


@pytest.mark.parametrize("kind", ["legacy", "hashed"])
def test_the_stream_holds_the_mixture_all_along(kind):
    lengths = [np.full(3000, 5), np.full(500, 30)]
    spec = MixSpec([("a", ["a"]), ("b", ["b"])], {"a": 1, "b": 1})
    s = _select(kind, spec, lengths, lengths)  # one chunk: exact all along
    is_b = s.ref >= 3000
    for end in range(100, s.num_examples, 250):  # every prefix within one example of 50/50
        tokens_b = s.lengths[:end][is_b[:end]].sum()
        assert abs(tokens_b - s.lengths[:end].sum() / 2) <= 30


def test_each_chunk_of_the_hashed_stream_holds_the_mixture():
    rng = np.random.default_rng(0)
    lengths = [rng.integers(1, 10, 40_000), rng.integers(20, 60, 4_000)]
    spec = MixSpec([("a", ["a"]), ("b", ["b"])], {"a": 1, "b": 1})
    s = hashed.select_inputs(spec, lengths, lengths, 2_000)  # about 22 chunks
    is_b = s.ref >= 40_000
    tokens = s.lengths.astype(float)
    for a in range(0, s.num_examples - 2_000, 2_000):  # each block: within a few %
        share = tokens[a : a + 2_000][is_b[a : a + 2_000]].sum() / tokens[a : a + 2_000].sum()
        assert abs(share - 0.5) < 0.04, (a, share)


def test_verify_recomputes_a_legacy_record_with_the_legacy_selection():
    from seqpack.pipelines.offline.mixture import example_times

    rng = np.random.default_rng(3)
    lengths = [rng.integers(1, 30, 300), rng.integers(1, 60, 80)]
    spec = MixSpec([("a", ["a"]), ("b", ["b"])], {"a": 0.5, "b": 0.5}, mix_tokens=9_000)
    old = legacy.select(spec, lengths, lengths)
    assert "selection" not in old.record
    times, problems = example_times(old.record, lengths, [None, None])
    assert problems == []
    np.testing.assert_array_equal(times, np.bincount(old.ref, minlength=380))
    new = hashed.select_inputs(spec, lengths, [None, None], 64)
    assert new.record["selection"] == "hashed"
    times, problems = example_times(new.record, lengths, [None, None])
    assert problems == []
    np.testing.assert_array_equal(times, np.bincount(new.ref, minlength=380))
    changed = [lengths[0], lengths[1] + 1]
    assert example_times(new.record, changed, [None, None])[1]  # the inputs changed


@pytest.mark.parametrize("kind", ["legacy", "hashed"])
def test_a_natural_size_mixture_takes_no_example_twice_for_rounding_noise(kind):
    # the binding dataset's target is its whole size up to float noise (27.000000000000004):
    # the noise once sampled its leading empty examples a second time
    lengths = [np.array([9]), np.array([0, 1, 0, 0, 0, 0, 26]), np.array([7]), np.array([25])]
    weights = {"d0": 1.0, "d1": 3.3125, "d2": 0.8125, "d3": 3.0}
    spec = MixSpec([(n, [f"{n}.jsonl"]) for n in weights], weights, mix_unit="tokens", seed=0)
    s = _select(kind, spec, lengths, lengths)
    times = np.bincount(s.ref, minlength=10)
    assert times.max() == 1
    assert [d["examples"] for d in s.record["datasets"]][1] == 7


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 6), st.sampled_from(["tokens", "loss_tokens",
                                                                   "examples"]),
       st.floats(0.3, 3.5))
def test_the_hashed_sample_is_the_prefix_of_its_hash_order_nearest_the_target(
        seed, bucket_examples, unit, scale):
    """Against a one-place oracle, with buckets of a few examples (many buckets, the crossing
    one found by the tallies): the sample is the prefix of the sample-hash order whose units
    come nearest the rest, `legacy._sample`'s rule."""
    import unittest.mock

    rng = np.random.default_rng(seed)
    lengths = [rng.integers(0, 30, int(rng.integers(1, 3000))) for _ in range(2)]
    loss = [np.minimum(x, rng.integers(0, 10, x.size)) for x in lengths]
    for x, y in zip(lengths, loss):
        x[0], y[0] = x[0] + 1, y[0] + 1  # a unit in every dataset
    spec = MixSpec([("a", ["a"]), ("b", ["b"])], {"a": 0.4, "b": 0.6}, mix_unit=unit,
                   max_repetition=1e9, seed=seed % 1000)
    units = [hashed.example_units(spec, x, y, count_empty=False)[2]
             for x, y in zip(lengths, loss)]
    natural = min(u.sum() / w for u, w in zip(units, (0.4, 0.6)))
    spec = dataclasses.replace(spec, mix_tokens=max(1, int(scale * natural)))
    with unittest.mock.patch.object(hashed, "_BUCKET_EXAMPLES", bucket_examples):
        mix = hashed.plan_inputs(spec, hashed.inputs_of(spec, lengths, loss))
    total, wanted = hashed.targets(spec, [int(u.sum()) for u in units])
    for d, (u, want) in enumerate(zip(units, wanted)):
        epochs, rest = hashed.epochs_of(want, int(u.sum()))
        h = hashed.sample_hashes(spec.seed, d, 0, u.size)
        order = np.argsort(h)
        cum = np.cumsum(u[order])
        k = 0
        if rest > 0:
            k = int(np.searchsorted(cum, rest, side="left"))
            k += bool(cum[k] - rest <= rest - (cum[k - 1] if k else 0))
        taken = np.zeros(u.size, np.int64)
        taken[order[:k]] = 1
        assert mix.epochs[d] == epochs
        np.testing.assert_array_equal(mix.times(spec.seed, d, 0, u.size), taken + epochs)
        entry = mix.record["datasets"][d]
        assert entry["units"] == int((u * (taken + epochs)).sum())
        assert entry["examples"] == int((taken + epochs).sum())


def test_the_hashed_tallies_add_exactly_past_float64_and_count_only_examples_the_rows_keep():
    rng = np.random.default_rng(0)
    a = rng.integers(2**44, 2**45, 2000)  # past 2**53 units in all: float64 sums would round
    spec = MixSpec([("a", ["a"]), ("b", ["b"])], {"a": 0.5, "b": 0.5})
    s = hashed.select_inputs(spec, [a, a[:500].copy()], [None, None], 1 << 20)
    assert s.record["datasets"][0]["available_units"] == int(a.sum())
    with pytest.raises(AssertionError):  # a caller's bug, not a changed input
        hashed.select_inputs(spec, [a], [None], 8)
    # examples as units: an example the rows drop whole is no example of the mixture
    spec = MixSpec([("a", ["a"]), ("b", ["b"])], {"a": 1, "b": 1}, mix_unit="examples",
                   overflow="drop", seq_len=10)
    a, b = np.array([5] * 50 + [50] * 50), np.full(100, 5)
    s = hashed.select_inputs(spec, [a, b], [None, None], 1 << 20)
    kept = [(s.lengths[s.ref < 100] <= 10).sum(), (s.ref >= 100).sum()]
    assert [d["units"] for d in s.record["datasets"]] == kept and kept[0] == kept[1] == 50
