"""The Beam job on the DirectRunner (worker processes): the local CLI's bytes, verify, errors."""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np
import pytest
from click.testing import CliRunner

from seqpack import cli
from seqpack.packer import PackConfig
from seqpack.pipelines.errors import UsageError
from seqpack.pipelines.formats.inputs import InputError
from seqpack.pipelines.offline import PackJob, WriteOptions
from seqpack.pipelines.offline.runners import pack_to_dir
from seqpack.pipelines.offline.verify import verify
from tests.helpers.files import (
    bad_record_is_one_error_line,
    dir_bytes,
    random_seqs,
    three_formats,
    write_jsonl,
    write_parquet,
)

beam_job = pytest.importorskip("seqpack.pipelines.offline.runners.beam",
                               reason="the Beam job needs seqpack[beam]")
pack_beam, pipeline_options = beam_job.pack_beam, beam_job.pipeline_options
from seqpack.pipelines.offline.runners import beam_verify  # noqa: E402

CONFIG = PackConfig(64, max_segments=8, overflow="split")
WRITE = WriteOptions(shard_rows=7)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[list[str], str]:
    """Three inputs (JSONL, Parquet, ArrayRecord; 360 examples) and their local CLI output."""
    d = tmp_path_factory.mktemp("corpus")
    paths = three_formats(d)
    local = d / "local"
    pack_to_dir(PackJob(paths, local, CONFIG, write_options=WRITE, workers=1))
    return paths, str(local)


@pytest.mark.slow
def test_one_and_two_workers_write_the_local_clis_bytes(corpus, tmp_path):
    paths, local = corpus
    want = dir_bytes(local)
    local_manifest = json.loads(want["manifest.json"])
    assert len(local_manifest["shards"]) >= 4 and local_manifest["stats"]["counters"][
        "split_examples"] > 0
    for n in (1, 2):
        out = tmp_path / f"beam{n}"
        manifest = pack_beam(PackJob(paths, out, CONFIG, write_options=WRITE, workers=n),
                             quiet=True)
        assert manifest.to_json() == local_manifest
        assert dir_bytes(out) == want, f"{n} worker(s)"
        eff, local_eff = manifest.stats["efficiency"], local_manifest["stats"]["efficiency"]
        assert abs(eff - local_eff) <= 1e-3 * local_eff
        report = verify(str(out))
        assert report.ok and report.num_rows == manifest.num_rows, report.violations


