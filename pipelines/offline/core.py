"""The offline job's steps, written once for every runner: plan and summarize a block, finish
the plan, place each piece, plan and write a shard, write the manifest.

For n examples in B blocks of `block_size` consecutive examples (inputs in the order given,
examples in file order) and shards of `shard_rows` output rows::

    (read, scan)    one input                -> FileScan: its lengths, fingerprint, dtype (each
                                                runner reads its own way: `runners.read` into
                                                a local spill, `steps.scan_file` without one)
    summarize_file  one input's FileScan     -> FileSummary: the scan without its lengths
    check_files     every FileSummary           InputError: a bad input (`record.check_inputs`,
                                                check_overlength), no tokens at all
    plan_block      one block's lengths      -> BlockPlan: its pieces [4, P_b] (example, start,
                                                length, row in the block) + BlockSummary (rows,
                                                counters, histograms, costs, the block's
                                                `packer.order` layout: a few KB)
    finish_plan     every FileSummary and
                    BlockSummary             -> JobSummary (intent, stats, each block's first
                                                row, the global order); pack_intent.json
    output_rows     one BlockPlan            -> the output row of each of its pieces
    shard_plan      one shard's pieces       -> its PackPlan (rows from 0)
    write_shard     a shard's plan + tokens  -> the shard file: (rows, (size, sha256), profile)
    kept_shard      a shard's pieces            the same, for a shard `resume` keeps
    finish_job      every shard's result     -> manifest.json

Runners map these steps onto their executors and move the data their own way (`runners.local`
gathers each shard's tokens from a local spill; Beam and Spark route them with `offline.steps`);
all plan the same blocks with the same functions, so the bytes depend on neither the runner nor
the workers. Nothing here knows an executor. `finish_job` refuses shards that hold other
tokens than the plan placed (a runner that lost or repeated records).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import operator
from collections.abc import Iterable, Sequence

import numpy as np

from seqpack.packer import Counters, PackConfig, PackPlan
from seqpack.packer.inputs import check_lengths
from seqpack.packer.order import BlockLayout, GlobalOrder, block_layout, global_order
from seqpack.packer.plan import aligned, order_pieces, pieces, plan_block_rows
from seqpack.packer.stats import (
    CostSummary,
    alignment_slack,
    cost_summary,
    row_histograms,
    stats_from_histograms,
)
from seqpack.pipelines.errors import InputError, RunFailed, one_line
from seqpack.pipelines.formats import inputs
from seqpack.pipelines.formats.encodings import of_manifest
from seqpack.pipelines.formats.manifest import Manifest
from seqpack.pipelines.offline import record, shards
from seqpack.pipelines.offline.job import PackJob
from seqpack.pipelines.offline.mixture import firsts_of, piece_units
from seqpack.pipelines.offline.outdir import (
    OutputDir,
    as_output_dir,
    commit_manifest,
    prepare_dir,
    records_run,
    refuse_incomplete,
    shard_done,
)
from seqpack.pipelines.offline.shards import WriteOptions, row_dtype

log = logging.getLogger("seqpack")

# Rows of the piece tables ([4, P]: BlockPlan, and the tables runners build from it).
EXAMPLE, START, LENGTH, ROW = range(4)

# What writing a shard gives: its rows, (size, sha256), its part of the order profile and its
# loss tokens.
ShardResult = tuple[int, tuple[int, str], record.ShardFacts]


@dataclasses.dataclass(frozen=True)
class FileScan:
    """One input's lengths (or why it cannot be read), as a runner's read step gives them."""

    index: int  # position of the input in the job's list
    path: str
    info: dict  # the manifest's entry: fingerprint, format, counts, lengths digest
    lengths: np.ndarray  # i64[n_f] example lengths, in file order
    dtype: str  # numpy dtype of the file's token ids
    error: str | None = None  # the InputError's message when the file could not be read
    extra_dtypes: dict = dataclasses.field(default_factory=dict)  # extra column -> its dtype
    extra_ranges: dict = dataclasses.field(default_factory=dict)  # extra column -> (min, max)
    loss_counts: np.ndarray | None = None  # i64[n_f] loss tokens per example, when asked for
    top: int = 0  # its largest token id

    @classmethod
    def of(cls, index: int, path: str, scan: inputs.FileScan) -> FileScan:
        return cls(index, path, scan.info, scan.lengths, scan.dtype.str, None,
                   scan.extra_dtypes, scan.extra_ranges, scan.loss_counts, scan.top)


@dataclasses.dataclass(frozen=True)
class FileSummary:
    """A FileScan without its lengths: what the job's one global step sees of an input."""

    index: int
    path: str
    info: dict
    num_examples: int
    dtype: str
    max_length: int
    error: str | None = None
    # (index, length, count) of its first example over seq_len with overflow="error"
    overlength: tuple[int, int, int] | None = None
    extra_dtypes: dict = dataclasses.field(default_factory=dict)  # as in FileScan
    extra_ranges: dict = dataclasses.field(default_factory=dict)
    top: int = 0  # its largest token id


