"""The rows' output order offline: one ordering stage (`packer.order`) under both runners.

`seqpack pack` writes a seeded permutation of the plan's rows by default (`--row-order plan`
keeps the planner's, longest examples first), or balanced data-parallel steps
(`--data-parallel D --batch-size b`). Checked here: the rows are the plan's rows, only moved;
the default order's composition does not drift along the output while the plan's does; the
bytes are the same for any worker count and for the Beam steps; balanced steps are even under
the model; the manifest records the order; the training pipeline reads a balanced output with
each rank's rows.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.packer import PackConfig
from seqpack.packer.order import CostModel, RowOrder
from seqpack.pipelines.offline import PackJob, WriteOptions
from seqpack.pipelines.offline.runners import pack_to_dir
from seqpack.pipelines.offline.shards import read_shard
from seqpack.pipelines.offline.verify import verify
from tests.helpers.files import dir_bytes, write_jsonl

CONFIG = PackConfig(64, max_segments=16, overflow="split")


def _corpus(tmp_path, n=900, seed=0) -> list[str]:
    """Wide length spread: mostly short turns, some long documents (split past 64)."""
    rng = np.random.default_rng(seed)
    lengths = np.where(rng.random(n) < 0.15, rng.integers(40, 150, n), rng.integers(1, 12, n))
    seqs = [rng.integers(0, 300, m).tolist() for m in lengths]
    half = n // 2
    return [write_jsonl(tmp_path / "a.jsonl", seqs[:half]),
            write_jsonl(tmp_path / "b.jsonl", seqs[half:])]


def _job(paths, out, order: RowOrder, **kw) -> PackJob:
    return PackJob(paths, out, CONFIG, write_options=WriteOptions(shard_rows=16), order=order,
                   **kw)


def _rows(out) -> dict[str, np.ndarray]:
    manifest = json.loads((out / "manifest.json").read_text())
    parts = [read_shard(str(out), n, k, restore=False)
             for n, k in zip(manifest["shards"], manifest["shard_num_rows"])]
    return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}


def _row_keys(rows) -> list[bytes]:
    """Each row's bytes (tokens + metadata): what identifies a row whatever its position."""
    keys = ["tokens", "tokens_segment_lengths", "segment_source_index", "segment_source_start"]
    return [b"".join(rows[k][r].tobytes() for k in keys) for r in range(rows["tokens"].shape[0])]


def _segments(rows) -> np.ndarray:
    return (rows["tokens_segment_lengths"] > 0).sum(1)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    d = tmp_path_factory.mktemp("order")
    paths = _corpus(d)
    plan = pack_to_dir(_job(paths, d / "plan", RowOrder("plan"), workers=1))
    return d, paths, plan, _rows(d / "plan")


def test_the_default_order_is_a_flat_permutation_of_the_plans_rows(packed):
    d, paths, plan, plan_rows = packed
    manifest = pack_to_dir(PackJob(paths, d / "default", CONFIG, workers=1,
                                   write_options=WriteOptions(shard_rows=16)))
    rows = _rows(d / "default")
    assert sorted(_row_keys(rows)) == sorted(_row_keys(plan_rows))  # moved, nothing else
    assert _row_keys(rows) != _row_keys(plan_rows)
    assert manifest.row_order == RowOrder().to_dict() and manifest.row_order["seed"] == 0
    index = np.arange(rows["tokens"].shape[0])
    # Before: the planner's order, longest examples first, many-segment rows last.
    assert np.corrcoef(index, _segments(plan_rows))[0, 1] > 0.5
    assert abs(np.corrcoef(index, _segments(rows))[0, 1]) < 0.1
    tenths = manifest.stats["along_output"]["segments_per_row"]
    planned = plan.stats["along_output"]["segments_per_row"]
    assert max(tenths) - min(tenths) < 0.3 * (max(planned) - min(planned))
    assert manifest.stats["num_rows"] == plan.stats["num_rows"]
    assert verify(str(d / "default")).ok


@settings(max_examples=4, deadline=None)
@given(mode=st.sampled_from(["shuffle", "plan", "balanced"]), seed=st.integers(0, 2**31),
       workers=st.sampled_from([1, 2]))
