"""Packs a corpus on Apache Spark: the same shards (any `--format`) and manifest as `seqpack pack`.

    seqpack pack data/*.parquet -o packed/ --runner spark                # local[N], N = --workers
    seqpack pack 's3://b/data/*.parquet' -o s3://b/packed/ --runner spark \\
        --spark-option master=spark://host:7077 --spark-option spark.executor.memory=4g

The driver maps `offline.steps` onto RDDs (the plan, order and shard plans are
`offline.core`'s, as for the local runner and the Beam job); nothing per example meets in the
driver, and tokens move once, from the task re-reading an input to the task writing a shard
(not at all for rows by reference with no extra columns: `PackJob.plan_only`)::

    scan      per input  mapPartitions  steps.scan_file: lengths, fingerprint (kept, persisted)
    summarize driver                    each input's FileSummary, collected
    plan      per block  by key         steps.cut_blocks -> steps.plan_block_slices (persisted;
                                        a mixture: its stream by `runners.mixing`'s stages)
    finish    driver                    steps.finish_plan: JobSummary, pack_intent.json
    route     per input  by key         steps.split_block -> steps.file_job -> steps.route_file
    write     per shard  by key         steps.write_shard_parts: the shard, its .done record
    manifest  driver                    steps.finish_job: manifest.json

A dry run (`plan_spark`) is scan, summarize and plan, the plan summed up in the driver without
writing, and each block's `steps.plan_figures` summed by the tasks (`treeReduce`).

"By key": elements keyed by block, input or shard (0..n-1) go to tasks holding contiguous key
ranges (one key a task up to `MAX_TASKS` tasks a stage) through
`repartitionAndSortWithinPartitions` (Spark's shuffle; pyspark's sorter spills to disk), and
each task's `mapPartitions` takes one key's values at a time. The driver holds the inputs' and
blocks' summaries and one result per shard; the small global state (the inputs' summaries, the
JobSummary) reaches the tasks as broadcasts.

Spark options (`spark_options`: "KEY=VALUE"): `master=URL`, and any Spark property by its name
(`spark.executor.memory=4g`). By default the master is `local[N]` with N = `job.workers` (every
CPU when None); the executors' Python is this interpreter (`sys.executable`) unless
`spark.pyspark.python=` or PYSPARK_PYTHON names another: on a cluster, a Python with seqpack
installed on every node. Inputs and output are paths every executor sees or URLs (`s3://`,
`gs://`), as in the Beam job.

Faults: a task that dies (its executor killed) is retried by Spark (`spark.task.maxFailures`);
a retried shard write writes the same bytes under the same name (a shard is published whole),
and the temporaries of a killed write are removed when the manifest is written. A killed
driver leaves pack_intent.json and the finished shards: the same job with `existing='resume'`
keeps the intact ones and writes the rest. A bad input is raised in the driver as the local
runner raises it (an InputError naming the file and record); an error a task raises (an input
that changed mid-job, a full disk) reaches the driver tagged, and is raised there as the same
kind of error with the same message.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
import os
import re
import signal
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from seqpack.pipelines import storage
from seqpack.pipelines.errors import InputError, RunFailed, UsageError, one_line, require
from seqpack.pipelines.formats.manifest import Manifest, read_manifest
from seqpack.pipelines.offline import steps
from seqpack.pipelines.offline.job import PackJob, default_workers, output_session
from seqpack.pipelines.offline.outdir import OutputDir
from seqpack.pipelines.offline.runners.mixing import spark_stream
from seqpack.pipelines.offline.runners.read import Progress, delay_seconds

pyspark: Any = require("pyspark", "runner='spark'")  # imported at run time: no static types

MAX_TASKS = 1024  # tasks of a by-key stage, at most: more keys share a task (contiguous ranges)
_TAG = "seqpack-task-error"  # marks an error a task raised, for the driver to raise it again
_KINDS: dict[str, Callable[[str], Exception]] = {
    "input": InputError, "usage": UsageError, "run": lambda m: RunFailed(0, m)}
_RESUME = "see the executors' logs, then run the same job with existing='resume'"


def spark_conf(spark_options: Sequence[str] = (), workers: int | None = None) -> dict[str, str]:
    """The Spark properties of a job from "KEY=VALUE" strings (`master=URL` or a Spark
    property `spark.*=VALUE`), over this runner's defaults: master `local[N]` (N = `workers`,
    None: every CPU), Spark's console progress bar off (the driver shows its own); a local
    master binds to 127.0.0.1 and starts no web UI. UsageError for anything else."""
    given: dict[str, str] = {}
    for item in spark_options:
        key, eq, value = item.partition("=")
        key = key.strip().removeprefix("--")
        if key == "master":
            key = "spark.master"
        if not eq or not value or not key.startswith("spark.") or key == "spark.":
            raise UsageError(f"spark_options={item!r} must be master=URL or a Spark property "
                             "spark.NAME=VALUE, e.g. master=spark://host:7077 or "
                             "spark.executor.memory=4g")
        given[key] = value
    conf = {"spark.master": f"local[{workers or default_workers()}]",
            "spark.app.name": "seqpack pack", "spark.ui.showConsoleProgress": "false"}
    if given.get("spark.master", conf["spark.master"]).startswith("local"):
        conf.update({"spark.ui.enabled": "false", "spark.driver.host": "127.0.0.1",
                     "spark.driver.bindAddress": "127.0.0.1"})
    return {**conf, **given}


@contextlib.contextmanager
def spark_context(conf: dict[str, str], *, log_path: str | None = None) -> Iterator[Any]:
    """A SparkContext for `conf` (`spark_conf`), stopped at the end, in a JVM of its own
    (ended at the end too) unless this process already has pyspark's JVM (an earlier context
    of the caller's: then that one serves, and `log_path` and the JVM-wide properties do not
    apply). `log_path`: the JVM's output (and, on a local master, the Python workers') goes
    there instead of this process's stdout and stderr. The caller's SIGINT handler stays in
    place (pyspark would install its own): an interrupt ends the run, and stopping the context
    cancels its jobs."""
    from pyspark.java_gateway import launch_gateway

    spark_conf_ = pyspark.SparkConf(loadDefaults=False).setAll(list(conf.items()))
    saved = signal.getsignal(signal.SIGINT)
    with contextlib.ExitStack() as stack:
        gateway = None
        if pyspark.SparkContext._gateway is None:  # pyspark's one JVM per process
            log = stack.enter_context(open(log_path, "ab")) if log_path else None
            with warnings.catch_warnings():  # pyspark warns about the pandas version it finds
                warnings.simplefilter("ignore", FutureWarning)
                gateway = launch_gateway(spark_conf_, popen_kwargs={"stdout": log, "stderr": log}
                                         if log else None)
            stack.callback(_end_gateway, gateway)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                sc = pyspark.SparkContext(conf=spark_conf_, gateway=gateway)
        finally:
            signal.signal(signal.SIGINT, saved)
        try:
            sc.setLogLevel("WARN")
            sc.pythonExec = conf.get("spark.pyspark.python") or os.environ.get(
                "PYSPARK_PYTHON") or sys.executable
            yield sc
        finally:
            sc.stop()


def _end_gateway(gateway: Any) -> None:
    """Ends the JVM `spark_context` started, and makes pyspark forget it: `SparkContext`
    keeps a process's first gateway (in its class attributes) for every later context, which
    would give the next job this one's JVM-wide settings and log, or a JVM that is gone."""
    with contextlib.suppress(Exception):
        gateway.shutdown()
    proc = gateway.proc
    if proc is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()  # the JVM exits when its stdin closes
        try:
            proc.wait(30)
        except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired
            proc.kill()
            proc.wait()
    if pyspark.SparkContext._gateway is gateway:
        pyspark.SparkContext._gateway = None
        pyspark.SparkContext._jvm = None


