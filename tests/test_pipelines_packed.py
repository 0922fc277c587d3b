"""make_training_pipeline over packed rows (a `seqpack pack` output): no second packing, a global
shuffle per epoch dealt to hosts, every column in the batch, shape from the manifest, exact
resume; balanced datasets read by whole steps, each host its ranks' rows."""

from __future__ import annotations

import json

import numpy as np
import pytest

from seqpack import packer
from seqpack.packer import PackConfig
from seqpack.pipelines.datasets import (
    Balance,
    Batching,
    Columns,
    PackedArrayRecordSource,
    Prefetch,
    make_training_pipeline,
)
from seqpack.pipelines.formats.manifest import MANIFEST, signed
from tests.helpers.packed_rows import B, D, L, S, balanced_dir, packed_dir, row_ids
from tests.helpers.pipelines import check_restore_every_step

pytest.importorskip("array_record.python.array_record_module")
_packed_dir, _row_id = packed_dir, row_ids


def _kw(*, batch_size=2, shard_index=0, shard_count=1, drop_remainder=True, **over):
    """The options of these tests: `batch` from its fields, the rest as given."""
    batch = Batching(batch_size, drop_remainder=drop_remainder, shard_index=shard_index,
                     shard_count=shard_count)
    return {**dict(batch=batch, shuffle_seed=5, num_epochs=1,
                   columns=Columns(labels=["labels"])), **over}


def test_rows_are_shuffled_per_epoch_and_dealt_to_hosts(tmp_path):
    stored = _packed_dir(tmp_path)
    src, ids, N, H, b = PackedArrayRecordSource(tmp_path), _row_id(stored), len(stored), 3, 2
    order = [i for batch in make_training_pipeline(src, **_kw(num_epochs=2, batch_size=1,
                                                              drop_remainder=False))
             for i in ids(batch)]  # the global order: one host
    first, second = order[:N], order[N:]
    assert sorted(first) == sorted(second) == list(range(N))  # each row once per epoch
    assert first != second and first != sorted(first)  # shuffled, and reshuffled
    per_host = [[ids(batch) for batch in make_training_pipeline(
        src, **_kw(num_epochs=2, batch_size=b, shard_index=h, shard_count=H,
                   drop_remainder=False))] for h in range(H)]
    whole = 2 * N // (H * b)  # global steps of H x b rows: host h has block h of each
    for h, batches in enumerate(per_host):
        for k in range(whole):
            assert batches[k] == order[k * H * b + h * b:][:b]
        assert sum(batches[whole:], []) == order[whole * H * b + h::H]  # the tail, in turn


def test_every_column_reaches_the_batch_with_loss_tokens(tmp_path):
    stored = _packed_dir(tmp_path)
    src = PackedArrayRecordSource(tmp_path)
    assert src.columns == ["labels"] and src.seq_len == L and src.max_segments == S
    ids = _row_id(stored)
    batches = list(make_training_pipeline(src, **_kw(drop_remainder=False)))
    assert set(batches[0]) == set(stored[0]) | {"loss_tokens"}
    for b in batches:
        packer.validate({k: v for k, v in b.items() if k not in ("labels", "loss_tokens")},
                        packer.PackConfig(L, max_segments=S))
        for r, i in enumerate(ids(b)):
            for k, v in stored[i].items():
                np.testing.assert_array_equal(b[k][r], v, err_msg=k)
        seg, lab = b["tokens_segment_ids"], b["labels"]
        want = ((seg[:, :-1] > 0) & (seg[:, 1:] == seg[:, :-1]) & (lab[:, 1:] != -100)).sum(1)
        np.testing.assert_array_equal(b["loss_tokens"], want)
    assert sorted(i for b in batches for i in ids(b)) == list(range(len(stored)))