@dataclasses.dataclass(frozen=True)
class BlockSummary:
    """What the global step needs of a planned block."""

    block: int
    num_rows: int
    counters: Counters
    used_hist: np.ndarray  # rows holding u tokens, u = 0..L
    nseg_hist: np.ndarray  # rows holding k segments, k = 0..S
    length_counts: np.ndarray  # the block's examples in the manifest's 50 length bins
    error: str | None = None  # an InputError while planning (over-length with overflow="error")
    layout: BlockLayout | None = None  # the block's `packer.order` summary (leftover rows)
    costs: CostSummary | None = None  # its rows' costs under the run's cost model
    longest: int = 0  # its longest segment
    min_row_next: int | None = None  # the fewest (tokens - segments) of a row; None: no rows
    slack: int = 0  # tokens the segment alignment adds (`packer.stats.alignment_slack`)


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """One planned block: its summary, its pieces and the layout of its rows."""

    summary: BlockSummary
    # [4, P_b]: example (global), start, length, row (in the block), in input order; i32
    # where every value fits (16 bytes a piece), else i64
    pieces: np.ndarray
    layout: BlockLayout | None = None  # where its rows go in the output (`packer.order`)


@dataclasses.dataclass(frozen=True)
class JobSummary:
    """The small, global part of the plan that the shard writers and the manifest step need."""

    intent: Manifest  # pack_intent.json: config, inputs, shard names, row count
    results: dict  # the manifest's stats and example length histogram
    row_dtype: str  # dtype of the rows' tokens
    shard_rows: int
    row_base: list[int]  # first row of each block
    order: GlobalOrder | None = None  # the output order (`packer.order`; compact)


# -- inputs ------------------------------------------------------------------------------------


def summarize_file(scan: FileScan, config: PackConfig) -> FileSummary:
    return FileSummary(scan.index, scan.path, scan.info, int(scan.lengths.size), scan.dtype,
                       int(scan.lengths.max(initial=0)), scan.error,
                       record.first_overlength(scan.lengths, config), scan.extra_dtypes,
                       scan.extra_ranges, scan.top)


def first_examples(files: Sequence[FileSummary]) -> np.ndarray:
    """Global index of each input's first example (inputs in job order), plus the total."""
    counts = [f.num_examples for f in sorted(files, key=lambda f: f.index)]
    return np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))


def dataset_firsts(job: PackJob, files: Sequence[FileSummary]) -> np.ndarray | None:
    """The first corpus example of each dataset of the job's mixture, when its steps of two
    or more rows deal rows by dataset share (`plan_block(firsts=)`); else None."""
    if job.mixture is None or job.order.step_rows <= 1:
        return None
    inputs = np.cumsum([0, *(len(paths) for _, paths in job.mixture.datasets)])
    return first_examples(files)[inputs[:-1]]


def longest(files: Iterable[FileSummary]) -> int:
    """The longest example of the inputs: the top of the manifest's length histogram."""
    return max((f.max_length for f in files), default=0)


def check_files(files: Iterable[FileSummary], job: PackJob, *, warn: bool = True
                ) -> list[FileSummary]:
    """The inputs in job order; InputError for the first bad input (in input order), then
    `record.check_inputs` and `record.check_overlength`, then inputs that hold no tokens
    (each one named in a warning, unless `warn` is False: checked again)."""
    files = sorted(files, key=lambda f: f.index)
    assert [f.index for f in files] == list(range(len(files))), "an input is missing"
    for f in files:
        if f.error is not None:
            raise InputError(f.error)
    record.check_inputs([(f.path, str(f.info["format"]), f.top) for f in files], job)
    record.check_overlength([f.path for f in files], [f.overlength for f in files], job.config)
    record.check_empty([f.path for f in files], [f.num_examples for f in files],
                       [int(f.info["num_tokens"]) for f in files], warn=warn)
    return files


# -- plan --------------------------------------------------------------------------------------