# -- tasks -------------------------------------------------------------------------------------


def _task_of(key: int, *, keys: int, tasks: int) -> int:
    return key * tasks // keys


def _each_key(fn: Callable[..., Iterable], args: tuple, items: Iterable[tuple[int, Any]]
              ) -> Iterator[Any]:
    """fn(key, values, *args) for each key of a task's (key, value) pairs, sorted by key; an
    error of the job's kinds is raised again tagged, for the driver (`_driver_error`)."""
    try:
        for key, group in itertools.groupby(items, key=operator.itemgetter(0)):
            yield from fn(key, (v for _, v in group), *args)
    except (InputError, UsageError, OSError) as e:
        kind = "usage" if isinstance(e, UsageError) else "input" if isinstance(
            e, InputError) else "run"
        raise RuntimeError(f"{_TAG}[{kind}]: {one_line(e)} :{_TAG}") from None


def by_key(rdd: Any, keys: int, fn: Callable[..., Iterable], *args: Any) -> Any:
    """fn(key, values, *args) (an iterable of outputs) for each key of `rdd`'s (key, value)
    pairs, keys 0..keys-1: contiguous key ranges per task, at most `MAX_TASKS` tasks."""
    tasks = max(1, min(keys, MAX_TASKS))
    to_task = functools.partial(_task_of, keys=max(keys, 1), tasks=tasks)
    # One key a task: its values need no sort (pyspark's sorter would copy them through its
    # spill files once the Python worker holds spark.python.worker.memory).
    moved = rdd.partitionBy(tasks, to_task) if tasks == keys else \
        rdd.repartitionAndSortWithinPartitions(tasks, to_task)
    return moved.mapPartitions(functools.partial(_each_key, fn, args))


