"""The local runner of the offline job: `seqpack pack` on one machine, in worker processes.

It maps `offline.core`'s steps onto a pool of worker processes (`runners.workers`), with an
I/O of its own: the tokens are read once into a local spill, and each shard gathers its pieces
from there. Memory is bounded by the number of examples, not tokens:

1. read (`runners.read`, shared with verify): every input read once, chunk by chunk, in
   parallel over inputs: its example lengths and fingerprint come back, its tokens go to raw
   spill files in ``spill.tmp/`` (`runners.spill`).
2. plan: the blocks of `block_size` examples (by default about four million), each on its
   own (`core.plan_block`: the same rows for any number of workers); past one block, in the
   worker processes, as many at once as the memory available holds (up to about 160 bytes per
   example of a block: 670 MB at the default size); then `core.finish_plan`.
3. place: each piece's output row (`core.output_rows`), the pieces sorted by it.
4. write: shard by shard, in parallel: `core.shard_plan`, the shard's pieces gathered from the
   spill straight into its rows, `core.write_shard`; then `core.finish_job`.

Rows stored by reference (`--format index`) with no extra columns skip the spill and the
gather: pass 1 reads the inputs for their lengths, fingerprints and dtypes only, and a shard is
its plan.

This process holds the lengths (4 bytes an example) and the placed pieces (16 bytes a piece)
and hands out one shard at a time to each worker; a worker holds one input chunk or one
shard's rows. The bytes are the same for any number of workers, the same as
`packer.pack_ragged` on the whole corpus, and the same as the Beam job's (`runners.beam`).

Output directory::

    rows-00000-of-00003.arrayrecord       rows [0, shard_rows), one SQP1 record per packed row
    rows-00000-of-00003.arrayrecord.done  while the run is incomplete: the shard's rows, size,
                                          sha256, written after it (what --resume trusts)
    ...
    manifest.json                         written last: config, inputs, shards (+ sizes and
                                          sha256), stats, its own digest
    pack_intent.json                      only while a run is incomplete (what --resume checks)
    pack.lock                             while a run writes here (one run per directory)
    spill.tmp/                            while a run writes here (pass 1's tokens)

Crash safety: a shard exists under its final name only when complete, and counts as complete
only with its ``.done`` record; the manifest is written last (temporary name + rename), so a
directory without ``manifest.json`` is never complete. With ``existing="resume"`` the shards of
an interrupted run with the same inputs and options (checked against ``pack_intent.json``) whose
content matches their record are kept, the rest rewritten, and a complete run whose shards no
longer match the manifest is repaired; the result has the same bytes as an uninterrupted run
(deterministic plan and writer, no timestamps in the manifest). A resumed run reads the inputs
again (pass 1 keeps nothing across runs: the spill is a cache of this run). An interrupt or a
failure kills the worker processes at once and leaves that resumable state.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import os
import shutil
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from seqpack.packer import PackConfig, PackPlan
from seqpack.packer.plan import MapBlocks
from seqpack.pipelines.formats import inputs
from seqpack.pipelines.formats.manifest import Manifest, read_manifest
from seqpack.pipelines.offline import core
from seqpack.pipelines.offline.core import LENGTH, ROW, BlockPlan, FileSummary, JobSummary
from seqpack.pipelines.offline.job import SPILL_DIR, PackJob, available_memory, output_session
from seqpack.pipelines.offline.mixture import Selection, select_inputs
from seqpack.pipelines.offline.outdir import OutputDir
from seqpack.pipelines.offline.record import ShardFacts
from seqpack.pipelines.offline.runners.read import (
    Pass1,
    Progress,
    delay_seconds,
    load_context,
    read_inputs,
    save_context,
)
from seqpack.pipelines.offline.runners.spill import ExampleStarts, Run, SpillReader
from seqpack.pipelines.offline.runners.workers import Workers
from seqpack.pipelines.offline.shards import WriteOptions
from seqpack.pipelines.offline.steps import PlanFigures, plan_figures

# (shard, rows, (size, sha256), order profile and loss tokens): a written shard, as
# `core.finish_job` takes it
Written = tuple[int, int, tuple[int, str], ShardFacts]


def pack_to_dir(job: PackJob, *, progress: Progress | None = None) -> Manifest:
    """Reads, plans, writes shards, then the manifest; returns the manifest.

    `job.workers` processes read inputs and write shards (1 runs everything in this process);
    the output does not depend on it. An interrupt (KeyboardInterrupt) or a failure kills the
    workers at once and leaves a state that the same job with ``existing="resume"`` finishes.
    """
    with output_session(job) as out:
        spill_dir = os.path.join(out.staging(), SPILL_DIR)  # a local directory either way
        shutil.rmtree(spill_dir, ignore_errors=True)  # a killed run's
        os.makedirs(spill_dir)
        pool = Workers(job.num_workers)
        try:
            manifest = _run(job, out, spill_dir, pool, progress)
        except BaseException:
            pool.close(kill=True)
            raise
        pool.close()
        return manifest


_PLAN_BYTES = 160  # a block's planning memory per example, at most


def plan_map(pool: Workers, block_size: int, num_examples: int) -> MapBlocks | None:
    """How blocks are planned: in `pool`'s workers, as many at once as the memory available
    holds (`_PLAN_BYTES` per example of a block, lengths and rows in flight included), or None
    (one block after the other in this process) where that is one."""
    block = min(block_size, max(1, num_examples))
    available = available_memory()
    jobs = pool.n if available is None else min(pool.n, available // (block * _PLAN_BYTES))
    if jobs <= 1:
        return None
    return lambda fn, calls, n: pool.map(fn, calls, n, what="planning blocks", in_flight=jobs)


@dataclasses.dataclass(frozen=True)
class _RunContext:
    """What every worker needs for pass 2, written once to the spill directory."""

    output_dir: str
    stage: str  # where shards are written before they are published (output_dir when local)
    summary: JobSummary
    config: PackConfig
    options: WriteOptions
    runs: list[Run]  # the spill, inputs back to back
    column_runs: dict[str, list[Run]]  # each extra column's spill, at the tokens' positions
    spilled: bool = True  # False: rows by reference with no extra columns, no spill


def _run(job: PackJob, out: OutputDir, spill_dir: str, pool: Workers,
         progress: Progress | None) -> Manifest:
    spill = not job.plan_only
    read, files, lengths, plans, mixed = _read_and_plan(job, spill_dir if spill else None,
                                                        pool, progress)
    runs, column_runs = read.runs, read.column_runs
    del read
    summary = core.finish_plan(files, [bp.summary for bp in plans], job, rerun=False,
                               mixture=mixed)
    if summary is None:  # a resumed run that had finished
        return read_manifest(job.output, check_shards=False)
    table = _place(plans, summary)
    starts = ExampleStarts.of(lengths)
    del lengths
    context = _RunContext(out.location, out.staging(), summary, job.config, job.write_options,
                          runs, column_runs, spill)
    written = write_shards(table, starts, context, pool, save_context(spill_dir, context),
                           resume=job.resume, progress=progress)
    return core.finish_job(written, summary, out)


def plan_job(job: PackJob, step_rows: int | None = None, *, progress: Progress | None = None
             ) -> tuple[Any, dict, PlanFigures]:
    """What `pack_to_dir` plans, with no output: every input read (its tokens checked, not
    kept), the blocks planned and summed up (`core.summarize_plan`); (the run's intent, its
    results, what a dry run shows of the pieces in their output rows: `steps.plan_figures`,
    steps of `step_rows` rows). Nothing is written (`seqpack pack --dry-run`)."""
    pool = Workers(job.num_workers)
    try:
        _, files, _, plans, mixed = _read_and_plan(job, None, pool, progress)
        summary = core.summarize_plan(files, [bp.summary for bp in plans], job, mixture=mixed)
        figures = functools.reduce(operator.add, [plan_figures(bp, summary, step_rows)
                                                  for bp in plans])
    except BaseException:
        pool.close(kill=True)
        raise
    pool.close()
    return summary.intent, summary.results, figures


def _read_and_plan(job: PackJob, spill_dir: str | None, pool: Workers,
                   progress: Progress | None
                   ) -> tuple[Pass1, list[FileSummary], np.ndarray, list[BlockPlan], dict | None]:
    """Pass 1 (`read_inputs`: into `spill_dir`, None: no spill) and the blocks' plans: (pass
    1 without its scans, the inputs' summaries, every example's length, the plans, a mixture's
    record)."""
    read = read_inputs(job.inputs, job.read_options, spill_dir, pool, progress,
                       loss_columns=job.mix_loss_columns)
    files, lengths = _corpus(job, read.scans)
    mixed = None if job.mixture is None else select_inputs(
        job.mixture, [s.lengths for s in read.scans], [s.loss_counts for s in read.scans],
        job.block_size)
    read = dataclasses.replace(read, scans=[])  # 8 bytes an example
    plans = _plan_blocks(lengths, files, job, pool, mixed)
    return read, files, lengths, plans, None if mixed is None else mixed.record


def _corpus(job: PackJob, scans: list[inputs.FileScan]) -> tuple[list[FileSummary], np.ndarray]:
    """Each input's summary, checked (`core.check_files`), and every example length: i32
    while they fit, 4 bytes an example from here on."""
    files = core.check_files([core.summarize_file(core.FileScan.of(i, path, s), job.config)
                              for i, (path, s) in enumerate(zip(job.inputs, scans))], job)
    small = core.longest(files) < 2**31
    lengths = np.empty(sum(f.num_examples for f in files), np.int32 if small else np.int64)
    np.concatenate([s.lengths for s in scans], out=lengths, casting="same_kind")
    return files, lengths


def _plan_blocks(lengths: np.ndarray, files: list[FileSummary], job: PackJob, pool: Workers,
                 mixed: Selection | None = None) -> list[BlockPlan]:
    """`core.plan_block` on each block of `job.block_size` examples (of the mixed stream
    with a mixture), in the workers where `plan_map` says so, else one after the other here."""
    size = job.block_size
    if mixed is not None:
        lengths = mixed.lengths
    count = -(-lengths.size // size)
    plan = functools.partial(core.plan_block, top=core.longest(files),
                             firsts=None if mixed is None else core.dataset_firsts(job, files))
    calls: Iterator[tuple[Any, ...]] = ((j, lengths[j * size : (j + 1) * size], job) + (
        () if mixed is None else (mixed.ref[j * size : (j + 1) * size],)) for j in range(count))
    mapped = plan_map(pool, size, lengths.size) if count > 1 else None
    if mapped is None:
        return [plan(*call) for call in calls]
    return list(mapped(plan, calls, count))


def _place(plans: list[BlockPlan], summary: JobSummary) -> np.ndarray:
    """[4, P]: every piece (example, start, length, output row) sorted by output row, i32
    where every value fits; empties `plans` as each block's pieces are taken."""
    if len(plans) == 1 and summary.intent.num_rows < 2**31:
        bp = plans.pop()
        table = bp.pieces  # the block's own table, its rows made output rows in place
        table[ROW] = core.output_rows(bp, summary)
    else:
        fits = summary.intent.num_rows < 2**31 and all(bp.pieces.dtype == np.int32
                                                         for bp in plans)
        table = np.empty((4, sum(bp.pieces.shape[1] for bp in plans)),
                         np.int32 if fits else np.int64)
        at = 0
        while plans:
            bp = plans.pop(0)
            n = bp.pieces.shape[1]
            table[:ROW, at : at + n] = bp.pieces[:ROW]
            table[ROW, at : at + n] = core.output_rows(bp, summary)
            at += n
    by_row = np.argsort(table[ROW], kind="stable")  # within a row: the plan's (example) order
    for k in range(4):
        table[k] = table[k][by_row]  # one column at a time: 4 more bytes a piece, not 16
    return table