def test_shape_and_columns_are_checked_against_the_manifest(tmp_path):
    _packed_dir(tmp_path)
    src = PackedArrayRecordSource(tmp_path)
    with pytest.raises(ValueError, match="seq_len=64 but the packed rows have seq_len=32"):
        make_training_pipeline(src, pack=PackConfig(64, max_segments=S), **_kw())
    with pytest.raises(ValueError, match="max_segments=64 but the packed rows have "
                                         "max_segments=8"):
        make_training_pipeline(src, pack=PackConfig(L, max_segments=64), **_kw())
    with pytest.raises(ValueError, match="column 'labels': pad=0 given but the packed rows' "
                                         "manifest says pad=-100"):
        make_training_pipeline(src, **_kw(columns=Columns(labels={"labels": 0})))
    with pytest.raises(ValueError, match="column 'mask' is not in the packed rows"):
        make_training_pipeline(src, **_kw(columns=Columns(labels=["labels"], masks=["mask"])))
    with pytest.raises(ValueError, match="the packed rows hold the column 'labels' \\(pad -100\\); "
                                         "say what it means for loss_tokens"):
        make_training_pipeline(src, **_kw(columns=Columns()))
    # A manifest column with a role counts for the loss without being named.
    path = tmp_path / MANIFEST
    obj = json.loads(path.read_text())
    obj["columns"][0]["role"] = "labels"
    path.write_text(json.dumps(signed(obj)))
    b = next(iter(make_training_pipeline(PackedArrayRecordSource(tmp_path),
                                         **_kw(columns=Columns()))))
    no_labels = next(iter(make_training_pipeline(src, **_kw(columns=Columns(meta=["labels"])))))
    assert (b["loss_tokens"] < no_labels["loss_tokens"]).any()
    assert (b["loss_tokens"] <= no_labels["loss_tokens"]).all()


def test_resume_at_every_step(tmp_path):
    _packed_dir(tmp_path)
    src = PackedArrayRecordSource(tmp_path)
    make = lambda: iter(make_training_pipeline(src, **_kw(num_epochs=2, shard_index=1,
                                                          shard_count=2)))
    check_restore_every_step(make, max_rows=12)


_balanced = balanced_dir


@pytest.mark.parametrize("hosts", [1, 2, 4])
def test_balanced_rows_reach_their_ranks_by_whole_steps(tmp_path, hosts):
    stored, src = _balanced(tmp_path)
    ids, steps, n = _row_id(stored), len(stored) // (D * B), D // hosts
    seen = []  # per host: the step of each batch
    for h in range(hosts):
        epoch_steps = []
        for batch in make_training_pipeline(src, **_kw(batch_size=n * B, num_epochs=2,
                                                       shard_index=h, shard_count=hosts)):
            got = ids(batch)
            s = got[0] // (D * B)  # host h's batch of step s: its ranks' rows, in rank order
            assert got == list(range((s * D + h * n) * B, (s * D + (h + 1) * n) * B))
            epoch_steps.append(s)
        seen.append(epoch_steps)
    assert all(s == seen[0] for s in seen)  # every host the same step order
    first, second = seen[0][:steps], seen[0][steps:]
    assert sorted(first) == sorted(second) == list(range(steps))  # whole steps; tail unread
    assert first != second


@pytest.mark.parametrize("balanced", [False, True])
def test_rows_read_by_threads_make_the_same_batches(tmp_path, balanced):
    """`Prefetch(read_threads=)`: a batch's rows read at once by a pool give the batches one at
    a time gives, in the same order; a plain copy's source asks for no threads."""
    if balanced:
        _, src = _balanced(tmp_path)
        kw = _kw(batch_size=4, shard_index=1, shard_count=2, num_epochs=2)
    else:
        _packed_dir(tmp_path)
        src = PackedArrayRecordSource(tmp_path)
        kw = _kw(batch_size=3, num_epochs=2, drop_remainder=False)
    assert src.read_threads == 0
    runs = [list(make_training_pipeline(src, **kw, prefetch=Prefetch(read_threads=t)))
            for t in (0, 4)]
    assert len(runs[0]) == len(runs[1]) > 2
    for a, b in zip(*runs):
        assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="read_threads=-1 must be an int >= 0"):
        Prefetch(read_threads=-1)


def test_balanced_layout_arithmetic_is_checked(tmp_path):
    stored, src = _balanced(tmp_path)
    with pytest.raises(ValueError, match="shard_count=3 hosts must divide 4"):
        make_training_pipeline(src, **_kw(batch_size=2, shard_count=3))
    with pytest.raises(ValueError, match="batch_size=2 is the rows per host per step: each of "
                                         "shard_count=2 hosts reads its 2 ranks' 2 rows, so "
                                         "pass batch_size=4"):
        make_training_pipeline(src, **_kw(batch_size=2, shard_count=2))
    with pytest.raises(ValueError, match="drop_remainder=False"):
        make_training_pipeline(src, **_kw(batch_size=8, drop_remainder=False))
    with pytest.raises(ValueError, match="1 processes x 1 local devices = 1 ranks"):
        make_training_pipeline(src, batch=8, shuffle_seed=0, num_epochs=1)  # jax: 1 CPU
    rows = list(make_training_pipeline(src, **_kw(batch_size=1, balance=Balance(steps=False))))
    assert len(rows) == len(stored)  # read as plain rows: all of them


