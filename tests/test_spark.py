"""The Spark job: the local runner's bytes on `local[N]` and on a real standalone cluster (a
master and two one-core workers started here through pyspark's `spark-class`), on local paths
and on the S3 emulator; an executor killed mid-job, a killed driver then `--resume`, a bad
input. The options and the error plumbing are checked without a JVM."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal

import pytest
from click.testing import CliRunner

from seqpack import cli
from seqpack.packer import PackConfig
from seqpack.pipelines.errors import InputError, RunFailed, UsageError
from seqpack.pipelines.offline import PackJob, WriteOptions, pack
from seqpack.pipelines.offline.outdir import DONE, INTENT, MANIFEST
from seqpack.pipelines.offline.runners import pack_to_dir
from seqpack.pipelines.offline.verify import verify
from tests.helpers.cloud import s3, s3_server  # noqa: F401
from tests.helpers.files import (
    bad_record_is_one_error_line,
    dir_bytes,
    random_seqs,
    run_cli,
    three_formats,
    write_jsonl,
)
from tests.helpers.runs import session, start, wait_for
from tests.helpers.spark_cluster import spark_class, standalone_cluster

spark_job = pytest.importorskip("seqpack.pipelines.offline.runners.spark",
                                reason="the Spark job needs seqpack[spark]")

# Spark's JVM: a local master needs java as a cluster does (.ci/run installs a JRE)
needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="Spark needs Java 17+")

CONFIG = PackConfig(64, max_segments=8, overflow="split")
WRITE = WriteOptions(shard_rows=7)
BLOCK = 100  # 4 blocks of the 360 examples: planned apart, by Spark's tasks
ARGS = ["--seq-len", 64, "--max-segments", 8, "--overflow", "split", "--shard-rows", 7,
        "--block-size", BLOCK]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[list[str], str]:
    """Three inputs (JSONL, Parquet, ArrayRecord; 360 examples) and the local runner's output."""
    d = tmp_path_factory.mktemp("corpus")
    paths = three_formats(d)
    local = d / "local"
    pack_to_dir(PackJob(paths, local, CONFIG, write_options=WRITE, workers=1, block_size=BLOCK))
    return paths, str(local)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if spark_class() is None:
        pytest.skip("a Spark cluster needs pyspark and java")
    with standalone_cluster(tmp_path_factory.mktemp("spark")) as c:
        yield c


def _cluster_options(cluster, executors: int = 2, **env: str) -> list[str]:
    return [f"master={cluster.url}", f"spark.cores.max={executors}", "spark.executor.cores=1",
            "spark.executor.memory=512m", *(f"spark.executorEnv.{k}={v}" for k, v in env.items())]


def _flags(options: list[str]) -> list[str]:
    return [x for o in options for x in ("--spark-option", o)]


# -- without a JVM -----------------------------------------------------------------------------


def test_spark_conf_defaults_and_overrides():
    conf = spark_job.spark_conf((), workers=3)
    assert conf["spark.master"] == "local[3]" and conf["spark.ui.enabled"] == "false"
    assert conf["spark.ui.showConsoleProgress"] == "false"
    assert conf["spark.driver.bindAddress"] == "127.0.0.1"
    conf = spark_job.spark_conf(["master=spark://h:7077", "spark.executor.memory=4g",
                                 "--spark.cores.max=8"], workers=3)
    assert conf["spark.master"] == "spark://h:7077" and conf["spark.executor.memory"] == "4g"
    assert conf["spark.cores.max"] == "8" and "spark.ui.enabled" not in conf  # a cluster's UI
    assert spark_job.spark_conf(["spark.ui.enabled=true"])["spark.ui.enabled"] == "true"
    for bad in ("executor.memory=4g", "spark.executor.memory", "master=", "=x", "spark.=1"):
        with pytest.raises(UsageError, match=r"spark_options=.* must be master=URL or a Spark "):
            spark_job.spark_conf([bad])


