"""Hypothesis properties of PackIterDataset: lossless, within capacity and segment cap, same rows
for the same input and seed, and exact restore from any step's state."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.packer import PackConfig, validate
from seqpack.pipelines.datasets import (
    ArraySource,
    PackIterDataset,
    SequentialIterDataset,
    Window,
)
from tests.helpers.packer import check_lossless, corpus


@st.composite
def setups(draw):
    align = draw(st.sampled_from([1, 1, 2]))
    config = PackConfig(
        align * draw(st.integers(2, 16)),
        max_segments=draw(st.integers(1, 5)),
        overflow=draw(st.sampled_from(["truncate", "split", "drop"])),
        segment_alignment=align,
    )
    lengths = draw(st.lists(st.integers(0, 40), min_size=1, max_size=40))
    window = draw(st.integers(1, 7))
    shuffle = draw(st.booleans())
    return config, lengths, (window, draw(st.sampled_from([0, 1, 3, 128]))), shuffle


def _dataset(config, lengths, window, shuffle, seed=3):
    """`window`: (examples a window, window_rows)."""
    values, offsets = corpus(lengths)
    parent = SequentialIterDataset(ArraySource.from_ragged(values, offsets))
    ds = PackIterDataset(parent, config,
                         window=Window(window[0], window_rows=window[1], shuffle_rows=shuffle),
                         seed=seed)
    return ds, values, offsets


def _stack(rows):
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


@settings(max_examples=60, deadline=None)
@given(setups())
def test_pack_iter_dataset_is_lossless_capped_and_deterministic(setup):
    config, lengths, window, shuffle = setup
    ds, values, offsets = _dataset(config, lengths, window, shuffle)
    rows = list(ds)
    if not rows:  # everything was empty or dropped
        assert all(n == 0 or (n > config.seq_len and config.overflow.value == "drop")
                   for n in lengths)
        return
    batch = _stack(rows)
    validate(batch, config)  # capacity, segment cap, alignment, ids, positions, padding
    check_lossless(batch, values, offsets, config)  # every token once, in order, or counted
    again = list(_dataset(config, lengths, window, shuffle)[0])
    assert len(again) == len(rows)
    for a, b in zip(rows, again):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


@settings(max_examples=25, deadline=None)
@given(setups(), st.data())
def test_pack_iter_dataset_restores_exactly_from_any_step(setup, data):
    config, lengths, window, shuffle = setup
    ds, _, _ = _dataset(config, lengths, window, shuffle)
    full = list(ds)
    step = data.draw(st.integers(0, len(full)))
    it = iter(ds)
    for _ in range(step):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    fresh = iter(_dataset(config, lengths, window, shuffle)[0])
    fresh.set_state(state)
    rest = list(fresh)
    assert len(rest) == len(full) - step
    for a, b in zip(rest, full[step:]):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 20), st.integers(1, 12)), min_size=1, max_size=30),
       st.integers(1, 5), st.integers(1, 4))
def test_multi_feature_rows_keep_each_example_together(pairs, window, max_segments):
    caps = {"inputs": 24, "targets": 16}
    cols = {}
    for f, name in enumerate(caps):
        values, offsets = corpus([p[f] for p in pairs])
        cols[name] = (values + 1000 * f, offsets)  # unique tokens per feature
    parent = SequentialIterDataset(ArraySource(cols))
    rows = list(PackIterDataset(parent, [PackConfig(L, max_segments=max_segments, feature=f)
                                         for f, L in caps.items()],
                                window=Window(window)))
    batch = _stack(rows)
    seen = {}
    for name, L in caps.items():
        validate({k: v for k, v in batch.items() if k.startswith(name) or k.startswith("segment_")},
                 PackConfig(L, max_segments=max_segments, feature=name))
        lens, offs = batch[f"{name}_segment_lengths"], batch[f"{name}_segment_offsets"]
        for (r, j), e in np.ndenumerate(batch["segment_source_index"]):
            if e < 0:
                continue
            got = batch[name][r, offs[r, j] : offs[r, j] + lens[r, j]]
            values, offsets = cols[name]
            np.testing.assert_array_equal(got, values[offsets[e] : offsets[e + 1]])
            seen.setdefault(int(e), set()).add((r, j))
    # Every example appears exactly once, both features in the same row and slot.
    assert sorted(seen) == list(range(len(pairs)))
    assert all(len(places) == 1 for places in seen.values())
