"""Packs a corpus with Apache Beam: the same ArrayRecord shards and manifest as `seqpack pack`.

    seqpack pack data/*.parquet -o packed/ --runner beam                        # local processes
    seqpack pack data/*.parquet -o packed/ --runner beam --beam-option direct_num_workers=8
    seqpack pack ... --runner beam --beam-option runner=FlinkRunner --beam-option flink_master=...

The job maps `offline.steps` (the job's steps over inputs, blocks and shards; the plan, order
and shard plans are `offline.core`'s, as for the local runner), one element per input, per
block of examples or per output shard; nothing per example meets in one place::

    A  ScanLengths   per input  (parallel)  read the file -> fingerprint + example lengths
       CutBlocks     per input              its lengths cut into blocks of `block_size`
                                            consecutive examples (global numbering; a mixture:
                                            its stream's, made by `runners.mixing`'s stages)
    B  PlanBlocks    per block  (parallel)  `core.plan_block`: pieces + rows within the block,
                                            histograms, costs and layout for the summary
       FinishPlan    once                   per-input and per-block summaries -> each block's
                                            first row, the stats, the order; pack_intent.json
       SplitBlocks   per block  (parallel)  the block's pieces with their output rows, per input
    C  RouteTokens   per input  (parallel)  re-read the file, send each piece's tokens to its shard
                                            (rows by reference with no extra columns: the
                                            pieces alone, the file not read again)
    D  WriteShards   per shard  (parallel)  `core.shard_plan` and `core.write_shard`
       WriteManifest once, after every shard: manifest.json (then the run is complete)

A dry run (`plan_beam`) is A and B, the plan summed up without writing, and each block's
`steps.plan_figures` summed; its figures come back to the driver through one file.

What moves: a block's lengths go to the worker planning it, its pieces to the inputs they come
from; the one global step gets a summary per input and per block (histograms of a few KB).
Tokens move once, from the worker reading an input to the workers writing its shards. A worker
planning a block holds a few dozen bytes per example of the block (`block_size`, by default
4,194,304 examples: a few hundred MB), whatever the corpus. The output is byte-identical to the
local runner's, whatever the number of workers (the manifest does not say how it was made).

Runners: DirectRunner in multi-processing mode by default (`direct_num_workers`: the job's
`workers`, by default the CPU count, as locally); any Beam pipeline option goes through
`beam_options` ("KEY=VALUE", or "KEY" for a flag). Workers read the inputs and write the
output through their paths or URLs (`gs://`, `s3://`: `offline.outdir.OutputDir`), so on a
cluster (Dataflow, Flink, Spark) inputs and output on object storage need no shared
filesystem; a local output directory must be one every worker sees.

Errors: a bad input or a rejected option (what the local runner rejects) fails the job with an
`InputError` / `ValueError` naming the file and record, raised here in the driver; the worker
that finds it writes it to ``OUTPUT/pack_error.json`` instead of crashing, the driver reads and
removes it, so a CLI run prints one `Error:` line. `resume` and `overwrite` work as locally (the
shard writers keep intact complete shards). The steps that write files (FinishPlan, WriteShards,
WriteManifest) may be run again, as Beam allows (a retried bundle; a recomputed PCollection,
even after the shards were written): each run writes the same bytes, and FinishPlan prepares
the directory only once (`core.finish_plan`).

Refused runners: Beam's Dask runner (`apache_beam.runners.dask`) breaks the Beam model (a side
input gets elements twice, tagged outputs reach every consumer, only the last leaf runs:
tests/test_beam_dask.py); `pipeline_options` refuses it.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import logging
import operator
import os
import pickle
import sys
import tempfile
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from seqpack.packer import PackConfig
from seqpack.pipelines.errors import InputError, UsageError, one_line, require
from seqpack.pipelines.formats.inputs import LossCount, ReadOptions
from seqpack.pipelines.formats.manifest import Manifest, read_manifest
from seqpack.pipelines.offline import steps
from seqpack.pipelines.offline.job import PackJob, default_workers, output_session
from seqpack.pipelines.offline.outdir import ERROR, OutputDir
from seqpack.pipelines.offline.record import ShardFacts, check_empty
from seqpack.pipelines.offline.runners.mixing import beam_stream
from seqpack.pipelines.offline.shards import WriteOptions
from seqpack.pipelines.storage import scratch_tempdir

# Runners this job refuses (the `runner` option's last dotted part, lower case), and why; see the
# module docstring (tests/test_beam_dask.py reproduces the Dask runner's faults with plain Beam).
_REFUSED_RUNNERS = dict.fromkeys(
    ("daskrunner", "dask"),
    "Beam's Dask runner cannot run this job: it gives a side input each element twice when the "
    "same PCollection also feeds a main input, sends a step's tagged outputs to all its "
    "consumers and runs only the pipeline's last step, so the job would fail or write wrong "
    "shards; use the DirectRunner, or Dataflow, Flink or Spark")


def _import_beam() -> types.ModuleType:
    """apache_beam, imported without it installing a stderr handler on the root logger.

    Its import logs a warning about optional GCP libraries through the root logger, which calls
    `logging.basicConfig` as a side effect; a NullHandler held on the root during the import
    turns both into no-ops (an application that configured logging keeps its handlers).
    """
    root = logging.getLogger()
    guard = logging.NullHandler()
    root.addHandler(guard)
    try:
        return require("apache_beam", "runner='beam'")
    finally:
        root.removeHandler(guard)


beam: Any = _import_beam()  # imported at run time: no static types
PipelineOptions: Any = beam.options.pipeline_options.PipelineOptions


def pipeline_options(beam_options: Sequence[str] = (), workers: int | None = None) -> Any:
    """Beam `PipelineOptions` from "KEY=VALUE" / "KEY" strings, with this job's defaults.

    With no `runner`, or the DirectRunner: multi-processing mode, `direct_num_workers` =
    `workers` (the job's; None: the CPU count, as for the local runner); harness logs from
    WARNING up. Any of these can be overridden. A refused runner (`_REFUSED_RUNNERS`: Beam's
    Dask runner) is a UsageError.
    """
    given: dict[str, str | None] = {}
    for item in beam_options:
        key, eq, value = item.partition("=")
        key = key.strip().removeprefix("--")
        if not key or not key.replace("_", "a").isalnum() or (eq and not value):
            raise UsageError(f"beam option {item!r} must be KEY=VALUE (or KEY for a flag), e.g. "
                             "direct_num_workers=4 or runner=DataflowRunner")
        given[key] = value if eq else None
    runner = given.get("runner") or "DirectRunner"
    refused = _REFUSED_RUNNERS.get(runner.rsplit(".", 1)[-1].lower())
    if refused:
        raise UsageError(f"beam_options= runner={runner}: {refused}")
    defaults = {"default_sdk_harness_log_level": "WARNING"}
    if runner in ("DirectRunner", "direct"):
        defaults["direct_running_mode"] = "multi_processing"
        defaults["direct_num_workers"] = str(workers or default_workers())
    flags = [f"--{k}={v}" if v is not None else f"--{k}" for k, v in {**defaults, **given}.items()]
    return PipelineOptions(flags)


def build_pipeline(p: Any, job: PackJob, *, report_errors: bool = True,
                   dry_run: tuple[tuple[str, str], int | None] | None = None) -> None:
    """Adds the packing `job` to Beam pipeline `p` (see the module docstring for its stages).

    `report_errors`: a rejected input is written to ``OUTPUT/pack_error.json`` (which
    `pack_beam` reads and raises), not raised in the worker; False fails the job with it.
    `dry_run` ((directory, name), rows a step): stages A and B only, the plan summed up and its
    figures (`steps.plan_figures`) or its error written to that file (`plan_beam`)."""
    config, block_size, output_dir = job.config, job.block_size, job.output
    read_options, write_options = job.read_options, job.write_options
    scans = (
        p
        | "Inputs" >> beam.Create(list(enumerate(job.inputs)))
        | "SpreadInputs" >> beam.Reshuffle()
        | "ScanLengths" >> beam.Map(scan_input, read_options, job.mix_loss_columns)
    )
    gathered = (scans | "SummarizeInputs" >> beam.Map(steps.summarize_file, config)
                | "GatherInputs" >> beam.combiners.ToList())
    files = beam.pvalue.AsSingleton(gathered)
    if job.mixture is None:
        cut, mixed = scans | "CutBlocks" >> beam.FlatMap(steps.cut_blocks, files, block_size), None
    else:  # the mixed stream, made on the workers (`runners.mixing`)
        cut, mixed = beam_stream(p, scans, gathered, job)
    plans = (
        cut
        | "GroupBlocks" >> beam.GroupByKey()
        | "PlanBlocks" >> beam.Map(_plan_block, files, job)
    )
    finished = (
        plans
        | "BlockSummaries" >> beam.Map(lambda bp: bp.summary)
        | "GatherBlocks" >> beam.combiners.ToList()
        | "FinishPlan" >> beam.FlatMap(_finish_plan, files, job, dry_run is not None,
                                       *([] if mixed is None else [mixed]))
        .with_outputs("error", main="summary")
    )
    summary = beam.pvalue.AsSingleton(finished.summary, default_value=None)
    if dry_run is not None:
        figures = (plans | "Figures" >> beam.FlatMap(
            lambda bp, s: [] if s is None else [steps.plan_figures(bp, s, dry_run[1])], summary)
                   | "SumFigures" >> beam.CombineGlobally(_sum))
        _ = (p | "Once" >> beam.Create([None]) | "ReportPlan" >> beam.Map(
            _report_plan, dry_run[0], summary, beam.pvalue.AsSingleton(figures),
            beam.pvalue.AsList(finished.error)))
        return
    _ = finished.error | "ReportError" >> beam.Map(_report_error, output_dir, report_errors)
    rows = (
        plans
        | "SplitBlocks" >> beam.FlatMap(steps.split_block, summary, files)
        | "GroupByInput" >> beam.GroupByKey()
        | "FileJobs" >> beam.Map(_file_job, files)
        | "RouteTokens" >> beam.FlatMap(_route, summary, read_options, job.plan_only)
        | "GroupByShard" >> beam.GroupByKey()
        | "WriteShards" >> beam.Map(_write_shard, summary, output_dir, config,
                                         write_options, job.resume)
    )
    _ = (
        rows
        | "GatherRowCounts" >> beam.combiners.ToList()
        | "WriteManifest" >> beam.Map(_finish, summary, output_dir)
    )


def scan_input(element: tuple[int, str], read_options: ReadOptions,
               loss_columns: LossCount | None) -> steps.FileScan:
    """`steps.scan_file` of an (index, path) element."""
    index, path = element
    return steps.scan_file(index, path, read_options, loss_columns)


def _plan_block(element: tuple[int, Iterable[steps.BlockSlice]],
                files: list[steps.FileSummary], job: PackJob) -> steps.BlockPlan:
    block, slices = element
    return steps.plan_block_slices(block, slices, files, job)


def _file_job(element: tuple[int, Iterable[np.ndarray]], files: list[steps.FileSummary]
              ) -> steps.FileJob:
    index, tables = element
    return steps.file_job(index, tables, files)


def _finish_plan(blocks: list[steps.BlockSummary], files: list[steps.FileSummary],
                 job: PackJob, dry: bool, mixed: Any = None
                 ) -> Iterator[Any]:  # the JobSummary, or a TaggedOutput error
    try:
        if isinstance(mixed, str):  # the mixture was refused
            steps.check_files(files, job)  # a bad input first, as locally
            raise UsageError(mixed)
        record = None if mixed is None else mixed.record
        summary = (steps.summarize_plan if dry else steps.finish_plan)(files, blocks, job,
                                                                       mixture=record)
    except (ValueError, OSError) as e:
        yield beam.pvalue.TaggedOutput("error", one_line(e))
        return
    if summary is not None:
        yield summary


def _sum(figures: Iterable[steps.PlanFigures | None]) -> steps.PlanFigures | None:
    present = [f for f in figures if f is not None]
    return functools.reduce(operator.add, present) if present else None


def _report_plan(_: None, report: tuple[str, str], summary: steps.JobSummary | None,
                 figures: steps.PlanFigures | None, errors: list[str]) -> None:
    """Writes what `plan_beam` returns (pickled, in JSON), or the plan's first error."""
    if errors or summary is None:
        OutputDir(report[0]).write_json(report[1], {"error": errors[0] if errors else
                                                    "the plan was not summed up"})
        return
    planned = pickle.dumps((summary.intent, summary.results, figures))
    OutputDir(report[0]).write_json(report[1], {"plan": base64.b64encode(planned).decode()})


def _route(job: steps.FileJob, summary: steps.JobSummary | None, read_options: ReadOptions,
           plan_only: bool) -> Iterable[tuple[int, steps.ShardPart]]:
    if summary is None:
        return []
    return steps.route_file(job, read_options, summary.shard_rows, summary.row_dtype,
                            plan_only=plan_only, columns=steps.column_dtypes(summary))


def _report_error(message: str, output_dir: str, report: bool) -> None:
    if not report:
        raise InputError(message)  # fails the job; the runner's error carries the message
    OutputDir(output_dir).write_json(ERROR, {"error": message})


def _write_shard(element: tuple[int, Iterable[steps.ShardPart]],
                 summary: steps.JobSummary, output_dir: str, config: PackConfig,
                 write_options: WriteOptions, resume: bool
                 ) -> tuple[int, int, tuple[int, str], ShardFacts]:
    shard, parts = element
    return (shard, *steps.write_shard_parts(shard, parts, summary, output_dir, config,
                                                 write_options=write_options, resume=resume))


def _finish(rows: list[tuple[int, int, tuple[int, str], ShardFacts]],
            summary: steps.JobSummary | None, output_dir: str) -> None:
    if summary is not None:  # None: an error was reported, or a resumed run was complete
        steps.finish_job(rows, summary, output_dir)


def pack_beam(job: PackJob, *, beam_options: Sequence[str] = (), quiet: bool = False
              ) -> Manifest:
    """`runners.local.pack_to_dir` as a Beam job; returns the manifest.

    `beam_options`: Beam pipeline options as "KEY=VALUE" (see `pipeline_options`; the
    DirectRunner runs `job.workers` processes). `quiet`: as `job_pipeline`.
    """
    with output_session(job) as out:
        out.remove(ERROR)  # a report of an earlier job
        with job_pipeline(pipeline_options(beam_options, job.workers), quiet) as p:
            build_pipeline(p, job)
        if out.exists(ERROR):
            message = out.read_json(ERROR).get("error", "a worker rejected an input")
            out.remove(ERROR)
            raise InputError(message)
    manifest = read_manifest(job.output)
    _warn_empty(manifest.inputs)
    return manifest


def plan_beam(job: PackJob, step_rows: int | None, *, beam_options: Sequence[str] = (),
              quiet: bool = False) -> tuple[Any, dict, steps.PlanFigures]:
    """`runners.local.plan_job` as a Beam job (inputs scanned and blocks planned by the
    workers, nothing written): (the run's intent, its results, its `PlanFigures`). They come
    back through a file: local with the DirectRunner, else in OUTPUT_DIR (every worker of a
    cluster sees it), removed once read."""
    options = pipeline_options(beam_options, job.workers)
    if not is_direct(options) and not job.output:
        raise UsageError("a dry run on a Beam runner other than the DirectRunner needs an "
                         "output directory every worker sees: its figures come back through a "
                         "file there")
    result = job_report(options, quiet, job.output, "plan", lambda p, report: build_pipeline(
        p, job, dry_run=(report, step_rows)))
    if "error" in result:
        raise InputError(result["error"])
    intent, results, figures = pickle.loads(base64.b64decode(result["plan"]))
    _warn_empty(intent.inputs)
    return intent, results, figures


def _warn_empty(inputs: dict) -> None:
    """Names each input that holds no token, as the local runner does (a worker's warnings
    reach only its own log)."""
    files = inputs["files"]
    check_empty([f["path"] for f in files], [f["num_examples"] for f in files],
                [f["num_tokens"] for f in files])


def job_report(options: Any, quiet: bool, output_dir: str, kind: str,
               build: Callable[[Any, tuple[str, str]], None]) -> dict:
    """Runs the pipeline `build(p, report)` adds, whose last step writes one JSON report to
    `report` (directory, name): a temporary directory here with the DirectRunner, else
    `output_dir` (every worker of a cluster sees it); returns the report, its file removed."""
    with tempfile.TemporaryDirectory(prefix=f"seqpack-{kind}-") as local:
        where = OutputDir(local if is_direct(options) else output_dir)
        report = (where.location, f"{kind}-report-{os.getpid()}.json")
        try:
            with job_pipeline(options, quiet) as p:
                build(p, report)
            return where.read_json(report[1])
        finally:
            where.remove(report[1])


def is_direct(options: Any) -> bool:
    """Whether Beam `options` run the job on this machine (the DirectRunner)."""
    return options.get_all_options().get("runner") in (None, "DirectRunner", "direct")


@contextlib.contextmanager
def job_pipeline(options: Any, quiet: bool) -> Iterator[Any]:
    """A `beam.Pipeline`, run when the block ends, its temporary files in a scratch directory
    removed after (`storage.scratch_tempdir`: Beam's job service and workers leave theirs).
    `quiet`: Beam's log output and its worker processes' stderr go to a temporary file, removed
    after the run unless the job failed unexpectedly (the error names it)."""
    log_path, keep_log = None, False
    if quiet:
        fd, log_path = tempfile.mkstemp(prefix="seqpack-beam-", suffix=".log")
        os.close(fd)
    try:
        with _output_to(log_path), scratch_tempdir("beam"), \
                beam.Pipeline(options=options) as p:
            yield p
    except (InputError, UsageError):
        raise
    except Exception as e:
        if log_path is None:
            raise
        keep_log = True
        raise RuntimeError(f"the Beam job failed: {cause(e)} (Beam's log: {log_path})") from e
    finally:
        if log_path is not None and not keep_log:
            os.remove(log_path)


def cause(e: BaseException) -> str:
    """The innermost exception of a Beam failure, as "Type: message" on one line."""
    while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return f"{type(e).__name__}: {one_line(e)}"


@contextlib.contextmanager
def _output_to(log_path: str | None) -> Iterator[None]:
    """Sends Beam's loggers and file descriptor 2 (worker processes' stderr) to `log_path`."""
    if log_path is None:
        yield
        return
    loggers = [logging.getLogger("apache_beam"), logging.getLogger()]
    saved = [(lg.handlers[:], lg.propagate) for lg in loggers]
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter("%(levelname)s:%(name)s:%(message)s"))
    for lg in loggers:
        lg.handlers[:] = [handler] if lg.name == "apache_beam" or not lg.handlers else lg.handlers
    loggers[0].propagate = False
    sys.stderr.flush()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    stderr = os.dup(2)
    os.dup2(fd, 2)
    try:
        yield
    finally:
        os.dup2(stderr, 2)
        os.close(stderr)
        os.close(fd)
        handler.close()
        for lg, (handlers, propagate) in zip(loggers, saved):
            lg.handlers[:] = handlers
            lg.propagate = propagate
