"""The local runner of the offline job: `seqpack pack` on one machine, in worker processes.

Two passes, memory bounded by the number of examples, not tokens:

1. read (`offline.read`, shared with verify): every input read once, chunk by chunk, in
   parallel over inputs: its example lengths and fingerprint come back, its tokens go to raw
   spill files in ``spill.tmp/`` (`offline.spill`).
2. plan: one plan on all the lengths (`packer.plan_rows`: best fit decreasing sees every example
   of a block of `block_size` examples, by default about four million), 4 bytes a piece; past
   one block, the blocks are planned in the worker processes (each block on its own: the same
   rows for any number of workers), as many at once as the memory available holds (up to
   about 160 bytes per example of a block: 670 MB at the default size).
3. write: shard by shard, in parallel: the shard's pieces are gathered from the spill straight
   into its rows and written by `offline.shards.write_shard`.

The main process holds a few dozen bytes per example (lengths, the plan, each piece's source:
27 bytes an added example measured at 48x chat_dev) and hands out one shard at a time to each
worker; a worker holds one input chunk or one shard's rows. The bytes are the same for any
number of workers, the same as `packer.pack_ragged` on the whole corpus, and the same as the
Beam job's (`offline.beam`).

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

import numpy as np

from seqpack.packer import Counters, PackConfig, PackPlan
from seqpack.packer.order import CostModel, RowOrder, StepBalance, ordered
from seqpack.packer.plan import RowAssignment, order_pieces, pieces, plan_rows
from seqpack.packer.stats import (
    CostSummary,
    cost_summary,
    row_histograms,
    stats_from_histograms,
)
from seqpack.pipelines.errors import InputError
from seqpack.pipelines.formats.inputs import FileScan, corpus_dtype, extra_corpus_dtypes
from seqpack.pipelines.formats.manifest import Manifest
from seqpack.pipelines.offline.job import PackJob, available_memory, output_session
from seqpack.pipelines.offline.outdir import OutputDir, commit_manifest, prepare_dir, shard_done
from seqpack.pipelines.offline.read import (
    Progress,
    delay_seconds,
    load_context,
    read_inputs,
    save_context,
)
from seqpack.pipelines.offline.record import (
    along_output,
    check_overlength,
    column_entries,
    first_overlength,
    inputs_record,
    length_histogram,
    manifest_results,
    order_profile,
    run_intent,
)
from seqpack.pipelines.offline.shards import WriteOptions, row_dtype, write_shard
from seqpack.pipelines.offline.spill import SPILL_DIR, Run, SpillReader
from seqpack.pipelines.offline.workers import Workers


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


_PLAN_BYTES = 160  # a block's planning memory per example, at most (110 measured at 2048 / 8)


def plan_map(pool: Workers, block_size: int, num_examples: int):
    """How `plan_rows` maps its blocks: in `pool`'s workers, as many at once as the memory
    available holds (`_PLAN_BYTES` per example of a block, lengths and rows in flight
    included), or None (one block after the other in this process) where that is one."""
    block = min(block_size, max(1, num_examples))
    available = available_memory()
    jobs = pool.n if available is None else min(pool.n, available // (block * _PLAN_BYTES))
    if jobs <= 1:
        return None
    return lambda fn, calls, n: pool.map(fn, calls, n, what="planning blocks", in_flight=jobs)


def _run(job: PackJob, out: OutputDir, spill_dir: str, pool: Workers,
         progress: Progress | None) -> Manifest:
    config = job.config
    read = read_inputs(job.inputs, job.read_options, spill_dir, pool, progress)
    lengths, inputs = _corpus(job, read.scans)
    dtype = np.dtype(inputs["token_dtype"])
    columns = column_entries(job, extra_corpus_dtypes(read.scans))
    assignment = plan_rows(lengths, config, block_size=job.block_size,
                           map_blocks=plan_map(pool, job.block_size, lengths.size))
    intent = run_intent(job, inputs, assignment.num_rows, columns)
    done = prepare_dir(out, intent, overwrite=job.overwrite, resume=job.resume)
    if done is not None:
        return done
    ps, costs, balance = _sorted_pieces(assignment, lengths, config, job.order)
    s = stats_from_histograms(*row_histograms(ps.row, ps.length, assignment.num_rows,
                                              config.seq_len, config.max_segments),
                              config.seq_len, assignment.counters, costs=costs)
    results = manifest_results(s, length_histogram(lengths), along_output(
        order_profile(ps.row, ps.length, assignment.num_rows), assignment.num_rows), balance)
    offsets = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    del lengths, assignment
    context = _RunContext(out.location, out.staging(), config, job.write_options,
                          row_dtype(dtype, config.pad_id).str, read.runs,
                          [(c["name"], c["dtype"], c["pad"], read.column_runs[c["name"]])
                           for c in columns])
    rows, digests = write_shards(ps, offsets, context, intent.shards, pool,
                                 save_context(spill_dir, context), resume=job.resume,
                                 progress=progress)
    return commit_manifest(out, intent, rows, results, digests)


def _corpus(job: PackJob, scans: list[FileScan]) -> tuple[np.ndarray, dict]:
    """Every example length (i32 while they fit: 4 bytes an example from here on) and the
    manifest's inputs record; InputError for inputs with no tokens, or an over-length example
    that the overflow policy refuses (named by file and record)."""
    lengths = np.concatenate([s.lengths for s in scans])
    if not lengths.sum():
        raise InputError(f"the inputs hold no tokens ({lengths.size} examples); nothing to pack")
    check_overlength(job.inputs, [first_overlength(s.lengths, job.config) for s in scans],
                     job.config)
    if lengths.max() < 2**31:
        lengths = lengths.astype(np.int32)
    dtype = corpus_dtype([s.dtype for s in scans])
    return lengths, inputs_record([s.info for s in scans], dtype, job.read_options)


@dataclasses.dataclass(frozen=True)
class _RunContext:
    """What every worker needs for pass 2, written once to the spill directory."""

    output_dir: str
    stage: str  # where shards are written before they are published (output_dir when local)
    config: PackConfig
    options: WriteOptions
    dtype: str  # the rows' token dtype
    runs: list[Run]  # the spill, inputs back to back
    columns: list[tuple[str, str, int, list[Run]]]  # extra columns: name, dtype, pad, spill


@dataclasses.dataclass(frozen=True)
class _ShardTask:
    index: int
    name: str
    plan: PackPlan  # the shard's rows, numbered from 0
    src: np.ndarray  # i64[P] global token position of each piece


def _context(path: str) -> tuple[_RunContext, SpillReader, dict[str, SpillReader]]:
    context = load_context(path)
    columns = {name: SpillReader(runs) for name, _, _, runs in context.columns}
    return context, SpillReader(context.runs), columns


def _write_task(context_path: str, task: _ShardTask) -> tuple[int, int, tuple[int, str]]:
    """Pass 2 for one shard: gathers its pieces (tokens, then each extra column at the same
    positions) from the spill straight into its rows, writes it; (index, rows, (size,
    sha256))."""
    context, spill, column_spills = _context(context_path)
    p, config = task.plan, context.config
    R, L = p.num_rows, config.seq_len
    dst = p.row * L + p.offset

    def gather(reader: SpillReader, dtype: str, pad: int) -> np.ndarray:
        values = np.full(R * L, pad, np.dtype(dtype))
        reader.read_into(values, dst, task.src, p.length)
        return values.reshape(R, L)

    values = gather(spill, context.dtype, config.pad_id)
    columns = {name: gather(column_spills[name], dtype, pad)
               for name, dtype, pad, _ in context.columns}
    out = OutputDir(context.output_dir, stage=context.stage)
    digest = write_shard(out, task.name, None, p, config, context.options, dtype=values.dtype,
                         values=values, columns=columns)
    return task.index, p.num_rows, digest


@dataclasses.dataclass(frozen=True)
class _Pieces:
    """Every piece of a `RowAssignment`, sorted by row: where it comes from and where it goes."""

    example: np.ndarray  # i64[P]
    start: np.ndarray  # i32/i64[P]
    length: np.ndarray  # i32/i64[P]
    row: np.ndarray  # i32/i64[P]: output row (the plan's row put in the run's order), sorted
    bounds: np.ndarray  # i64[R + 1]: pieces of output row r are [bounds[r], bounds[r + 1])


def _sorted_pieces(a: RowAssignment, lengths: np.ndarray, config: PackConfig,
                   order: RowOrder) -> tuple[_Pieces, CostSummary, StepBalance | None]:
    """12 bytes a piece (16 past 2**31 examples), plus the row, its output row (`order`); the
    piece order is (output row, example, start): within a row, the plan's. And the rows' cost
    summary, block by block as the Beam job sums it, and the steps' balance (BALANCED)."""
    small = np.int32 if int(lengths.max(initial=0)) < 2**31 else np.int64
    example = np.empty(a.num_pieces, np.int32 if lengths.size < 2**31 else np.int64)
    start = np.empty(a.num_pieces, small)
    length = np.empty(a.num_pieces, small)
    at = 0
    for e, s, n in pieces(lengths, config, block_size=a.block_size):
        example[at : at + e.size], start[at : at + e.size], length[at : at + e.size] = e, s, n
        at += e.size
    blocks = _Blocks.of(a, example, lengths.size)
    costs = blocks.cost_summary(a, length, config.seq_len, order.cost)
    out, balance = output_rows(a, length, blocks, order)
    row = out.astype(a.row.dtype)[a.row]  # 4 bytes a piece
    del out
    by_row = np.argsort(row, kind="stable")
    example = example[by_row]  # one array at a time: one extra copy alive, not three
    start = start[by_row]
    length = length[by_row]
    row = row[by_row]
    del by_row
    bounds = np.zeros(a.num_rows + 1, np.int64)
    np.cumsum(np.bincount(row, minlength=a.num_rows), out=bounds[1:])
    return _Pieces(example, start, length, row, bounds), costs, balance