def test_any_order_any_workers_the_same_rows_and_bytes(packed, tmp_path_factory, mode, seed,
                                                      workers):
    d, paths, _, plan_rows = packed
    out = tmp_path_factory.mktemp("any")
    order = RowOrder(mode, seed=seed, **({"data_parallel": 4, "batch_size": 2}
                                         if mode == "balanced" else {}))
    pack_to_dir(_job(paths, out / "one", order, workers=1))
    pack_to_dir(_job(paths, out / "many", order, workers=workers))
    assert dir_bytes(out / "one") == dir_bytes(out / "many")
    assert sorted(_row_keys(_rows(out / "one"))) == sorted(_row_keys(plan_rows))


def test_the_beam_steps_put_rows_in_the_same_order(packed, tmp_path):
    from seqpack.pipelines.offline import steps as beam_steps

    d, paths, _, _ = packed
    for order in (RowOrder(seed=5), RowOrder("balanced", seed=2, data_parallel=3, batch_size=2)):
        job = _job(paths, tmp_path / f"steps-{order.mode}", order, block_size=200)
        scans = [beam_steps.scan_file(i, p, job.read_options) for i, p in enumerate(paths)]
        summary, jobs = beam_steps.plan_in_process(scans, job)
        assert summary is not None
        by_shard: dict[int, list] = {}
        for file_job in jobs:
            for shard, part in beam_steps.route_file(file_job, job.read_options,
                                                     summary.shard_rows, summary.row_dtype):
                by_shard.setdefault(shard, []).append(part)
        rows = [(k, *beam_steps.write_shard_parts(k, parts, summary, job.output, CONFIG,
                                                   write_options=job.write_options))
                for k, parts in by_shard.items()]
        beam_steps.finish_job(rows[::-1], summary, job.output)
        local = tmp_path / f"local-{order.mode}"
        pack_to_dir(_job(paths, local, order, block_size=200, workers=1))
        assert dir_bytes(tmp_path / f"steps-{order.mode}") == dir_bytes(local), order.mode


def _step_max_over_mean(rows, D: int, b: int, cost: CostModel) -> np.ndarray:
    lengths = rows["tokens_segment_lengths"].astype(np.int64)
    row_cost = cost.segment_costs(lengths.reshape(-1)).reshape(lengths.shape).sum(1)
    steps = row_cost.size // (D * b)
    rank = row_cost[: steps * D * b].reshape(steps, D, b).sum(2)
    return rank.max(1) / rank.mean(1)


def test_balanced_steps_are_even_and_in_a_seeded_order(packed, tmp_path):
    d, paths, _, plan_rows = packed
    cost = CostModel(d_model=16)  # a small model: attention matters at L=64
    D, b = 4, 2
    order = RowOrder("balanced", seed=1, data_parallel=D, batch_size=b, cost=cost)
    manifest = pack_to_dir(_job(paths, tmp_path / "bal", order, workers=1))
    rows = _rows(tmp_path / "bal")
    assert manifest.row_order == order.to_dict()
    assert sorted(_row_keys(rows)) == sorted(_row_keys(plan_rows))
    balanced = _step_max_over_mean(rows, D, b, cost)
    pack_to_dir(_job(paths, tmp_path / "shuffled", RowOrder(seed=1, cost=cost), workers=1))
    shuffled = _step_max_over_mean(_rows(tmp_path / "shuffled"), D, b, cost)
    assert balanced.mean() <= 1.02 and balanced.mean() < shuffled.mean()
    # steps come in a seeded random order: no curriculum across them
    step_cost = cost.segment_costs(rows["tokens_segment_lengths"].reshape(-1)).reshape(
        -1, CONFIG.max_segments).sum(1)[: len(balanced) * D * b].reshape(len(balanced), -1).sum(1)
    assert abs(np.corrcoef(np.arange(step_cost.size), step_cost)[0, 1]) < 0.3
    again = tmp_path / "bal-seed-2"
    pack_to_dir(_job(paths, again, RowOrder("balanced", seed=2, data_parallel=D, batch_size=b,
                                            cost=cost), workers=1))
    assert _row_keys(_rows(again)) != _row_keys(rows)


