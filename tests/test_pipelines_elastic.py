"""Elastic resume: a state saved on N hosts restores on M != N hosts.

Packed rows: the state names the global position, so any one host's state restores every host
of the new run, with no row of the epochs repeated or lost (plain rows and balanced steps).
Online packing restores from every host's state (tests/test_pipelines_elastic_online.py).
Hosts are simulated with Batching(shard_index, shard_count); tests/test_multihost.py runs
real JAX processes.
"""

from __future__ import annotations

import collections
import json

import grain
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.pipelines.datasets import (
    Batching,
    Columns,
    PackedArrayRecordSource,
    Prefetch,
    make_training_pipeline,
)
from seqpack.pipelines.datasets.packed import GlobalRowBatches
from tests.helpers.packed_rows import B, D, balanced_dir, packed_dir, row_ids

pytest.importorskip("array_record.python.array_record_module")
EPOCHS = 2


def _pipeline(src, *, hosts: int, host: int, batch_size: int, drop_remainder: bool = False,
              workers: int = 0):
    return make_training_pipeline(
        src, batch=Batching(batch_size, drop_remainder=drop_remainder, shard_index=host,
                            shard_count=hosts),
        shuffle_seed=3, num_epochs=EPOCHS, columns=Columns(labels=["labels"]),
        prefetch=Prefetch(worker_count=workers))


def _run(src, ids, *, hosts: int, batch_size: int, steps: int | None, state=None, **kw):
    """Every host's rows for `steps` synchronous steps (None: to the end), from `state`; the
    state of host hosts - 1 after them (json round trip, as a checkpoint stores it)."""
    its = [iter(_pipeline(src, hosts=hosts, host=h, batch_size=batch_size, **kw))
           for h in range(hosts)]
    if state is not None:
        for it in its:
            it.set_state(state)
    seen, k = [], 0
    while steps is None or k < steps:
        batches = [next(it, None) for it in its]
        if all(b is None for b in batches):
            break
        seen += [i for b in batches if b is not None for i in ids(b)]
        k += 1
    saved = json.loads(json.dumps(its[-1].get_state()))
    for it in its:
        it.close()
    return seen, saved


@pytest.mark.parametrize("before,after", [(4, 2), (2, 4), (3, 2)])
@pytest.mark.parametrize("batch_size", [2, 3])
def test_packed_rows_resume_on_another_host_count(tmp_path, before, after, batch_size):
    stored = packed_dir(tmp_path)
    src, ids = PackedArrayRecordSource(tmp_path), row_ids(stored)
    first, state = _run(src, ids, hosts=before, batch_size=batch_size, steps=5)
    rest, _ = _run(src, ids, hosts=after, batch_size=batch_size + 1, steps=None, state=state)
    counts = collections.Counter(first + rest)
    assert len(first) == 5 * before * batch_size
    assert sorted(counts) == list(range(len(stored)))  # nothing lost
    assert set(counts.values()) == {EPOCHS}  # nothing repeated: each row once per epoch
    # the new run reads on from where the old one stopped, in the same global order
    whole, _ = _run(src, ids, hosts=1, batch_size=1, steps=None)
    assert sorted(first) == sorted(whole[: len(first)])
    assert sorted(rest) == sorted(whole[len(first):])


@pytest.mark.slow
def test_a_state_saved_with_worker_processes_restores_on_another_host_count(tmp_path):
    """Saved by 2 hosts of 2 worker processes, restored on 3 hosts without: every row once per
    epoch; restored with another worker count: a ValueError saying what restores it."""
    stored = packed_dir(tmp_path)
    src, ids = PackedArrayRecordSource(tmp_path), row_ids(stored)
    first, state = _run(src, ids, hosts=2, batch_size=2, steps=5, workers=2)
    rest, _ = _run(src, ids, hosts=3, batch_size=2, steps=None, state=state)
    counts = collections.Counter(first + rest)
    assert sorted(counts) == list(range(len(stored))) and set(counts.values()) == {EPOCHS}
    with pytest.raises(ValueError, match=r"saved with 2 worker process\(es\) cannot restore 1"):
        _run(src, ids, hosts=2, batch_size=2, steps=1, state=state, workers=1)


def test_any_hosts_state_is_enough(tmp_path):
    stored = packed_dir(tmp_path)
    src = PackedArrayRecordSource(tmp_path)
    its = [iter(_pipeline(src, hosts=3, host=h, batch_size=2)) for h in range(3)]
    for _ in range(4):
        for it in its:
            next(it)
    states = [it.get_state() for it in its]
    assert len({s["position"] for s in states}) == 1 and states[0]["position"] == 4 * 3 * 2
    del stored


@pytest.mark.parametrize("before,after", [(4, 2), (2, 4), (4, 1)])
def test_balanced_steps_resume_on_another_host_count(tmp_path, before, after):
    """Whole steps of D ranks: host h of H reads its D / H ranks' rows of each step; the state
    counts global steps, so another H deals the same steps again to its hosts."""
    stored, src = balanced_dir(tmp_path)
    ids, steps = row_ids(stored), len(stored) // (D * B)

    def run(hosts, k, state=None):
        return _run(src, ids, hosts=hosts, batch_size=D // hosts * B, steps=k, state=state,
                    drop_remainder=True)

    first, state = run(before, 3)
    rest, _ = run(after, None, state)
    counts = collections.Counter(first + rest)
    assert sorted(counts) == list(range(steps * D * B))  # every whole step's rows; tail unread
    assert set(counts.values()) == {EPOCHS}
    step_of = lambda seq: [seq[i] // (D * B) for i in range(0, len(seq), D * B)]
    whole, _ = run(1, None)
    assert step_of(first + rest) == step_of(whole)  # the same global order of steps


@settings(max_examples=60, deadline=None)
@given(total=st.integers(1, 80), hosts=st.integers(1, 5), batch=st.integers(1, 4),
       new_hosts=st.integers(1, 5), new_batch=st.integers(1, 4), steps=st.integers(0, 12),
       drop=st.booleans())
def test_any_layout_restores_any_other_with_every_row_once(total, hosts, batch, new_hosts,
                                                           new_batch, steps, drop):
    """Global positions, directly: rows 0..total-1 in the global order; `steps` synchronous
    steps on one layout, the rest on another from host 0's state. Every row is read once,
    except (drop_remainder) the rows of each layout's partial last step."""
    rows = grain.MapDataset.range(total).map(lambda i: {"i": np.int64(i)})

    def layout(H, b):
        return [iter(GlobalRowBatches(rows, batch_size=b, shard_index=h, shard_count=H,
                                      drop_remainder=drop)) for h in range(H)]

    seen, before = [], layout(hosts, batch)
    for _ in range(steps):
        got = [next(it, None) for it in before]
        seen += [i for b in got if b is not None for i in b["i"].tolist()]
    state = before[0].get_state()
    for it in layout(new_hosts, new_batch):
        it.set_state(state)
        seen += [i for b in it for i in b["i"].tolist()]
    counts = collections.Counter(seen)
    assert set(counts.values()) <= {1}  # nothing twice
    read = state["position"]
    new_step = new_hosts * new_batch
    end = read + (total - read) // new_step * new_step if drop else total
    assert sorted(counts) == list(range(end))  # nothing lost but a dropped partial step
