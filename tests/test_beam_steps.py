"""The Beam job's steps without Beam: in any arrival order, and with the steps that write files
run again as a runner retries a bundle, they rebuild the local runner's bytes."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from seqpack.packer import PackConfig
from seqpack.pipelines.errors import RunFailed
from seqpack.pipelines.formats import inputs
from seqpack.pipelines.formats.inputs import InputError, ReadOptions
from seqpack.pipelines.offline import PackJob, WriteOptions
from seqpack.pipelines.offline import steps as beam_steps
from seqpack.pipelines.offline.runners import pack_to_dir
from tests.helpers.files import ROOT, dir_bytes, random_seqs, write_jsonl, write_parquet

CONFIGS = {
    "bfd_split": (PackConfig(48, max_segments=6, overflow="split"), WriteOptions(shard_rows=4)),
    "first_fit_aligned_wide_pad": (
        PackConfig(48, max_segments=5, strategy="first_fit", overflow="truncate",
                   segment_alignment=4, pad_id=70_000),
        WriteOptions(shard_rows=3, compression="zstd")),
    "concat_split_store_derived": (
        PackConfig(40, max_segments=3, strategy="concat_split"),
        WriteOptions(shard_rows=5, store_derived=True)),
}


def _inputs(tmp_path) -> list[str]:
    """Four inputs: token ids of uint8 (.npz), int32 (JSONL, Parquet), one empty."""
    ids = np.frombuffer(b"token ids of one byte", np.uint8)
    np.savez(tmp_path / "t.npz", tokens=ids, offsets=np.array([0, 8, ids.size]))
    return [
        str(tmp_path / "t.npz"),
        write_jsonl(tmp_path / "a.jsonl", random_seqs(40, max_len=70, seed=1)),
        write_jsonl(tmp_path / "empty.jsonl", []),
        write_parquet(tmp_path / "b.parquet", random_seqs(55, max_len=70, seed=2, vocab=300)),
    ]


def _run_steps(paths, out, config, write_options, rng, block_size=None, retries=False,
               overwrite=False, after_plan=None, fault=None) -> dict:
    """The job's stages in this process, each stage's elements in a shuffled order.

    `retries`: the steps that write to the output run again, as a runner may run them (Beam
    retries a bundle whose outputs were lost, and may recompute any PCollection; only one
    attempt's outputs are kept): finish_plan twice before the shards, then again halfway
    through the shards and after the manifest (a side input recomputed for a later step), a
    third of the shards written twice (their parts in another order), finish_job twice.
    `after_plan`: called once the plan is finished (the inputs' stamps taken). `fault`: "drop"
    or "repeat" one part of a shard fed by several inputs, as a faulty runner would."""
    read = ReadOptions()
    job = PackJob(paths, out, config, write_options=write_options,
                  block_size=block_size or 1 << 22, existing="overwrite" if overwrite else "refuse")
    order = rng.permutation(len(paths))
    scans = [beam_steps.scan_file(int(i), paths[i], read) for i in order]
    files = [beam_steps.summarize_file(s, config) for s in scans]
    bs = job.block_size
    by_block: dict[int, list] = {}
    for s in scans:
        for block, piece in beam_steps.cut_blocks(s, files, bs):
            by_block.setdefault(block, []).append(piece)
    plans = [beam_steps.plan_block_slices(b, by_block[b][::-1], files, job)
             for b in rng.permutation(sorted(by_block)).tolist()]

    def finish_plan():
        return beam_steps.finish_plan(files, [p.summary for p in plans], job)

    for _ in range(1 + retries):
        summary = finish_plan()
    if after_plan is not None:
        after_plan()
    by_file: dict[int, list] = {}
    for p in plans:
        for index, table in beam_steps.split_block(p, summary, files):
            by_file.setdefault(index, []).append(table)
    jobs = [beam_steps.file_job(i, t[::-1], files) for i, t in by_file.items()]
    by_shard: dict[int, list] = {}
    budget = int(rng.choice([1, 300, beam_steps.ROUTE_BYTES]))  # bytes: parts sent as they grow
    for k in rng.permutation(len(jobs)):
        for shard, part in beam_steps.route_file(jobs[k], read, summary.shard_rows,
                                                 summary.row_dtype, plan_only=job.plan_only,
                                                 budget=budget):
            by_shard.setdefault(shard, []).append(part)
    if fault == "drop_inside":  # a part with no piece in its shard's first or last row
        edges = {k: (k * summary.shard_rows, min((k + 1) * summary.shard_rows,
                                                  summary.intent.num_rows) - 1) for k in by_shard}
        shard, part = next((k, i) for k in sorted(by_shard) for i, p in enumerate(by_shard[k])
                           if len(by_shard[k]) > 1 and not np.isin(p.pieces[3], edges[k]).any())
        del by_shard[shard][part]
    elif fault is not None:
        shard = next(k for k in sorted(by_shard) if len(by_shard[k]) > 1)
        by_shard[shard] = by_shard[shard][1:] if fault == "drop" else \
            [*by_shard[shard], by_shard[shard][-1]]
    rows = {}
    shards = rng.permutation(sorted(by_shard)).tolist()
    if retries:
        shards += rng.permutation(shards)[: len(shards) // 3 + 1].tolist()
    for i, shard in enumerate(shards):
        if retries and i == len(shards) // 2:
            again = finish_plan()  # recomputed: the shards written so far stay
            assert dataclasses.replace(again, order=None) == dataclasses.replace(
                summary, order=None)
            assert repr(again.order) == repr(summary.order)
        parts = [by_shard[shard][i] for i in rng.permutation(len(by_shard[shard]))]
        rows[shard] = (shard, *beam_steps.write_shard_parts(
            shard, parts, summary, str(out), config, write_options=write_options))
    for _ in range(1 + retries):
        manifest = beam_steps.finish_job(list(rows.values())[::-1], summary, str(out))
    if retries:
        assert finish_plan() is None  # the run is complete (re-hashed, kept)
    return manifest


def _check_steps(tmp_path, name, seed, block_size, *, retries=False, overwrite=False):
    config, write_options = CONFIGS[name]
    paths = _inputs(tmp_path)
    local = pack_to_dir(PackJob(paths, tmp_path / "local", config, write_options=write_options,
                                block_size=block_size or 1 << 22, workers=1))
    assert len(local.shards) >= 3  # several shards, so routing and merging are exercised
    if overwrite:  # another run's output, replaced
        pack_to_dir(PackJob(paths[1:], tmp_path / "steps", config, workers=1,
                            write_options=dataclasses.replace(write_options, shard_rows=2)))
    manifest = _run_steps(paths, tmp_path / "steps", config, write_options,
                          np.random.default_rng(seed), block_size, retries, overwrite)
    assert manifest == local
    assert dir_bytes(tmp_path / "steps") == dir_bytes(tmp_path / "local")


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed,block_size", [(0, None), (1, 17)])
def test_steps_in_any_order_give_the_local_bytes(tmp_path, name, seed, block_size):
    _check_steps(tmp_path, name, seed, block_size)


@pytest.mark.parametrize("name,seed,block_size,overwrite", [
    ("bfd_split", 2, 17, False), ("first_fit_aligned_wide_pad", 3, None, True)])
def test_steps_run_again_give_the_local_bytes(tmp_path, name, seed, block_size, overwrite):
    """As a runner may run them: the directory is prepared once, shards rewritten alike."""
    _check_steps(tmp_path, name, seed, block_size, retries=True, overwrite=overwrite)


@pytest.mark.parametrize("fault", ["drop", "repeat", "drop_inside"])
def test_a_part_lost_or_repeated_by_the_runner_stops_the_run_and_resume_repairs_it(
        tmp_path, fault):
    """A record a runner lost or repeated between the inputs and the shards stops the run
    before its manifest: the shard that misses its first or last row, or gets a piece twice,
    fails as it is written; one that misses pieces inside fails the last step, which keeps no
    shard. A resumed run then writes what it must again: the local runner's bytes."""
    config, write_options = CONFIGS["bfd_split"]
    paths = _inputs(tmp_path)
    local = pack_to_dir(PackJob(paths, tmp_path / "local", config, write_options=write_options,
                                workers=1))
    said = (r"the shards hold [\d,]+ segments of [\d,]+ tokens, the plan placed [\d,]+ of "
            r"[\d,]+: the runner lost or repeated records; no shard is kept"
            if fault == "drop_inside" else r"shard \d+ received pieces the plan did not send "
            r"it \(or not one of its first or last row\): the runner lost or repeated records")
    with pytest.raises(RunFailed, match=said):
        _run_steps(paths, tmp_path / "steps", config, write_options,
                   np.random.default_rng(6), fault=fault)
    assert not (tmp_path / "steps" / "manifest.json").exists()
    if fault == "drop_inside":
        assert not list((tmp_path / "steps").glob("*.done"))
    again = pack_to_dir(PackJob(paths, tmp_path / "steps", config, write_options=write_options,
                                workers=1, existing="resume"))
    assert again == local and dir_bytes(tmp_path / "steps") == dir_bytes(tmp_path / "local")


@pytest.mark.parametrize("seed,block_size", [(4, None), (5, 17)])
def test_an_index_is_written_from_the_plan_alone(tmp_path, seed, block_size):
    """Rows by reference with no extra columns: once the plan is made no input is read again
    (they are moved away), no token is routed, and the shards are the local runner's bytes."""
    config, write_options = PackConfig(48, max_segments=6, overflow="split"), WriteOptions(
        shard_rows=4, format="index")
    paths = [write_parquet(tmp_path / f"{k}.parquet", random_seqs(n, max_len=70, seed=k))
             for k, n in ((1, 40), (2, 0), (3, 55))]
    job = PackJob(paths, tmp_path / "local", config, write_options=write_options,
                  block_size=block_size or 1 << 22, workers=1)
    assert job.plan_only
    local = pack_to_dir(job)
    assert len(local.shards) >= 3
    away = tmp_path / "away"
    away.mkdir()
    moved = lambda: [os.rename(p, away / os.path.basename(p)) for p in paths]  # noqa: E731
    manifest = _run_steps(paths, tmp_path / "steps", config, write_options,
                          np.random.default_rng(seed), block_size, after_plan=moved)
    assert not any(os.path.exists(p) for p in paths)
    assert manifest == local
    assert dir_bytes(tmp_path / "steps") == dir_bytes(tmp_path / "local")


@pytest.mark.parametrize("change", ["size", "same_size"])
def test_an_index_refuses_an_input_that_changed_after_its_scan(tmp_path, change):
    """An index reads no input after the plan; its manifest keeps each input's stamp as the
    scan read it, so an input rewritten since its scan is refused, even at the same size (the
    rows would be read as other tokens); the other formats' manifests keep no stamp."""
    path = write_parquet(tmp_path / "a.parquet", random_seqs(20, seed=5))
    read = ReadOptions()
    scans = [beam_steps.scan_file(0, path, read)]
    assert scans[0].info["mtime_ns"] == os.stat(path).st_mtime_ns
    size = os.path.getsize(path)
    if change == "size":
        write_parquet(path, random_seqs(40, seed=6))
    else:  # same bytes, written again: only the stamp tells
        data = open(path, "rb").read()
        time.sleep(0.01)
        with open(path, "wb") as f:
            f.write(data)
        os.utime(path, ns=(time.time_ns(), scans[0].info["mtime_ns"] + 10**9))
        assert os.path.getsize(path) == size
    job = PackJob([path], tmp_path / "o", PackConfig(64), write_options=WriteOptions(
        format="index"))
    with pytest.raises(InputError, match=r"a\.parquet: changed while the job ran"):
        beam_steps.plan_in_process(scans, job)
    if change == "same_size":  # a copy's manifest names content only: the job goes on
        summary, _ = beam_steps.plan_in_process(scans, PackJob([path], tmp_path / "c",
                                                               PackConfig(64)))
        assert summary is not None
        assert "mtime_ns" not in json.dumps(summary.intent.inputs)


def test_an_input_that_changes_while_it_is_scanned_is_refused(tmp_path):
    path = write_parquet(tmp_path / "a.parquet", random_seqs(20, seed=5))

    def touch(_chunk) -> None:
        os.utime(path, ns=(time.time_ns(), os.stat(path).st_mtime_ns + 10**9))

    with pytest.raises(InputError, match=r"a\.parquet: changed while it was read"):
        inputs.scan_file(path, "parquet", ReadOptions(), sink=touch)


def test_blocks_give_each_piece_to_its_input_once(tmp_path):
    config, write_options = CONFIGS["bfd_split"]
    paths = _inputs(tmp_path)
    read = ReadOptions()
    scans = [beam_steps.scan_file(i, p, read) for i, p in enumerate(paths)]
    summary, jobs = beam_steps.plan_in_process(
        scans, PackJob(paths, tmp_path / "o", config, write_options=write_options, block_size=23))
    assert summary is not None and len(summary.row_base) == -(-96 // 23)  # 1 + 40 + 0 + 55
    assert [j.index for j in jobs] == [0, 1, 3]  # the empty input holds no piece
    firsts = np.cumsum([0] + [s.lengths.size for s in scans])
    for job in jobs:
        ex = job.pieces[beam_steps.EXAMPLE]
        assert job.first_example == firsts[job.index]
        assert ((ex >= firsts[job.index]) & (ex < firsts[job.index + 1])).all()
    table = np.concatenate([j.pieces for j in jobs], axis=1)
    key = table[beam_steps.EXAMPLE] * 1000 + table[beam_steps.START]
    assert np.unique(key).size == key.size == summary.results["stats"]["num_segments"]
    assert table[beam_steps.ROW].max() + 1 == summary.intent.num_rows


def test_bad_input_becomes_a_scan_error_and_the_first_one_is_raised(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [[1, 2]])
    bad1 = tmp_path / "bad1.jsonl"
    bad1.write_text('{"tokens": [1]}\n{"tokens": [1, -2]}\n')
    bad2 = tmp_path / "bad2.jsonl"
    bad2.write_text("{oops\n")
    read = ReadOptions()
    scans = [beam_steps.scan_file(i, str(p), read) for i, p in enumerate([good, bad1, bad2])]
    assert scans[0].error is None and "bad1.jsonl:2: tokens[1]=-2" in scans[1].error
    with pytest.raises(InputError, match=r"bad1\.jsonl:2"):
        beam_steps.plan_in_process(scans[::-1], PackJob([good], tmp_path / "o", PackConfig(8)))
    assert not (tmp_path / "o").exists()


def test_an_input_changed_between_the_passes_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", random_seqs(20, seed=5))
    read = ReadOptions()
    summary, jobs = beam_steps.plan_in_process(
        [beam_steps.scan_file(0, path, read)], PackJob([path], tmp_path / "o", PackConfig(64)))
    write_jsonl(path, random_seqs(21, seed=6))
    with pytest.raises(InputError, match="changed while the job ran"):
        list(beam_steps.route_file(jobs[0], read, summary.shard_rows, summary.row_dtype))


def test_a_route_step_sends_its_parts_as_they_reach_the_budget_and_stops_when_told(
        tmp_path, monkeypatch):
    import threading

    from seqpack.pipelines.formats import jsonl

    monkeypatch.setattr(jsonl, "BLOCK_BYTES", 500)  # many chunks
    paths = [write_jsonl(tmp_path / "a.jsonl", random_seqs(400, max_len=60, seed=8))]
    read = ReadOptions()
    summary, jobs = beam_steps.plan_in_process(
        [beam_steps.scan_file(0, paths[0], read)],
        PackJob(paths, tmp_path / "o", PackConfig(64), write_options=WriteOptions(shard_rows=8)))
    whole = list(beam_steps.route_file(jobs[0], read, summary.shard_rows, summary.row_dtype))
    small = list(beam_steps.route_file(jobs[0], read, summary.shard_rows, summary.row_dtype,
                                       budget=500))
    assert len(whole) == len({k for k, _ in whole}) < len(small)  # one part a shard, or more
    for k in {k for k, _ in whole}:
        one = beam_steps.ShardPart.of([p for j, p in small if j == k])
        got = dict(whole)[k]
        order = np.lexsort(one.pieces[::-1])
        np.testing.assert_array_equal(one.pieces[:, order], got.pieces[:, np.lexsort(
            got.pieces[::-1])])
        assert sorted(one.tokens.tolist()) == sorted(got.tokens.tolist())
    before = threading.active_count()
    parts = beam_steps.route_file(jobs[0], read, summary.shard_rows, summary.row_dtype,
                                  budget=100)
    next(parts)
    parts.close()  # the consumer stops: the scan's thread ends
    assert threading.active_count() == before


def test_the_core_modules_do_not_need_beam():
    code = ("import sys, seqpack.cli, seqpack.pipelines.offline.runners, "
            "seqpack.pipelines.offline.verify, seqpack.pipelines.offline.steps; "
            "print('apache_beam' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"
