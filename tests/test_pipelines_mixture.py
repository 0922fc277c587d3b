"""Mixtures: the shortfall rule's shares, schedules, exhaustion, rows that name their dataset,
and resumes that repeat and lose nothing when the weights change."""

from __future__ import annotations

import json
from collections import Counter

import grain
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.packer import PackConfig
from seqpack.packer.mixing import ShortfallMixer, make_stages
from seqpack.pipelines.datasets import (
    Batching,
    Mixture,
    Prefetch,
    Window,
    make_training_pipeline,
)
from seqpack.pipelines.errors import InputError
from tests.helpers.mixtures import (
    checked_segments,
    example_lengths,
    named_sources,
    packed_tokens,
    packing,
)
from tests.helpers.pipelines import (
    assert_rows_equal,
    check_restore_every_step,
)

# ---- the rule ------------------------------------------------------------------------------

def test_worked_example_of_the_docstring():
    mixer = ShortfallMixer(make_stages(["a", "b"], {"a": 1, "b": 1}))
    picks = []
    for _ in range(6):
        d = mixer.pick()
        picks.append(d)
        mixer.add(d, 4 if d == 0 else 1)
    assert picks == [0, 1, 1, 1, 1, 0]
    assert (mixer.consumed, mixer.total) == ([8, 4], 12)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=2, max_size=4), st.integers(0, 2**16),
       st.sampled_from(["tokens", "examples"]))
def test_every_prefix_holds_each_share_within_one_example(raw, seed, unit):
    if not sum(raw):
        raw[0] = 1
    names = [f"d{k}" for k in range(len(raw))]
    stages = make_stages(names, dict(zip(names, raw)))
    weights = np.array(stages[0].weights)
    rng = np.random.default_rng(seed)
    high = rng.integers(1, 50, len(raw))
    mixer = ShortfallMixer(stages)
    for _ in range(300):
        d = mixer.pick()
        assert weights[d] > 0
        mixer.add(d, int(rng.integers(1, high[d] + 1)) if unit == "tokens" else 1)
        gap = weights * mixer.total - np.array(mixer.consumed)
        biggest = high if unit == "tokens" else np.ones(len(raw))
        # within one example of the largest size (1.12 seen with 8 datasets, docs/mixing.md)
        assert np.all(np.abs(gap) <= 1.2 * biggest.max()), (gap, biggest)


def test_a_schedule_switches_at_its_start_and_counts_from_there():
    stages = make_stages(["a", "b"], schedule=[(0, {"a": 1, "b": 0}), (100, {"a": 1, "b": 3})])
    mixer = ShortfallMixer(stages)
    while mixer.total < 100:
        assert mixer.pick() == 0
        mixer.add(0, 7)
    at = list(mixer.consumed)
    for _ in range(400):
        d = mixer.pick()
        mixer.add(d, 2 if d == 0 else 5)
    since = np.array(mixer.consumed) - at
    assert abs(since[1] / since.sum() - 0.75) < 5 / since.sum()


def test_bad_weights_and_options_say_what_is_wrong():
    src = named_sources()
    with pytest.raises(ValueError, match=r"miss \['b'\]"):
        Mixture(src, weights={"a": 1})
    with pytest.raises(ValueError, match=r"name \['z'\]"):
        Mixture(src, weights={"a": 1, "b": 1, "z": 1})
    with pytest.raises(ValueError, match="weight of 'b' is -1"):
        Mixture(src, weights={"a": 1, "b": -1})
    with pytest.raises(ValueError, match="pass one of weights="):
        Mixture(src)
    with pytest.raises(ValueError, match="must start at 0"):
        Mixture(src, schedule=[(5, {"a": 1, "b": 1})])
    with pytest.raises(ValueError, match="labels column"):
        Mixture(src, weights={"a": 1, "b": 1}, unit="loss_tokens")
    with pytest.raises(ValueError, match="on_exhausted"):
        Mixture(src, weights={"a": 1, "b": 1}, on_exhausted="loop")


# ---- the stream ----------------------------------------------------------------------------

@pytest.mark.parametrize("unit", ["tokens", "loss_tokens", "examples"])
def test_the_stream_holds_the_shares_in_its_unit(unit):
    src = named_sources(ns=(400, 400), highs=(10, 60), sft=True)
    mix = Mixture(src, weights={"a": 0.25, "b": 0.75}, unit=unit, labels="labels",
                  on_exhausted="repeat", num_epochs=None)
    it = iter(mix)
    per = {0: 0, 1: 0}
    for _ in range(600):
        e = next(it)
        d = 0 if e["tokens"][0] < 2 * 10**6 else 1
        per[d] += (len(e["tokens"]) if unit == "tokens" else
                   int((e["labels"] != -100).sum()) if unit == "loss_tokens" else 1)
    share = per[0] / (per[0] + per[1])
    assert abs(share - 0.25) * (per[0] + per[1]) <= 60, (unit, per)
    counted = it.counters
    assert counted["a"]["examples"] + counted["b"]["examples"] == 600
    if unit == "loss_tokens":
        assert [counted[n]["loss_tokens"] for n in "ab"] == [per[0], per[1]]