def test_the_manifest_reports_the_steps_balance_of_the_rows_written(packed, tmp_path):
    """`step_balance`: per full step the ranks' max / mean cost, over the steps of every block
    and the global leftover steps, as the rows read back give it; against a random order of
    the same rows (worse). Outputs in other orders have none."""
    d, paths, _, _ = packed
    cost = CostModel(d_model=16)
    D, b = 4, 2
    order = RowOrder("balanced", seed=4, data_parallel=D, batch_size=b, cost=cost)
    got = pack_to_dir(_job(paths, tmp_path / "bal", order, block_size=200, workers=1))
    report = got.stats["step_balance"]
    ratios = _step_max_over_mean(_rows(tmp_path / "bal"), D, b, cost)
    assert report["steps"] == ratios.size > 10
    assert report["mean"] == pytest.approx(ratios.mean(), abs=2e-6)
    assert report["max"] == pytest.approx(ratios.max(), abs=2e-6)
    p99 = np.quantile(ratios, 0.99, method="inverted_cdf")
    assert p99 - 1e-6 <= report["p99"] <= p99 + 1e-3 + 1e-6
    assert report["random_order"]["mean"] > report["mean"]
    shuffled = pack_to_dir(_job(paths, tmp_path / "shuffled", RowOrder(seed=4, cost=cost),
                                workers=1))
    assert "step_balance" not in shuffled.stats


def test_the_training_pipeline_gives_each_rank_its_balanced_rows(packed, tmp_path):
    pytest.importorskip("grain")
    from seqpack.pipelines.datasets import (
        Batching,
        PackedArrayRecordSource,
        make_training_pipeline,
    )

    d, paths, _, _ = packed
    D, b = 4, 2
    order = RowOrder("balanced", seed=3, data_parallel=D, batch_size=b,
                     cost=CostModel(d_model=16))
    pack_to_dir(_job(paths, tmp_path / "bal", order, workers=1))
    rows = _rows(tmp_path / "bal")
    steps = rows["tokens"].shape[0] // (D * b)
    seen = []
    for host in range(2):  # 2 hosts x 2 local devices = D ranks, b rows each
        ds = make_training_pipeline(PackedArrayRecordSource(str(tmp_path / "bal")),
                                    batch=Batching(2 * b, shard_index=host, shard_count=2),
                                    shuffle_seed=0, num_epochs=1)
        batches = list(ds)
        assert len(batches) == steps
        seen.append([batch["tokens"] for batch in batches])
    by_step = {rows["tokens"][s * D * b : (s + 1) * D * b].tobytes(): s for s in range(steps)}
    for k in range(steps):  # host h of a step holds ranks 2h, 2h + 1 of one written step
        step = np.concatenate([seen[0][k], seen[1][k]])
        assert step.tobytes() in by_step


@pytest.mark.slow
def test_a_killed_balanced_run_resumes_to_the_same_bytes(tmp_path):
    import os
    import signal

    from tests.helpers.files import run_cli
    from tests.helpers.runs import finish, start, wait_for

    paths = _corpus(tmp_path)
    args = ["--seq-len", 64, "--max-segments", 16, "--overflow", "split", "--shard-rows", 8,
            "--data-parallel", 4, "--batch-size", 2, "--d-model", 16, "--workers", 2]
    assert run_cli("pack", *paths, "-o", tmp_path / "clean", *args).returncode == 0
    out = tmp_path / "out"
    run = start("pack", *paths, "-o", out, *args, env={"SEQPACK_TEST_SHARD_DELAY": "0.2"})
    wait_for(lambda: out.is_dir() and any(n.endswith(".done") for n in os.listdir(out)), run)
    os.killpg(run.pid, signal.SIGKILL)
    finish(run)
    result = run_cli("pack", *paths, "-o", out, *args, "--resume")
    assert result.returncode == 0, result.stderr
    assert dir_bytes(out) == dir_bytes(tmp_path / "clean")