def test_balanced_resume_at_every_step(tmp_path):
    _, src = _balanced(tmp_path)
    make = lambda: iter(make_training_pipeline(src, **_kw(batch_size=4, num_epochs=None,
                                                          shard_index=1, shard_count=2)))
    check_restore_every_step(make, max_rows=10)


@pytest.mark.slow
@pytest.mark.parametrize("balanced", [False, True])
def test_worker_processes_read_every_row_once_and_resume(tmp_path, balanced):
    if balanced:
        stored, src = _balanced(tmp_path)
        kw = _kw(batch_size=4, shard_index=1, shard_count=2,
                 prefetch=Prefetch(worker_count=2))
    else:
        stored = _packed_dir(tmp_path)
        src = PackedArrayRecordSource(tmp_path)
        kw = _kw(prefetch=Prefetch(worker_count=2), drop_remainder=False)
    ids = _row_id(stored)
    it = iter(make_training_pipeline(src, **kw))
    batches, states = [], [it.get_state()]
    for b in it:
        batches.append(b)
        states.append(json.loads(json.dumps(it.get_state())))
    it.close()
    got = sorted(i for b in batches for i in ids(b))
    if balanced:  # host 1 of 2: ranks 2 and 3 of every whole step
        steps = len(stored) // (D * B)
        assert got == sorted(i for s in range(steps) for i in range((s * D + 2) * B,
                                                                       (s * D + 4) * B))
    else:
        assert got == list(range(len(stored)))
    for step in (1, len(batches) // 2):
        restored = iter(make_training_pipeline(src, **kw))
        restored.set_state(states[step])
        assert ids(next(restored)) == ids(batches[step])
        restored.close()
    alone = iter(make_training_pipeline(src, **{**kw, "prefetch": Prefetch(worker_count=0)}))
    alone.set_state(states[len(batches) // 2])  # saved with 2 workers, restored without
    assert ids(next(alone)) == ids(batches[len(batches) // 2])


def test_a_partial_global_step_is_dropped_on_every_host(tmp_path, caplog):
    stored = _packed_dir(tmp_path)
    src, H, b = PackedArrayRecordSource(tmp_path), 3, 4
    assert len(stored) % (H * b)  # a partial last step
    counts = [sum(1 for _ in make_training_pipeline(src, **_kw(batch_size=b, shard_index=h,
                                                               shard_count=H)))
              for h in range(H)]
    assert counts == [len(stored) // (H * b)] * H  # the same steps on every host
    assert f"the last {len(stored) % (H * b)} packed rows (a partial global step" in caplog.text


def test_a_balanced_state_restores_only_into_its_run(tmp_path):
    from seqpack.pipelines.errors import InputError

    _, src = _balanced(tmp_path)
    kw = _kw(batch_size=4, shard_index=1, shard_count=2)
    it = iter(make_training_pipeline(src, **kw))
    next(it)
    state = it.get_state()
    with pytest.raises(InputError, match="its seed is 5, this pipeline's 6"):
        iter(make_training_pipeline(src, **{**kw, "shuffle_seed": 6})).set_state(state)
    with pytest.raises(InputError, match="not a state of balanced steps"):
        iter(make_training_pipeline(src, **kw)).set_state({"position": 0, "steps": 0})


def test_a_state_restores_only_into_the_rows_seed_and_epochs_it_was_saved_over(tmp_path):
    from seqpack.pipelines.errors import InputError

    _packed_dir(tmp_path)
    src = PackedArrayRecordSource(tmp_path)
    it = iter(make_training_pipeline(src, **_kw()))
    next(it)
    state = it.get_state()
    for other, named in ((dict(shuffle_seed=6), "seed"), (dict(num_epochs=2), "num_epochs")):
        again = iter(make_training_pipeline(src, **_kw(**other)))
        with pytest.raises(InputError, match=f"its {named} is"):
            again.set_state(state)
    legacy = {k: v for k, v in state.items() if k != "run"}  # saved before the stamp
    again = iter(make_training_pipeline(src, **_kw()))
    again.set_state(legacy)
    assert np.array_equal(next(again)["tokens"], next(it)["tokens"])
    with pytest.raises(InputError, match="online packing: restore it into a pipeline over"):
        iter(make_training_pipeline(src, **_kw())).set_state({"online": 1, "run": {}})
    workers = {"workers_state": {"0": state, "1": state}}  # Grain's form: each worker's state
    again = iter(make_training_pipeline(src, **_kw()))
    again.set_state(workers)  # every worker's stamp checked, restored without workers