def test_cli_refuses_a_bad_spark_option_and_one_without_the_runner(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", random_seqs(5, seed=1))
    for extra, want in ((["--runner", "spark", "--spark-option", "executor.memory=4g"],
                         "Error: --spark-option executor.memory=4g must be master=URL"),
                        (["--spark-option", "master=local[1]"],
                         "Error: --spark-option needs --runner spark")):
        result = CliRunner().invoke(cli.seqpack, ["pack", src, "-o", str(tmp_path / "o"),
                                                  *extra])
        assert result.exit_code == 2 and result.output.startswith(want), result.output
    assert not (tmp_path / "o").exists()


def test_task_errors_reach_the_driver_as_their_own_kind():
    def fail(key, values, error):
        raise error

    for error, kind in ((InputError("a.jsonl:3: bad id"), InputError),
                        (UsageError("shard_rows=3 is wrong"), UsageError),
                        (RunFailed(28, "rows-0.arrayrecord: writing (No space left)"), RunFailed)):
        with pytest.raises(RuntimeError) as raised:
            list(spark_job._each_key(fail, (error,), [(0, "x")]))
        # what Spark's error carries: the task's traceback, inside the JVM's message
        again = spark_job._driver_error(Exception(f"Py4JJavaError: ...\n{raised.value}\n\tat"))
        assert type(again) is kind and str(again) == str(error)
    lost = Exception("org.apache.spark.SparkException: Job aborted due to stage failure: Task 3 "
                     "in stage 5.0 failed 4 times\n\tat org.apache...")
    again = spark_job._driver_error(lost, " (Spark's log: /tmp/x.log)")
    assert isinstance(again, RunFailed) and "Task 3 in stage 5.0 failed 4 times" in str(again)
    assert str(again).endswith("existing='resume' (Spark's log: /tmp/x.log)")
    assert spark_job._driver_error(KeyError("bug")) is None


def test_by_key_sends_contiguous_key_ranges_to_each_task():
    tasks = [spark_job._task_of(k, keys=10, tasks=4) for k in range(10)]
    assert tasks == sorted(tasks) and set(tasks) == {0, 1, 2, 3}


# -- local[N] ----------------------------------------------------------------------------------


class _Recorder:
    def __init__(self):
        self.calls: list[tuple] = []

    def phase(self, name: str, total: int) -> None:
        self.calls.append(("phase", name, total))

    def advance(self, amount: int, rows: int = 0) -> None:
        self.calls.append(("advance", amount, rows))


@pytest.mark.slow
@needs_java
def test_local_master_writes_the_local_bytes_with_progress(corpus, tmp_path):
    paths, local = corpus
    progress = _Recorder()
    out = tmp_path / "spark"
    manifest = pack(PackJob(paths, out, CONFIG, write_options=WRITE, workers=2,
                            block_size=BLOCK), runner="spark", quiet=True, progress=progress)
    assert dir_bytes(out) == dir_bytes(local)
    assert manifest.to_json() == json.loads(dir_bytes(local)[MANIFEST])
    phases = [c for c in progress.calls if c[0] == "phase"]
    assert [p[1] for p in phases] == ["reading", "writing"]
    assert phases[0][2] == sum(os.path.getsize(p) for p in paths)
    assert phases[1][2] == manifest.stats["real_tokens"]
    reading = progress.calls.index(phases[1])
    assert sum(c[1] for c in progress.calls[1:reading]) == phases[0][2]
    writing = progress.calls[reading + 1 :]
    assert sum(c[1] for c in writing) == phases[1][2]
    assert writing[-1][2] == manifest.num_rows


@pytest.mark.slow
@needs_java
def test_local_master_writes_every_format_as_the_local_runner(corpus, tmp_path):
    """--format parquet / hf / megatron / index: the shard writer and its side files are the
    core's, so Spark's bytes are the local runner's in every format, and they verify (index:
    the inputs that can be read at random, Parquet and ArrayRecord)."""
    paths, _ = corpus
    for fmt in ("parquet", "hf", "megatron", "index"):
        if fmt == "index":
            paths = [p for p in paths if not p.endswith(".jsonl")]
        write = dataclasses.replace(WRITE, format=fmt)
        local, spark = tmp_path / f"local-{fmt}", tmp_path / f"spark-{fmt}"
        pack_to_dir(PackJob(paths, local, CONFIG, write_options=write, workers=1,
                            block_size=BLOCK))
        pack(PackJob(paths, spark, CONFIG, write_options=write, workers=2, block_size=BLOCK),
             runner="spark", quiet=True)
        assert dir_bytes(spark) == dir_bytes(local), fmt
        assert json.loads(dir_bytes(spark)[MANIFEST])["encoding"] == fmt
        report = verify(str(spark))
        assert report.ok, (fmt, report.violations)


@pytest.mark.slow
@needs_java
def test_bad_input_is_one_error_line_naming_the_file(tmp_path):
    bad_record_is_one_error_line(tmp_path, "--runner", "spark", "--workers", 2)


# -- a standalone cluster ----------------------------------------------------------------------


@pytest.mark.slow
def test_cluster_with_one_and_two_executors_writes_the_local_bytes(corpus, cluster, tmp_path):
    paths, local = corpus
    want = dir_bytes(local)
    for n in (1, 2):
        out = tmp_path / f"spark{n}"
        pack(PackJob(paths, out, CONFIG, write_options=WRITE, block_size=BLOCK), runner="spark",
             spark_options=_cluster_options(cluster, n), quiet=True)
        assert dir_bytes(out) == want, f"{n} executor(s)"
    report = verify(str(tmp_path / "spark2"))
    assert report.ok, report.violations


@pytest.mark.slow
def test_cluster_on_the_s3_emulator_writes_the_local_bytes(corpus, cluster, s3):  # noqa: F811
    paths, local = corpus
    urls = [s3.upload(p, s3.url("in/" + os.path.basename(p))) for p in paths]
    env = {k: os.environ[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID",
                                      "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                      "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")}
    out = s3.url("spark/")
    result = run_cli("pack", *urls, "-o", out, *ARGS, "--runner", "spark",
                     *_flags(_cluster_options(cluster, **env)), timeout=300)
    assert result.returncode == 0, result.stderr
    fs, inside = s3.fs, out.split("://", 1)[1].rstrip("/")
    got = {p.rsplit("/", 1)[-1]: fs.cat(p) for p in sorted(fs.ls(inside, refresh=True,
                                                                   detail=False))}
    want = dir_bytes(local)
    manifest = json.loads(got.pop(MANIFEST))
    local_manifest = json.loads(want.pop(MANIFEST))
    assert got == want  # the shards, and no lock or record left behind
    assert [i["path"] for i in manifest["inputs"]["files"]] == urls  # the inputs' URLs
    for m in (manifest, local_manifest):  # the same, but for where the inputs are
        for f in m["inputs"]["files"]:
            f.pop("path")
        m.pop("manifest_sha256")
    assert manifest == local_manifest


def _shards_done(out) -> bool:
    return out.is_dir() and any(n.endswith(DONE) for n in os.listdir(out))


@pytest.mark.slow
def test_an_executor_killed_mid_job_costs_a_task_retry_not_the_bytes(corpus, cluster, tmp_path):
    paths, local = corpus
    out = tmp_path / "out"
    options = _cluster_options(cluster, SEQPACK_TEST_SHARD_DELAY="0.4")
    run = start("pack", *paths, "-o", out, *ARGS, "--runner", "spark", *_flags(options),
                env={"SEQPACK_DEBUG": "1"})  # Spark's log on stderr
    wait_for(lambda: _shards_done(out), run, timeout=240)
    executors = cluster.executors()
    assert len(executors) == 2
    os.kill(executors[0], signal.SIGKILL)
    _, err = run.communicate(timeout=300)
    assert run.returncode == 0, err
    assert re.search(r"Lost task .* ExecutorLostFailure", err), err[-3000:]  # and retried
    assert dir_bytes(out) == dir_bytes(local)  # no temporary of the killed write left either
    wait_for(lambda: not session(run.pid), timeout=30)


@pytest.mark.slow
def test_a_killed_driver_is_finished_by_resume(corpus, cluster, tmp_path):
    paths, local = corpus
    out = tmp_path / "out"
    options = _flags(_cluster_options(cluster, SEQPACK_TEST_SHARD_DELAY="0.4"))
    run = start("pack", *paths, "-o", out, *ARGS, "--runner", "spark", *options)
    wait_for(lambda: _shards_done(out), run, timeout=240)
    os.kill(run.pid, signal.SIGKILL)
    run.communicate(timeout=30)
    # its JVM and workers end with it (past 60 s once, with `-n 2` running another Spark job)
    wait_for(lambda: not session(run.pid), timeout=120)
    wait_for(lambda: not cluster.executors(), timeout=60)  # the master ends its executors
    assert (out / INTENT).exists() and not (out / MANIFEST).exists()
    kept = {n.removesuffix(DONE) for n in os.listdir(out) if n.endswith(DONE)}
    assert kept
    mtimes = {n: os.stat(out / n).st_mtime_ns for n in kept}
    result = run_cli("pack", *paths, "-o", out, *ARGS, "--runner", "spark", *_flags(
        _cluster_options(cluster)), "--resume", timeout=300)
    assert result.returncode == 0, result.stderr
    assert dir_bytes(out) == dir_bytes(local)
    assert {n: os.stat(out / n).st_mtime_ns for n in kept} == mtimes  # kept, not rewritten