@pytest.mark.slow
def test_a_job_leaves_nothing_in_the_temp_directory(corpus, tmp_path, monkeypatch):
    """Beam's job service and workers left three empty directories in the system's temp
    directory every run (hundreds after a test suite); they now go to one removed after."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setenv("TMPDIR", str(tmp))
    paths, _ = corpus
    pack_beam(PackJob(paths, tmp_path / "out", CONFIG, write_options=WRITE, workers=2),
              quiet=True)
    assert beam_verify.verify_beam(str(tmp_path / "out"), workers=2, quiet=True).ok
    assert os.listdir(tmp) == []
    assert tempfile.gettempdir() == os.environ["TMPDIR"] == str(tmp)


@pytest.mark.slow
def test_cli_runner_beam_matches_the_local_cli_and_verifies(tmp_path):
    seqs = random_seqs(300, max_len=100, seed=7) + [list(range(250))]
    src = [write_jsonl(tmp_path / "a.jsonl", seqs[:170]), write_parquet(tmp_path / "b.parquet",
                                                                        seqs[170:])]
    ids = np.frombuffer(b"one example of byte ids", np.uint8)  # uint8 ids, widened by pad
    np.savez(tmp_path / "c.npz", tokens=ids, offsets=np.array([0, ids.size]))
    src.append(str(tmp_path / "c.npz"))
    common = ["--seq-len", 96, "--max-segments", 6, "--overflow", "truncate", "--strategy",
              "first_fit", "--segment-alignment", 4, "--pad-id", 300, "--shard-rows", 9,
              "--compression", "zstd", "--block-size", 64]  # 5 blocks, planned by the workers
    outputs = {}
    for runner, extra in (("local", []), ("beam", ["--beam-option", "direct_num_workers=2"])):
        out = tmp_path / runner
        result = CliRunner().invoke(cli.seqpack, [str(a) for a in ["pack", *src, "-o", out,
                                                                   "--runner", runner, *common,
                                                                   *extra]])
        assert result.exit_code == 0, (result.output, result.exception)
        outputs[runner] = result.output.replace(str(out), "OUT")
    assert outputs["beam"] == outputs["local"]
    assert "efficiency" in outputs["beam"]
    assert dir_bytes(tmp_path / "beam") == dir_bytes(tmp_path / "local")
    manifest = json.loads((tmp_path / "beam" / "manifest.json").read_text())
    truncated = sum(len(s) > 96 for s in seqs)
    assert truncated >= 2 and manifest["stats"]["counters"]["truncated_examples"] == truncated
    assert manifest["inputs"]["token_dtype"] == "<i4"
    result = CliRunner().invoke(cli.seqpack, ["verify", str(tmp_path / "beam")])
    assert result.exit_code == 0 and result.output.startswith("OK:"), result.output


@pytest.mark.slow
def test_bad_record_is_one_error_line_naming_file_and_record(tmp_path):
    bad_record_is_one_error_line(tmp_path, "--runner", "beam", "--beam-option",
                                 "direct_num_workers=2")


@pytest.mark.slow
def test_library_errors_name_the_record_or_example(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"tokens": pa.array([[1, 2], None, [3]], pa.list_(pa.int32()))}),
                   path)
    with pytest.raises(InputError, match=r"nulls\.parquet record 1: column 'tokens' is null"):
        pack_beam(PackJob([path], tmp_path / "o", CONFIG, workers=2), quiet=True)
    long = write_jsonl(tmp_path / "long.jsonl", [[1] * 5, [2] * 80])
    with pytest.raises(ValueError, match=r"long\.jsonl: example 1 \(counting from 0\) has 80 "
                                         r"tokens, more than seq_len 64"):
        pack_beam(PackJob([long], tmp_path / "o", PackConfig(64), workers=2), quiet=True)
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_resume_keeps_complete_shards_and_overwrite_is_required(corpus, tmp_path):
    paths, local = corpus
    out = tmp_path / "out"
    manifest = pack_to_dir(PackJob(paths, out, CONFIG, write_options=WRITE, workers=1))
    # Damage the complete run: the last shard gone. --resume turns it back into an interrupted
    # run whose intact shards are kept (their completion records written from the manifest).
    os.remove(out / manifest.shards[-1])
    kept = {n: os.stat(out / n).st_mtime_ns for n in manifest.shards[:-1]}
    pack_beam(PackJob(paths, out, CONFIG, write_options=WRITE, existing="resume", workers=2),
              quiet=True)
    assert dir_bytes(out) == dir_bytes(local)
    assert {n: os.stat(out / n).st_mtime_ns for n in kept} == kept  # not rewritten
    with pytest.raises(ValueError, match="exists and is not empty; pass existing='overwrite'"):
        pack_beam(PackJob(paths, out, CONFIG, write_options=WRITE, workers=2), quiet=True)
    pack_beam(PackJob(paths, out, CONFIG, write_options=WRITE, existing="overwrite", workers=1),
              quiet=True)
    assert dir_bytes(out) == dir_bytes(local)


def test_pipeline_options_defaults_and_overrides():
    from apache_beam.options.pipeline_options import DirectOptions, StandardOptions

    default = pipeline_options().view_as(DirectOptions)
    assert default.direct_running_mode == "multi_processing"
    from seqpack.pipelines.offline import default_workers

    assert default.direct_num_workers == default_workers()  # the local runner's default
    assert pipeline_options(workers=3).view_as(DirectOptions).direct_num_workers == 3
    given = pipeline_options(["direct_num_workers=2", "--direct_running_mode=multi_threading"])
    assert given.view_as(DirectOptions).direct_num_workers == 2
    assert given.view_as(DirectOptions).direct_running_mode == "multi_threading"
    other = pipeline_options(["runner=FlinkRunner"])
    assert other.view_as(StandardOptions).runner == "FlinkRunner"
    assert "direct_running_mode" not in other.get_all_options(drop_default=True)
    for bad in ("=2", "direct num workers=2", "runner="):
        with pytest.raises(ValueError, match="must be KEY=VALUE"):
            pipeline_options([bad])


def test_a_dry_run_on_a_cluster_runner_needs_an_output(tmp_path):
    """Its figures come back through a file every worker sees: -o, not this machine's temp."""
    job = PackJob([str(tmp_path / "a.jsonl")], "", CONFIG)
    with pytest.raises(UsageError, match="needs an output directory"):
        beam_job.plan_beam(job, None, beam_options=["runner=FlinkRunner"])


def test_the_dask_runner_is_refused_by_any_of_its_names():
    # Why: tests/test_beam_dask.py reproduces its faults on a real cluster.
    for name in ("DaskRunner", "dask", "apache_beam.runners.dask.dask_runner.DaskRunner"):
        with pytest.raises(UsageError, match=f"runner={name}: Beam's Dask runner cannot run "
                                             "this job: it gives a side input each element"):
            pipeline_options([f"runner={name}", "dask_client_address=127.0.0.1:8786"])
    assert pipeline_options(["runner=DataflowRunner"]) is not None  # others go through


def test_beam_option_without_runner_beam_is_a_usage_error(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", [[1, 2]])
    result = CliRunner().invoke(cli.seqpack, ["pack", src, "-o", str(tmp_path / "o"),
                                              "--beam-option", "direct_num_workers=2"])
    assert result.exit_code == 2 and "--beam-option needs --runner beam" in result.output
    result = CliRunner().invoke(cli.seqpack, ["pack", src, "-o", str(tmp_path / "o"), "--runner",
                                              "beam", "--beam-option", "=3"])
    assert result.exit_code == 2 and "Error: beam option '=3' must be KEY=VALUE" in result.output
