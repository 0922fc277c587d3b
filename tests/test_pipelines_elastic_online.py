"""Online packing that restores on another number of hosts and worker processes.

A state saved on H hosts (each with W worker processes) restores on H' hosts with W' workers,
from every host's state: across all hosts every example of the epoch is packed once, the
examples in flight at the save (open rows, rows not emitted, split pieces) included. Hosts
are simulated with Batching(shard_index, shard_count); worker processes are real
(`mp_prefetch`); tests/test_multihost.py runs real JAX processes.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.packer import PackConfig
from seqpack.pipelines.datasets import Window, elastic
from seqpack.pipelines.errors import InputError
from tests.helpers.elastic import (
    WINDOW,
    examples,
    lengths,
    pipeline,
    run,
    segments,
    tokens_per_example,
)

SRC = examples()


def _every_example(seen, src=SRC, epochs=1):
    got, want = tokens_per_example(seen), lengths(src)
    bad = {i: (got.get(i, 0), epochs * n) for i, n in want.items() if got.get(i, 0) != epochs * n}
    assert not bad, bad  # (tokens packed, tokens of the example x epochs)


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(hosts=st.sampled_from([1, 2, 3, 4, 8]), then=st.sampled_from([1, 2, 3, 4, 8]),
       last=st.integers(1, 5), first_steps=st.integers(0, 12), then_steps=st.integers(0, 12),
       epochs=st.integers(1, 2))
def test_any_host_count_restores_any_other_with_every_example_once(
        hosts, then, last, first_steps, then_steps, epochs):
    a, s1, _ = run(SRC, hosts, steps=first_steps, epochs=epochs)
    b, s2, _ = run(SRC, then, steps=then_steps, state={"hosts": s1}, epochs=epochs)
    c, _, _ = run(SRC, last, steps=None, state={"hosts": s2}, epochs=epochs)
    _every_example(a + b + c, epochs=epochs)


def test_the_same_layout_restores_exactly_from_its_own_or_every_hosts_state():
    a, states, _ = run(SRC, 3, steps=4)
    rest, _, steps = run(SRC, 3, steps=None, state={"hosts": states})
    whole, _, all_steps = run(SRC, 3, steps=None)
    assert steps == all_steps[4:]  # bit for bit what the uninterrupted run made
    its = [iter(pipeline(SRC, h, 3)) for h in range(3)]
    for it, s in zip(its, states):
        it.set_state(s)  # each host its own state
    assert [segments(next(it)) for it in its] == steps[0]
    _every_example(a + rest)


def test_one_hosts_state_on_another_host_count_names_the_fix():
    _, states, _ = run(SRC, 2, steps=3)
    it = iter(pipeline(SRC, 0, 4))
    with pytest.raises(ValueError, match=r"saved by host 0 of 2 and is restored as host 0 of "
                                         r"4.*pass every host's state.*read_host_states"):
        it.set_state(states[0])
    with pytest.raises(ValueError, match=r"saved by host 1 of 2 and is restored as host 0"):
        iter(pipeline(SRC, 0, 2)).set_state(states[1])


def test_missing_repeated_or_mismatched_host_states_are_named():
    _, states, _ = run(SRC, 3, steps=3)
    it = iter(pipeline(SRC, 0, 2))
    with pytest.raises(ValueError, match=r"missing \[1\], repeated \[0\]"):
        it.set_state({"hosts": [states[0], states[0], states[2]]})
    later, _, _ = run(SRC, 3, steps=4)
    _, later_states, _ = run(SRC, 3, steps=4)
    with pytest.raises(ValueError, match="different steps"):
        it.set_state({"hosts": [states[0], later_states[1], states[2]]})
    _, other, _ = run(examples(200), 3, steps=3)
    with pytest.raises(InputError, match=r"host state 1 was saved by another run: its examples "
                                         r"is 200, this pipeline's 240"):
        it.set_state({"hosts": [states[0], other[1], states[2]]})
    with pytest.raises(InputError, match="not a state of online packing"):
        it.set_state({"hosts": [{"position": 3}]})
    with pytest.raises(InputError, match="earlier version of seqpack"):
        it.set_state({"shard_index": 0, "shard_count": 2, "packing": {}})


def test_a_restore_fetches_what_was_in_flight_and_replays_nothing():
    """The reads a restore makes (examples in flight, then the first window) do not grow with
    the steps taken before the save."""
    reads = []
    for steps in (3, 30):
        _, states, _ = run(SRC, 2, steps=steps, epochs=None)
        counting = _Counting(SRC)
        its = [iter(pipeline(counting, h, 3, epochs=None)) for h in range(3)]
        for it in its:
            it.set_state({"hosts": states})
        flight = sum(len(elastic.decode_refs(s["pipeline"]["refs"])[0]) for s in states)
        reads.append(counting.reads)
        assert counting.reads <= flight + 3 * 2 * WINDOW.window, (counting.reads, flight)
    assert reads[1] <= 2 * reads[0] + 3 * WINDOW.window, reads


class _Counting:
    def __init__(self, src):
        self.src, self.reads = src, 0

    def __len__(self):
        return len(self.src)

    def __getitem__(self, i):
        self.reads += 1
        return self.src[i]


def test_packing_quality_through_changes_matches_an_unchanged_run():
    src = examples(2000, high=60, seed=1)
    pack, window = PackConfig(128, max_segments=16, overflow="split"), Window(64)
    kw = dict(pack=pack, window=window, batch=4)
    rows = lambda b: [int((b["tokens_segment_lengths"] > 0).any(1).sum())]  # noqa: E731
    whole, _, _ = run(src, 2, steps=None, collect=rows, **kw)
    a, s1, _ = run(src, 2, steps=20, collect=rows, **kw)
    b, s2, _ = run(src, 3, steps=15, state={"hosts": s1}, collect=rows, **kw)
    c, _, _ = run(src, 1, steps=None, state={"hosts": s2}, collect=rows, **kw)
    tokens = sum(lengths(src).values())
    bound = -(-tokens // 128)
    changed = sum(a + b + c)
    assert sum(whole) <= bound * 1.01
    assert abs(changed - sum(whole)) <= max(2, 0.005 * sum(whole)), (changed, sum(whole), bound)


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [((2, 2), (3, 0)), ((3, 0), (2, 2)),
                                          ((1, 2), (4, 3))])
def test_worker_processes_before_and_after(before, after):
    (H, W), (H2, W2) = before, after
    a, states, _ = run(SRC, H, steps=5, workers=W)
    b, _, _ = run(SRC, H2, steps=None, workers=W2, state={"hosts": states})
    _every_example(a + b)


@pytest.mark.slow
def test_another_worker_count_on_the_same_hosts_needs_only_each_hosts_own_state():
    a, states, _ = run(SRC, 2, steps=5, workers=2)
    its = [iter(pipeline(SRC, h, 2, workers=3)) for h in range(2)]
    seen = []
    for it, s in zip(its, states):
        it.set_state(s)  # its own state: its examples stay on the host
        seen += [x for batch in it for x in segments(batch)]
        it.close()
    _every_example(a + seen)


def test_read_host_states_reads_graines_files_and_names_what_is_missing(tmp_path):
    grain_checkpoint = pytest.importorskip("grain.checkpoint")
    _, states, _ = run(SRC, 3, steps=3)
    for i, s in enumerate(states):
        (tmp_path / f"process_{i}-of-3.json").write_text(json.dumps(s))
    got = elastic.read_host_states(tmp_path)
    assert got == {"hosts": states}
    b, _, _ = run(SRC, 2, steps=None, state=got)
    (tmp_path / "process_1-of-3.json").unlink()
    with pytest.raises(InputError, match=r"processes \[1\] of 3 are missing"):
        elastic.read_host_states(tmp_path)
    (tmp_path / "process_1-of-3.json").write_text("{not json")
    with pytest.raises(InputError, match=r"process_1-of-3.json: not valid JSON"):
        elastic.read_host_states(tmp_path)
    with pytest.raises(InputError, match="holds no process_"):
        elastic.read_host_states(tmp_path / "nothing")
    # Grain's own handler restores a host whose file is there; ours reads all where it is not
    import etils.epath

    (tmp_path / "process_1-of-3.json").write_text(json.dumps(states[1]))
    it = iter(pipeline(SRC, 0, 1))
    elastic.ElasticCheckpointHandler().restore(etils.epath.Path(tmp_path), item=it)
    c = [x for batch in it for x in segments(batch)]
    a, _, _ = run(SRC, 3, steps=3)
    _every_example(a + c)
    assert isinstance(elastic.ElasticCheckpointHandler(), grain_checkpoint.CheckpointHandler)


@pytest.mark.parametrize("then", [2, 3])
def test_a_restore_over_other_data_of_as_many_examples_is_refused(then):
    """The examples in flight are fetched again: one now shorter than the tokens the state
    holds of it names the data as changed (before: a reshape error inside the packer, or
    segments cut at the old places, without a word)."""
    _, states, _ = run(SRC, 2, steps=3)
    short = examples(len(SRC), high=3, seed=1)  # as many examples, other (shorter) contents
    with pytest.raises(InputError, match="the data is not the data the state was saved over"):
        run(short, then, steps=1, state={"hosts": states})


@pytest.mark.parametrize("then", [2, 3])
def test_a_restore_over_examples_that_grew_is_refused(then):
    """An example in flight that grew since the save (its pieces still fit it) is named too:
    before, its pieces were read as recorded and the tokens past them never packed, silently.
    The same layout restores each host's state (refs), another layout the merged flight."""
    _, states, _ = run(SRC, 2, steps=3)
    grown = examples(len(SRC), grow=3)  # the same examples, each 3 tokens longer
    with pytest.raises(InputError, match=r"example \d+ of the source holds (\d+) tokens, but "
                                         r"held \d+ when the state was saved.*the data is not "):
        run(grown, then, steps=1, state={"hosts": states})
    again, _, _ = run(SRC, then, steps=None, state={"hosts": states})  # the data saved over
    assert again
