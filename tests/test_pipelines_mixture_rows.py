"""Mixtures: the rows' order against the shares, a mixer's state, rows that hold the weights as
they leave, over-length examples named, every token once, and what the packer holds."""

from __future__ import annotations

import json
import re

import grain
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.packer import PackConfig
from seqpack.packer.mixing import ShortfallMixer, make_stages
from seqpack.pipelines.datasets import Mixture, PackIterDataset, Window
from seqpack.pipelines.errors import InputError
from tests.helpers.mixtures import (
    checked_segments,
    example_lengths,
    named_sources,
    packed_tokens,
    packing,
)
from tests.helpers.pipelines import assert_rows_equal


@settings(max_examples=40, deadline=None)
@given(st.integers(3, 60), st.integers(2, 4), st.integers(0, 2**16))
def test_balanced_order_is_a_permutation_whose_prefixes_track_the_shares(R, K, seed):
    from seqpack.pipelines.datasets.mixing import balanced_order

    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 100, (R, K)) * (rng.random((R, K)) < 0.6)
    shuffled = rng.permutation(R).tolist()
    order = balanced_order(tokens, shuffled)
    assert sorted(order) == list(range(R))
    if tokens.sum() == 0:
        return
    share = tokens.sum(0) / tokens.sum()
    run = np.cumsum(tokens[order], axis=0)
    gap = np.abs(run - share * run.sum(1, keepdims=True)).max()
    naive = np.abs(np.cumsum(tokens[shuffled], axis=0)
                   - share * np.cumsum(tokens[shuffled], axis=0).sum(1, keepdims=True)).max()
    assert gap <= max(naive, 2 * tokens.sum(1).max())  # never worse than one row's worth twice


def test_a_state_restores_its_counts_and_ignores_an_older_states_held_units():
    mixer = ShortfallMixer(make_stages(["a", "b"], {"a": 1, "b": 1}))
    for _ in range(10):
        mixer.add(mixer.pick(), 10)
    assert mixer.consumed == [50, 50]
    assert mixer.pick() == 0  # a tie goes to the first
    mixer.add(0, 10)
    assert mixer.pick() == 1
    state = json.loads(json.dumps(mixer.get_state()))
    assert "held" not in state
    again = ShortfallMixer(make_stages(["a", "b"], {"a": 1, "b": 1}))
    assert again.set_state({**state, "held": [40, 0]}) is False  # same weights, same stage
    assert again.consumed == [60, 50] and again.pick() == 1


@pytest.mark.parametrize("seed", [2, 3])
def test_rows_that_leave_hold_the_weights_through_the_run(seed):
    """Few open rows over a mixture (a window's worth swing these batches several times
    further off)."""
    src = named_sources(ns=(3000, 400), highs=(40, 400), seed=seed)
    rows = list(packing(Mixture(src, weights={"a": 1, "b": 1}, on_exhausted="stop"), L=512,
                      window=64))
    tok = np.array([[sum(n for d, _, _, n in checked_segments([r]) if d == k) for k in (0, 1)]
                    for r in rows], float)
    per = [tok[i:i + 32, 0].sum() / tok[i:i + 32].sum() for i in range(0, len(rows) - 32, 32)]
    middle = np.array(per[1:-2])  # the open rows leave last, as they are
    assert np.abs(middle - 0.5).max() < 0.06, per
    assert abs(tok[:, 0].sum() / tok.sum() - 0.5) < 0.005  # and the whole run holds the weights


def test_an_over_length_example_is_named_by_its_dataset_and_index():
    src = named_sources(ns=(20, 20), highs=(10, 300), seed=1)
    ds = PackIterDataset(Mixture(src, weights={"a": 1, "b": 1}, on_exhausted="continue"),
                         PackConfig(128), window=Window(64))
    with pytest.raises(InputError, match=r"dataset 'b' example (\d+) has length (\d+) > seq_"
                       ) as e:
        list(ds)
    index, length = map(int, re.search(r"example (\d+) has length (\d+)", str(e.value)).groups())
    assert len(src["b"][index]["tokens"]) == length > 128


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=2, max_size=3), st.lists(st.integers(1, 5),
       min_size=3, max_size=3), st.sampled_from(["tokens", "examples"]), st.integers(0, 2**16))
def test_a_packed_mixture_conserves_every_token_once(ns, weights, unit, seed):
    """Every example of every dataset once (continue), each segment its example's tokens in
    order (checked by `checked_segments`), capacity and segment cap held, the same rows for a
    seed."""
    src = named_sources(ns=tuple(ns), highs=(20, 90, 200)[:len(ns)], seed=seed)
    w = dict(zip(src, weights))
    make = lambda: packing(Mixture(src, weights=w, unit=unit, on_exhausted="continue",  # noqa: E731
                                 seed=seed), L=64, window=8)
    rows = list(make())
    assert packed_tokens(rows) == example_lengths(src)
    for r in rows:
        assert r["tokens_segment_lengths"].sum() <= 64
        assert (r["tokens_segment_lengths"] > 0).sum() <= 8
    assert_rows_equal(list(make()), rows)


def test_open_rows_default_to_few_over_a_mixture():
    from seqpack.pipelines.datasets.layouts import MIXED_OPEN_ROWS

    src = named_sources()
    mix = Mixture(src, weights={"a": 1, "b": 1})
    assert PackIterDataset(mix, PackConfig(128)).open_rows == MIXED_OPEN_ROWS
    assert PackIterDataset(mix, PackConfig(128), window=Window(open_rows=0)).open_rows == 0
    plain = PackIterDataset(grain.MapDataset.source([{"tokens": np.arange(3)}]).to_iter_dataset(),
                            PackConfig(128))
    assert plain.open_rows is None  # the planner's default: the window
    assert iter(packing(mix)).get_state()["phase"] == "start"
    with pytest.raises(ValueError, match="open_rows=-1"):
        Window(open_rows=-1)


def test_the_references_held_stay_bounded_over_a_long_run():
    """The (dataset, index) table keeps only the windows open rows still need, as the held
    tokens do: not one entry per window read."""
    src = named_sources(ns=(3000, 3000), highs=(20, 20))
    it = iter(packing(Mixture(src, weights={"a": 1, "b": 1}, on_exhausted="continue")))
    held = [len(it._refs.windows) for _ in it]
    windows_read = it._next_id // 16
    assert windows_read > 300 and max(held) <= 20, (windows_read, max(held))