def _scan(read_options: Any, loss_columns: Any, read: Any, items: Iterable[tuple[int, str, int]]
          ) -> Iterator[tuple[int, steps.FileScan]]:
    for index, path, nbytes in items:
        yield index, steps.scan_file(index, path, read_options, loss_columns)
        read.add(nbytes)


def _plan(block: int, slices: Iterable[steps.BlockSlice], files: Any, job: PackJob
          ) -> list[steps.BlockPlan]:
    return [steps.plan_block_slices(block, slices, files.value, job)]


def _route(index: int, tables: Iterable[np.ndarray], files: Any, job: PackJob, summary: Any
           ) -> Iterable[tuple[int, steps.ShardPart]]:
    s = summary.value
    return steps.route_file(steps.file_job(index, tables, files.value), job.read_options,
                            s.shard_rows, s.row_dtype, plan_only=job.plan_only,
                            columns=steps.column_dtypes(s))


def _write(shard: int, parts: Iterable[steps.ShardPart], summary: Any, job: PackJob,
           meter: tuple[Any, Any]) -> list[tuple[int, int, tuple[int, str], Any]]:
    parts = list(parts)
    rows, digest, facts = steps.write_shard_parts(
        shard, parts, summary.value, job.output, job.config, write_options=job.write_options,
        resume=job.resume)
    meter[0].add(sum(int(p.pieces[steps.LENGTH].sum()) for p in parts))
    meter[1].add(rows)
    time.sleep(delay_seconds())  # tests: a run slow enough to be stopped mid-way
    return [(shard, rows, digest, facts)]


# -- the driver --------------------------------------------------------------------------------


class _Meter:
    """Progress from accumulators the tasks add to, polled in a thread while an action runs."""

    def __init__(self, progress: Progress | None, amount: Any, rows: Any = None):
        self.progress, self.amount, self.rows = progress, amount, rows
        self.shown = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True, name="seqpack-progress")

    def __enter__(self) -> _Meter:
        if self.progress is not None:
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.stop.set()
            self.thread.join()
            self._update()

    def _poll(self) -> None:
        while not self.stop.wait(0.25):
            self._update()

    def _update(self) -> None:
        assert self.progress is not None
        now = int(self.amount.value)
        self.progress.advance(max(0, now - self.shown), int(self.rows.value) if self.rows else 0)
        self.shown = max(self.shown, now)