def plan_block(block: int, lengths: np.ndarray, job: PackJob, refs: np.ndarray | None = None,
               *, top: int, firsts: np.ndarray | None = None) -> BlockPlan:
    """Plans block `block` (its examples' `lengths`, numbered from `block * job.block_size`)
    as `packer.plan_rows` plans it, and lays its rows out for the output order
    (`packer.order.block_layout` on the rows' costs and segment counts). `top`: the inputs'
    longest example (`longest`). An InputError while planning becomes the summary's `error`.
    `refs`: a mixture's block (its examples are `refs[i]` of the corpus, `mixture.select`):
    the pieces then name those, in their order; `firsts` (its datasets' first corpus examples)
    deal its rows into steps that hold the datasets' shares (`block_layout(units=)`)."""
    config, order = job.config, job.order
    first = block * job.block_size
    counts = np.array(record.length_histogram(lengths, top)["counts"], np.int64)
    try:
        lengths = check_lengths(lengths, first=first)  # i64, as `plan_rows` plans a block
        row, num_rows, counters = plan_block_rows(lengths, config, first)
    except InputError as e:
        empty = np.zeros(0, np.int64)
        summary = BlockSummary(block, 0, Counters(), empty, empty, counts, error=one_line(e))
        return BlockPlan(summary, np.zeros((4, 0), np.int64))
    table = _piece_table(lengths, job, first, row, num_rows)
    del row
    if refs is not None:
        table = _to_corpus(table, refs, first)
    L, S = config.seq_len, config.max_segments
    used, nseg = row_histograms(table[ROW], table[LENGTH], num_rows, L, S)
    segments = np.bincount(table[ROW], minlength=num_rows) if order.data_parallel else None
    units = None if firsts is None or job.mixture is None else piece_units(
        job.mixture.mix_unit, table, firsts, num_rows)
    layout = block_layout(order.row_costs(table[ROW], table[LENGTH], num_rows), order,
                          block=block, segments=segments, units=units)
    summary = BlockSummary(block, num_rows, counters, used, nseg, counts,
                           layout=layout.summary(),
                           costs=cost_summary(table[ROW], table[LENGTH], num_rows, L,
                                              order.cost),
                           longest=int(table[LENGTH].max(initial=0)),
                           min_row_next=record.min_row_next(table[ROW], table[LENGTH], num_rows),
                           slack=alignment_slack(table[LENGTH], config.alignment))
    return BlockPlan(summary, table, layout)


def _piece_table(lengths: np.ndarray, job: PackJob, first: int, row: np.ndarray,
                 num_rows: int) -> np.ndarray:
    """[4, P]: the block's pieces (re-derived part by part from the lengths, as
    `packer.plan.pieces` cuts them) and their rows; i32 where every value fits."""
    fits = max(first + lengths.size, int(lengths.max(initial=0)), num_rows) < 2**31
    table = np.empty((4, row.size), np.int32 if fits else np.int64)
    table[ROW] = row
    at = 0
    for e, s, n in pieces(lengths, job.config, block_size=job.block_size):
        table[EXAMPLE, at : at + e.size] = e + first
        table[START, at : at + e.size] = s
        table[LENGTH, at : at + e.size] = n
        at += e.size
    assert at == row.size, (at, row.size)
    return table


def _to_corpus(table: np.ndarray, refs: np.ndarray, first: int) -> np.ndarray:
    """A mixed block's piece table with each piece's corpus example (stream position m of the
    block is `refs[m - first]`), sorted by it (stable: a repeated example's copies keep the
    plan's order), as pieces of a corpus are."""
    example = np.asarray(refs, np.int64)[table[EXAMPLE].astype(np.int64) - first]
    if table.dtype != np.int64 and example.size and int(example.max()) >= 2**31:
        table = table.astype(np.int64)
    table[EXAMPLE] = example
    return table[:, np.argsort(table[EXAMPLE], kind="stable")]


def finish_plan(files: Iterable[FileSummary], blocks: Iterable[BlockSummary], job: PackJob, *,
                rerun: bool = True, mixture: dict | None = None) -> JobSummary | None:
    """`summarize_plan`, then writes pack_intent.json; None when `resume` finds the run complete.
    Raises what `summarize_plan` raises, then what the output refuses (a non-empty directory).
    `rerun`: whether the executor may run this step again (below; the local runner: once)."""
    summary = summarize_plan(files, blocks, job, mixture=mixture)
    intent = summary.intent
    # The directory is prepared once. A runner may run this step again: Beam retries a bundle
    # whose outputs were lost, and may recompute any PCollection (a side input for each step
    # reading it, even after the shards were written). prepare_dir is not idempotent (again
    # without `resume` it refuses the directory, with `overwrite` it deletes the shards written
    # since), so when the output already records this very run (an earlier attempt, or an
    # identical run overwritten), the step goes on as a resume of it: nothing is deleted, and
    # the writers rewrite every shard (the bytes of a fresh run).
    again = rerun and not job.resume and records_run(job.output, intent)
    if prepare_dir(job.output, intent, overwrite=job.overwrite and not again,
                   resume=job.resume or again) is not None:
        return None
    return summary