def test_exhaustion_stop_continue_repeat():
    src = named_sources(ns=(20, 200), highs=(10, 10))
    stream = lambda **kw: list(iter(Mixture(src, weights={"a": 1, "b": 1}, unit="examples",
                                            **kw)))
    stop = stream(on_exhausted="stop")
    assert len(stop) == 40  # 20 of each, then a would be next
    cont = stream(on_exhausted="continue")
    assert len(cont) == 220  # every example once
    rep = stream(on_exhausted={"a": "repeat", "b": "stop"})
    a = [int(e["tokens"][0]) for e in rep if e["tokens"][0] < 2 * 10**6]
    assert (len(rep), len(a)) == (401, 201)  # b ends the stream when next picked (at a tie)
    epochs = [a[k:k + 20] for k in range(0, 200, 20)]
    assert all(sorted(e) == sorted(epochs[0]) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1
    twice = stream(on_exhausted="stop", num_epochs=2)
    assert [e["tokens"].tolist() for e in twice[:40]] == [e["tokens"].tolist() for e in stop]


# ---- rows ----------------------------------------------------------------------------------

def test_rows_name_each_segments_dataset_and_index():
    src = named_sources()
    rows = list(packing(Mixture(src, weights={"a": 1, "b": 1}, on_exhausted="continue")))
    assert rows[0]["segment_dataset_id"].dtype == np.int32
    assert rows[0]["segment_source_index"].dtype == np.int64
    assert packed_tokens(rows) == example_lengths(src)  # every token of every example, once


@pytest.mark.parametrize("unit", ["tokens", "examples"])
def test_restore_at_every_step_under_the_same_weights(unit):
    src = named_sources()
    ds = packing(Mixture(src, weights={"a": 2, "b": 1}, unit=unit, on_exhausted="continue"))
    rows = check_restore_every_step(lambda: iter(ds))
    assert len(rows) > 10


def test_restore_at_every_step_across_a_schedules_switch():
    """The window where the next stage starts is planned in two parts (the state's "cuts"):
    a restore at every step plans it in the same parts."""
    src = named_sources()
    ds = packing(Mixture(src, schedule=[(0, {"a": 3, "b": 1}), (650, {"a": 1, "b": 3})],
                       on_exhausted="repeat"))
    it = iter(ds)
    states = [it.get_state() for _ in zip(range(30), it)]
    cuts = {c for s in states for c in s.get("cuts", []) if s["window_first"] < c < s["next_id"]}
    assert len(cuts) == 1, cuts  # the switch, inside a window
    assert len(check_restore_every_step(lambda: iter(ds), max_rows=30)) == 30


@pytest.mark.parametrize("policy", ["continue", "stop"])
def test_edited_weights_at_every_step_repeat_and_lose_nothing(policy):
    src = named_sources()
    old = packing(Mixture(src, weights={"a": 1, "b": 1}, on_exhausted=policy))
    new = packing(Mixture(src, weights={"a": 1, "b": 4}, on_exhausted=policy))
    it = iter(old)
    states, rows = [it.get_state()], []
    for row in it:
        rows.append(row)
        states.append(json.loads(json.dumps(it.get_state())))
    full = example_lengths(src)
    for step, state in enumerate(states):
        resumed = iter(new)
        resumed.set_state(state)
        got = packed_tokens(rows[:step] + list(resumed))
        if policy == "continue":
            assert got == full, step  # every example of every dataset once
        else:
            assert all(full[k] == n for k, n in got.items()), step  # whole, never twice


def test_after_edited_weights_split_pieces_are_planned_again_and_restores_stay_exact():
    """Under edited weights the pieces not yet emitted (split ones too: L = 40 < 72) are
    planned again with the new draws: every token once; and a state of the resumed run
    restores exactly at every step."""
    src = named_sources()
    make = lambda w: packing(Mixture(src, weights=w, on_exhausted="continue"), L=40)  # noqa: E731
    it = iter(make({"a": 1, "b": 1}))
    rows = [next(it) for _ in range(9)]
    state = json.loads(json.dumps(it.get_state()))
    assert state["emitted"] > 0  # restored mid-window: some of its rows are planned again

    def resumed():
        r = iter(make({"a": 1, "b": 5}))
        r.set_state(state)
        return r

    assert packed_tokens(rows + list(resumed())) == example_lengths(src)
    assert len(check_restore_every_step(resumed)) > 10


def test_edited_weights_take_hold_from_the_restored_point():
    src = named_sources(ns=(1500, 1500), highs=(20, 20))
    make = lambda w: packing(Mixture(src, weights=w, unit="tokens", on_exhausted="continue"))
    it = iter(make({"a": 1, "b": 1}))
    for _ in range(8):
        next(it)
    state = it.get_state()
    resumed = iter(make({"a": 1, "b": 3}))
    resumed.set_state(state)
    drawn_before = state["parent"]["tokens"]
    rows = [next(resumed) for _ in range(60)]
    after = resumed.counters["datasets"]
    since = [after[n]["tokens"] - t for n, t in zip("ab", drawn_before)]
    # no labels or mask column: every token carries a loss, as a batch's loss_tokens counts
    assert all(after[n]["loss_tokens"] == after[n]["tokens"] > 0 for n in "ab"), after
    assert abs(since[1] / sum(since) - 0.75) < 0.03, since  # drawn since the restore
    tok = np.array([[sum(n for d, _, _, n in checked_segments([r]) if d == k) for k in (0, 1)]
                    for r in rows[20:]])  # rows of windows drawn after it
    assert abs(tok[:, 1].sum() / tok.sum() - 0.75) < 0.03, tok.sum(0)


def test_restore_refuses_other_datasets_with_the_difference_named():
    src = named_sources()
    it = iter(packing(Mixture(src, weights={"a": 1, "b": 1})))
    next(it)
    state = it.get_state()
    other = dict(src, c=src["a"])
    with pytest.raises(InputError, match=r"the mixture has \['c'\]"):
        iter(packing(Mixture(other, weights={"a": 1, "b": 1, "c": 1}))).set_state(state)
    swapped = {"b": src["b"], "a": src["a"]}
    with pytest.raises(InputError, match="another order"):
        iter(packing(Mixture(swapped, weights={"a": 1, "b": 1}))).set_state(state)
    shorter = {"a": src["a"][:50], "b": src["b"]}
    with pytest.raises(InputError, match="'a' holds 50 examples but held 60"):
        iter(packing(Mixture(shorter, weights={"a": 1, "b": 1}))).set_state(state)
    with pytest.raises(InputError, match="shard"):
        iter(packing(Mixture(src, weights={"a": 1, "b": 1}, shard_index=0, shard_count=2))
             ).set_state(state)


# ---- the training pipeline -----------------------------------------------------------------

def _pipeline(mix, *, shard=(0, 1), workers=0, batch=2, **kw):
    return make_training_pipeline(
        mix, pack=PackConfig(128, max_segments=8, overflow="split"),
        batch=Batching(batch, drop_remainder=False, shard_index=shard[0], shard_count=shard[1]),
        shuffle_seed=3, num_epochs=1, window=Window(16, window_rows=4),
        prefetch=Prefetch(worker_count=workers), **kw)


def _unbatch(batches):
    return [{k: v[r] for k, v in b.items()} for b in batches for r in range(len(b["tokens"]))]


def test_hosts_share_every_example_once():
    src = named_sources()
    mix = Mixture(src, weights={"a": 1, "b": 1}, on_exhausted="continue")
    got: Counter = Counter()
    for h in range(2):
        rows = _unbatch(list(_pipeline(mix, shard=(h, 2))))
        assert all("segment_dataset_id" in r for r in rows)
        got += packed_tokens(rows)
    assert got == example_lengths(src)


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_pipeline_resume_with_edited_weights(workers):
    src = named_sources()
    old = Mixture(src, weights={"a": 1, "b": 1}, on_exhausted="continue")
    new = Mixture(src, weights={"a": 3, "b": 1}, on_exhausted="continue")
    it = iter(_pipeline(old, workers=workers))
    full, states = [], [json.loads(json.dumps(it.get_state()))]
    for b in it:
        full.append(b)
        states.append(json.loads(json.dumps(it.get_state())))
    it.close()
    assert packed_tokens(_unbatch(full)) == example_lengths(src)
    for n, state in enumerate(states[:-1]):  # a resume at every step
        if not workers or n in (1, len(full) // 2):  # (and the old weights' exact tail)
            same = iter(_pipeline(old, workers=workers))
            same.set_state(state)
            assert_rows_equal(list(same), full[n:])
            same.close()
        resumed = iter(_pipeline(new, workers=workers))
        resumed.set_state(state)
        got = packed_tokens(_unbatch(full[:n] + list(resumed)))
        resumed.close()
        assert got == example_lengths(src), n


def test_mixture_is_a_grain_dataset_with_worker_slices():
    src = named_sources()
    mix = Mixture(src, weights={"a": 1, "b": 1}, on_exhausted="continue")
    assert isinstance(mix, grain.IterDataset)
    seen: Counter = Counter()
    for w in range(3):
        part = mix.configured(shard_index=0, shard_count=1, num_epochs=1)
        part.set_slice(slice(w, None, 3))
        seen += Counter((0 if e["tokens"][0] < 2 * 10**6 else 1, int(e["tokens"][0]) % 10**6)
                        for e in part)
    assert sum(seen.values()) == 90 and max(seen.values()) == 1