def _plan_job(sc: Any, job: PackJob, progress: Progress | None, *, dry: bool = False
              ) -> tuple[Any, Any, list[steps.FileSummary], steps.JobSummary | None]:
    """Scan, plan, finish: the persisted block plans, the inputs' broadcast and summaries, and
    the JobSummary (None: a resumed run that had finished; `dry`: summed up, nothing written)."""
    inputs = list(job.inputs)
    sizes = [storage.size(p) for p in inputs] if progress else [0] * len(inputs)
    if progress:
        progress.phase("reading", sum(sizes))
    read = sc.accumulator(0)
    scans = sc.parallelize([(i, p, n) for i, (p, n) in enumerate(zip(inputs, sizes))],
                           max(1, min(len(inputs), MAX_TASKS))
                           ).mapPartitions(functools.partial(_scan, job.read_options,
                                                             job.mix_loss_columns, read))
    scans = scans.persist(pyspark.StorageLevel.MEMORY_AND_DISK)
    with _Meter(progress, read):
        files = scans.map(lambda s: steps.summarize_file(s[1], job.config)).collect()
    steps.check_files(files, job)  # here, as locally: a bad input first, empty ones warned of
    files_bc = sc.broadcast(files)
    record, chunks = None, None
    if job.mixture is None:
        blocks = -(-int(steps.first_examples(files)[-1]) // job.block_size)
        cut = scans.flatMap(lambda s: steps.cut_blocks(s[1], files_bc.value, job.block_size))
    else:  # the mixed stream, made by the tasks (`runners.mixing`)
        cut, blocks, mixed, chunks = spark_stream(scans, files, job, by_key)
        if isinstance(mixed, str):
            raise UsageError(mixed)
        record = None if mixed is None else mixed.record
    plans = by_key(cut, blocks, _plan, files_bc, job).persist(
        pyspark.StorageLevel.MEMORY_AND_DISK)
    block_summaries = plans.map(lambda bp: bp.summary).collect()
    for done in (scans, chunks):
        if done is not None:
            done.unpersist()
    return plans, files_bc, files, steps.summarize_plan(
        files, block_summaries, job, mixture=record) if dry else steps.finish_plan(
        files, block_summaries, job, rerun=False, mixture=record)


def _run(sc: Any, job: PackJob, out: OutputDir, progress: Progress | None) -> Manifest:
    plans, files_bc, files, summary = _plan_job(sc, job, progress)
    if summary is None:
        return read_manifest(job.output, check_shards=False)
    summary_bc = sc.broadcast(summary)
    tables = plans.flatMap(lambda bp: steps.split_block(bp, summary_bc.value, files_bc.value))
    routed = by_key(tables, len(files), _route, files_bc, job, summary_bc)
    meter = (sc.accumulator(0), sc.accumulator(0))
    if progress:
        progress.phase("writing", int(summary.results["stats"]["real_tokens"]))
    with _Meter(progress, *meter):
        written = by_key(routed, len(summary.intent.shards), _write, summary_bc, job,
                         meter).collect()
    plans.unpersist()
    return steps.finish_job(written, summary, out)


def plan_spark(job: PackJob, step_rows: int | None, *, spark_options: Sequence[str] = (),
               quiet: bool = False, progress: Progress | None = None
               ) -> tuple[Any, dict, steps.PlanFigures]:
    """`runners.local.plan_job` as a Spark job (inputs scanned and blocks planned by the
    tasks, nothing written): (the run's intent, its results, its `PlanFigures`, summed by the
    tasks)."""
    with spark_job(spark_options, job.workers, quiet) as sc:
        plans, _, _, summary = _plan_job(sc, job, progress, dry=True)
        assert summary is not None
        summary_bc = sc.broadcast(summary)
        figures = plans.map(lambda bp: steps.plan_figures(bp, summary_bc.value, step_rows)
                            ).treeReduce(operator.add)
        plans.unpersist()
    return summary.intent, summary.results, figures


def _worded(e: BaseException) -> str:
    """`one_line(e)`, or its type where wording it fails (a Py4J error once the JVM is gone)."""
    try:
        return one_line(e)
    except Exception:  # noqa: BLE001 - any failure to word it
        return f"{type(e).__name__} (its message could not be read)"


def _driver_error(e: Exception, seen: str = "", advice: str = _RESUME) -> Exception | None:
    """The error a failed Spark job stands for: a task's tagged error as its own kind, a job
    Spark aborted (a task failed too often: executors lost) as RunFailed with `advice`; None
    otherwise."""
    text = str(e)
    tagged = re.search(rf"{_TAG}\[(\w+)\]: (.*?) :{_TAG}", text)
    if tagged:
        return _KINDS[tagged[1]](tagged[2])
    aborted = re.search(r"Job aborted due to stage failure: ([^\n]*)", text)
    if aborted:
        return RunFailed(0, f"the Spark job failed ({aborted[1][:300]}); {advice}{seen}")
    return None


def pack_spark(job: PackJob, *, spark_options: Sequence[str] = (), quiet: bool = False,
               progress: Progress | None = None) -> Manifest:
    """`runners.local.pack_to_dir` as a Spark job; returns the manifest.

    `spark_options`: "KEY=VALUE" (`spark_conf`); `quiet`: the JVM's log output goes to a
    temporary file, removed after the run unless the job failed unexpectedly (the error names
    it); `progress`: reading and writing progress, from the driver.
    """
    with output_session(job) as out, spark_job(spark_options, job.workers, quiet) as sc:
        return _run(sc, job, out, progress)


@contextlib.contextmanager
def spark_job(spark_options: Sequence[str], workers: int | None, quiet: bool,
               advice: str = _RESUME) -> Iterator[Any]:
    """A SparkContext for one job (`spark_conf`); an error a task raised is raised again as
    its kind (`_driver_error`, a job Spark aborted with `advice`); `quiet`: the JVM's log goes
    to a temporary file, kept and named when the job fails unexpectedly."""
    conf = spark_conf(spark_options, workers)
    log_path, keep_log = None, False
    if quiet:
        fd, log_path = tempfile.mkstemp(prefix="seqpack-spark-", suffix=".log")
        os.close(fd)
    seen = f" (Spark's log: {log_path})" if log_path else ""
    try:
        with spark_context(conf, log_path=log_path) as sc:
            try:
                yield sc
            except (InputError, UsageError, RunFailed):  # the driver's own: as raised
                raise
            except Exception as e:
                error = _driver_error(e, seen, advice)
                if error is None and log_path is not None:  # worded while the JVM runs
                    error = RuntimeError(f"the Spark job failed: {type(e).__name__}: "
                                         f"{_worded(e)[:2000]}{seen}")
                if error is None:
                    raise
                keep_log = not isinstance(error, (InputError, UsageError)) and bool(seen)
                raise error from None
    except (InputError, UsageError, RunFailed):
        raise
    except Exception as e:
        if log_path is None or isinstance(e, RuntimeError) and seen in str(e):
            raise
        keep_log = True
        raise RuntimeError(f"the Spark job failed: {type(e).__name__}: {_worded(e)[:2000]}"
                           f"{seen}") from e
    finally:
        if log_path is not None and not keep_log:
            with contextlib.suppress(OSError):
                os.remove(log_path)