@dataclasses.dataclass(frozen=True)
class _ShardTask:
    index: int
    plan: PackPlan  # the shard's rows, numbered from 0
    src: np.ndarray  # i64[P] global token position of each piece


def _context(path: str) -> tuple[_RunContext, SpillReader, dict[str, SpillReader]]:
    context = load_context(path)
    columns = {name: SpillReader(runs) for name, runs in context.column_runs.items()}
    return context, SpillReader(context.runs), columns


def _write_task(context_path: str, task: _ShardTask) -> Written:
    """Pass 2 for one shard: gathers its pieces (tokens, then each extra column at the same
    positions) from the spill straight into its rows, writes it (`core.write_shard`)."""
    context, spill, column_spills = _context(context_path)
    p, config, summary = task.plan, context.config, context.summary
    R, L = p.num_rows, config.seq_len
    dst = p.row * L + p.offset

    def gather(reader: SpillReader, dtype: str, pad: int) -> np.ndarray:
        values = np.full(R * L, pad, np.dtype(dtype))
        reader.read_into(values, dst, task.src, p.length)
        return values.reshape(R, L)

    # rows by reference with no extra columns: nothing spilled, nothing to gather
    values = gather(spill, summary.row_dtype, config.pad_id) if context.spilled else None
    columns = {c["name"]: gather(column_spills[c["name"]], c["dtype"], c["pad"])
               for c in summary.intent.columns or []}
    out = OutputDir(context.output_dir, stage=context.stage)
    return (task.index, *core.write_shard(out, task.index, p, summary, config, context.options,
                                     values=values, columns=columns))