@dataclasses.dataclass(frozen=True)
class _Blocks:
    """The plan's blocks (`block_size` consecutive examples each): their pieces and rows."""

    pieces: np.ndarray  # i64[B + 1]: block j's pieces (input order) are [pieces[j], pieces[j+1])
    rows: np.ndarray  # i64[B + 1]: block j's plan rows are [rows[j], rows[j + 1])

    @classmethod
    def of(cls, a: RowAssignment, example: np.ndarray, num_examples: int) -> _Blocks:
        n = -(-num_examples // a.block_size)
        firsts = np.arange(n + 1, dtype=np.int64) * a.block_size
        pieces = np.searchsorted(example, firsts).astype(np.int64)
        rows = np.zeros(n + 1, np.int64)
        for j in range(n):  # a block's rows follow the previous block's
            mine = a.row[pieces[j] : pieces[j + 1]]
            rows[j + 1] = int(mine.max()) + 1 if mine.size else rows[j]
        return cls(pieces, rows)

    def cost_summary(self, a: RowAssignment, length: np.ndarray, seq_len: int,
                     model: CostModel) -> CostSummary:
        """The rows' `CostSummary`, one block after another (the Beam job's sum)."""
        parts = [cost_summary(a.row[p0:p1] - r0, length[p0:p1], r1 - r0, seq_len, model)
                 for p0, p1, r0, r1 in zip(self.pieces[:-1].tolist(), self.pieces[1:].tolist(),
                                           self.rows[:-1].tolist(), self.rows[1:].tolist())]
        return functools.reduce(operator.add, parts)


def output_rows(a: RowAssignment, length: np.ndarray, blocks: _Blocks, order: RowOrder
                ) -> tuple[np.ndarray, StepBalance | None]:
    """i64[R]: the output row of each plan row under `order`, block by block of the plan
    (`packer.order`: each block's layout from its rows' costs, then the global step) exactly
    as the Beam job computes it, and the steps' balance (`GlobalOrder.balance`). `length`: the
    plan's pieces' lengths, in input order."""
    costs, base = order.row_costs(a.row, length, a.num_rows), blocks.rows
    g, layouts = ordered([costs[base[j] : base[j + 1]] for j in range(base.size - 1)], order)
    return g.output_positions(np.arange(a.num_rows), layouts), g.balance


def _shard_tasks(ps: _Pieces, offsets: np.ndarray, config: PackConfig, names: list[str],
                 shard_rows: int, todo: list[int]) -> Iterator[_ShardTask]:
    num_rows = ps.bounds.size - 1
    for i in todo:
        r0, r1 = i * shard_rows, min((i + 1) * shard_rows, num_rows)
        a, b = int(ps.bounds[r0]), int(ps.bounds[r1])
        example = ps.example[a:b].astype(np.int64)
        start = ps.start[a:b].astype(np.int64)
        p = order_pieces(example, start, ps.length[a:b].astype(np.int64),
                         ps.row[a:b].astype(np.int64) - r0, r1 - r0, Counters(), config)
        assert p.example is example or np.array_equal(p.example, example)
        yield _ShardTask(i, names[i], p, offsets[example] + start)


def write_shards(ps: _Pieces, offsets: np.ndarray, context: _RunContext, names: list[str],
                 workers: Workers, context_path: str, *, resume: bool = False,
                 progress: Progress | None = None
                 ) -> tuple[list[int], list[tuple[int, str]]]:
    """Pass 2: every shard not already complete and intact, in parallel; returns the rows and
    (size, sha256) of each shard."""
    shard_rows = context.options.shard_rows
    num_rows = ps.bounds.size - 1
    rows = [min(shard_rows, num_rows - i * shard_rows) for i in range(len(names))]
    tokens = [int(ps.length[ps.bounds[i * shard_rows] : ps.bounds[i * shard_rows + r]].sum())
              for i, r in enumerate(rows)]
    if progress:
        progress.phase("writing", sum(tokens))
    todo, done = [], 0
    out = OutputDir(context.output_dir, stage=context.stage)
    digests: list[tuple[int, str]] = [(0, "")] * len(names)
    for i, name in enumerate(names):
        kept = shard_done(out, name, rows[i]) if resume else None
        if kept is not None:
            digests[i] = kept
            done += rows[i]
            if progress:
                progress.advance(tokens[i], done)
        else:
            todo.append(i)
    delay = delay_seconds()
    tasks = _shard_tasks(ps, offsets, context.config, names, shard_rows, todo)
    calls = ((context_path, t) for t in tasks)
    for i, n, digest in workers.map(_write_task, calls, len(todo), what="writing shards"):
        assert n == rows[i]
        digests[i] = digest
        done += n
        if progress:
            progress.advance(tokens[i], done)
        if delay:
            time.sleep(delay)
    return rows, digests