def summarize_plan(files: Iterable[FileSummary], blocks: Iterable[BlockSummary], job: PackJob,
                   *, mixture: dict | None = None) -> JobSummary:
    """Sums the blocks up: the run's intent, stats and output order (nothing is written).
    Raises InputError for what `check_files` refuses, then the first block's planning error.
    `mixture`: a mixture's record (`mixture.Selection.record`; blocks of the mixed stream)."""
    config, block_size = job.config, job.block_size
    files = check_files(files, job, warn=False)  # the runners checked them first
    blocks = sorted(blocks, key=lambda b: b.block)
    total = int(first_examples(files)[-1]) if mixture is None else \
        sum(int(d["examples"]) for d in mixture["datasets"])
    assert [b.block for b in blocks] == list(range(-(-total // block_size))), "a block is missing"
    for b in blocks:
        if b.error is not None:
            raise InputError(b.error)
    if not sum(b.num_rows for b in blocks):
        record.nothing_packed(sum(b.counters.dropped_examples for b in blocks), config.seq_len)
    dtype = inputs.corpus_dtype([np.dtype(f.dtype) for f in files])
    columns = record.column_entries(job, inputs.extra_corpus_dtypes(files))  # type: ignore
    intent = record.run_intent(job, record.inputs_record([f.info for f in files], dtype,
                                                         job.read_options),
                               sum(b.num_rows for b in blocks), columns, mixture)
    counters = sum((b.counters for b in blocks), Counters())
    used = np.sum([b.used_hist for b in blocks if b.used_hist.size], axis=0)
    nseg = np.sum([b.nseg_hist for b in blocks if b.nseg_hist.size], axis=0)
    costs = functools.reduce(operator.add, [b.costs for b in blocks if b.costs is not None])
    slack = sum(b.slack for b in blocks)  # the alignment's tokens, in the lower bound
    stats = stats_from_histograms(used, nseg, config.seq_len, counters, costs=costs, slack=slack)
    hist = record.length_histogram(np.zeros(0, np.int64), longest(files))
    hist["counts"] = [int(c) for c in np.sum([b.length_counts for b in blocks], axis=0)]
    base = np.concatenate(([0], np.cumsum([b.num_rows for b in blocks])))[:-1]
    order = global_order([b.layout for b in blocks if b.layout is not None], job.order)
    shapes = record.plan_shapes(used, nseg, [b.longest for b in blocks],
                                [b.min_row_next for b in blocks])
    return JobSummary(intent, record.manifest_results(stats, hist, balance=order.balance,
                                                      shapes=shapes),
                      row_dtype(dtype, config.pad_id).str, job.write_options.shard_rows,
                      [int(r) for r in base], order)


def output_rows(bp: BlockPlan, summary: JobSummary) -> np.ndarray:
    """i64[P_b]: the output row of each of the block's pieces (its plan row made global, then
    put in the run's order: `GlobalOrder.output_positions`, one query per row of the block)."""
    block, num_rows = bp.summary.block, bp.summary.num_rows
    plan_rows = np.arange(num_rows, dtype=np.int64) + summary.row_base[block]
    if summary.order is not None and bp.layout is not None:
        plan_rows = summary.order.output_positions(plan_rows, {block: bp.layout})
    return plan_rows[bp.pieces[ROW]]


# -- shards ------------------------------------------------------------------------------------


def shard_span(summary: JobSummary, shard: int) -> tuple[int, int]:
    """(first output row, row count) of shard `shard`."""
    r0 = shard * summary.shard_rows
    return r0, min(summary.shard_rows, summary.intent.num_rows - r0)


def shard_plan(table: np.ndarray, shard: int, summary: JobSummary, config: PackConfig
               ) -> tuple[PackPlan, np.ndarray]:
    """One shard's plan from its pieces (`table` [4, P]: rows are output rows, any order):
    pieces in (row, example) order, rows from 0; and the permutation that puts `table` in
    that order."""
    r0, num_rows = shard_span(summary, shard)
    order = np.lexsort((table[EXAMPLE], table[ROW]))
    example, start, length, row = (table[k, order].astype(np.int64) for k in range(4))
    row -= r0
    _check_received(shard, example, length, row, num_rows, config,
                    repeats=summary.intent.mixture is not None)
    p = order_pieces(example, start, length, row, num_rows, Counters(), config)
    assert p.example is example or np.array_equal(p.example, example)
    return p, order


def _check_received(shard: int, example: np.ndarray, length: np.ndarray, row: np.ndarray,
                    num_rows: int, config: PackConfig, *, repeats: bool) -> None:
    """RunFailed where shard `shard`'s pieces (by row, then example) cannot be what the plan
    sent: none in its first or last row, a row over L tokens or S segments, or (`repeats`
    False: no mixture's repeated examples) a piece twice. A runner lost or repeated records."""
    size = np.bincount(row, weights=aligned(length, config.alignment), minlength=num_rows)
    twice = not repeats and bool(((np.diff(row) == 0) & (np.diff(example) == 0)).any())
    if not row.size or row[0] != 0 or row[-1] != num_rows - 1 or twice or size.max() > \
            config.seq_len or np.bincount(row).max() > config.max_segments:
        raise RunFailed(0, f"shard {shard} received pieces the plan did not send it (or not "
                        "one of its first or last row): the runner lost or repeated records")


def kept_shard(output: str | OutputDir, shard: int, table: np.ndarray, summary: JobSummary
               ) -> ShardResult | None:
    """A shard a resumed run keeps (written and intact; `table`: its pieces), or None."""
    _, num_rows = shard_span(summary, shard)
    out = as_output_dir(output)
    name = summary.intent.shards[shard]
    kept = shard_done(out, name, num_rows)
    if kept is None:
        return None
    profile = record.order_profile(table[ROW], table[LENGTH], summary.intent.num_rows)
    if of_manifest(summary.intent)[0].by_reference and not summary.intent.columns:
        return num_rows, kept, record.ShardFacts(profile, shards.plan_loss_tokens(table[LENGTH]))
    rows = shards.read_shard(out.location, name, num_rows, restore=False,
                             manifest=summary.intent)  # its loss tokens, read back
    return num_rows, kept, record.ShardFacts(profile, shards.loss_tokens(rows, summary.intent))


def write_shard(output: str | OutputDir, shard: int, p: PackPlan, summary: JobSummary,
                config: PackConfig, options: WriteOptions, *,
                pieces: Sequence[np.ndarray] | None = None, values: np.ndarray | None = None,
                columns: dict[str, np.ndarray] | None = None) -> ShardResult:
    """Writes shard `shard` of plan `p` (`shard_plan`) with its tokens: `pieces[i]` the i-th
    piece's, or `values` [R, L] in place (`shards.write_shard`); `columns`: each extra
    column's [R, L] values in place."""
    r0, num_rows = shard_span(summary, shard)
    assert p.num_rows == num_rows, (shard, p.num_rows, num_rows)
    profile = record.order_profile(p.row + r0, p.length, summary.intent.num_rows)
    out = as_output_dir(output)
    digest, loss = shards.write_shard(out, summary.intent.shards[shard], pieces, p, config,
                                      options, dtype=np.dtype(summary.row_dtype), values=values,
                                      columns=columns, entries=summary.intent.columns or (),
                                      firsts=firsts_of(summary.intent.mixture))
    return num_rows, digest, record.ShardFacts(profile, loss)


def finish_job(rows: Iterable[tuple[int, int, tuple[int, str], record.ShardFacts]],
               summary: JobSummary, output: str | OutputDir) -> Manifest:
    """Writes the encoding's side files, then manifest.json, once every shard is written;
    returns the manifest.

    `rows`: (shard, row count, (size, sha256), ShardFacts) of every shard, any order."""
    by_shard = {k: (n, d, prof) for k, n, d, prof in rows}
    names = summary.intent.shards
    if sorted(by_shard) != list(range(len(names))):
        missing = sorted(set(range(len(names))) - set(by_shard))
        raise RuntimeError(f"shards {missing[:8]} were not written; the manifest is not written")
    done = [by_shard[k] for k in range(len(names))]
    facts = functools.reduce(operator.add, [f for _, _, f in done])
    out = as_output_dir(output)
    stats = summary.results["stats"]
    refuse_incomplete(out, summary.intent.shards, facts.profile.sum(axis=0).tolist(),
                      [stats["num_segments"], stats["real_tokens"]])
    results = json.loads(json.dumps(summary.results))
    results["stats"]["along_output"] = record.along_output(facts.profile,
                                                           summary.intent.num_rows)
    results["shapes"]["loss_tokens"] = facts.loss_tokens
    encoding, layout = of_manifest(summary.intent)
    for name, obj in encoding.side_files(results, layout).items():
        out.write_json(name, obj)
    return commit_manifest(out, summary.intent, [n for n, _, _ in done], results,
                           [tuple(d) for _, d, _ in done])  # type: ignore[misc]