def _shard_tasks(table: np.ndarray, cuts: np.ndarray, starts: ExampleStarts,
                 summary: JobSummary, config: PackConfig, todo: list[int]
                 ) -> Iterator[_ShardTask]:
    for i in todo:
        p, _ = core.shard_plan(table[:, cuts[i] : cuts[i + 1]], i, summary, config)
        yield _ShardTask(i, p, starts(p.example) + p.start)


def write_shards(table: np.ndarray, starts: ExampleStarts, context: _RunContext,
                 workers: Workers, context_path: str, *, resume: bool = False,
                 progress: Progress | None = None) -> list[Written]:
    """Pass 2: every shard not already complete and intact (`core.kept_shard`), in parallel;
    returns each shard's rows, (size, sha256) and `ShardFacts`. `table`: `_place`'s."""
    summary = context.summary
    names = summary.intent.shards
    firsts = np.arange(len(names) + 1, dtype=np.int64) * summary.shard_rows
    cuts = np.searchsorted(table[ROW], firsts).astype(np.int64)  # shard i: [cuts[i], cuts[i+1])
    tokens = np.add.reduceat(table[LENGTH], cuts[:-1], dtype=np.int64)  # no shard is empty
    if progress:
        progress.phase("writing", int(tokens.sum()))
    written: list[Written] = []
    todo, done = [], 0
    out = OutputDir(context.output_dir, stage=context.stage)
    for i in range(len(names)):
        kept = core.kept_shard(out, i, table[:, cuts[i] : cuts[i + 1]], summary) if resume else None
        if kept is not None:
            written.append((i, *kept))
            done += kept[0]
            if progress:
                progress.advance(int(tokens[i]), done)
        else:
            todo.append(i)
    delay = delay_seconds()
    tasks = _shard_tasks(table, cuts, starts, summary, context.config, todo)
    calls = ((context_path, t) for t in tasks)
    for shard in workers.map(_write_task, calls, len(todo), what="writing shards"):
        written.append(shard)
        done += shard[1]
        if progress:
            progress.advance(int(tokens[shard[0]]), done)
        if delay:
            time.sleep(delay)
    return written
