"""The steps of the Beam packing job as plain functions: scan, plan per block, route, write.

`offline.beam` wires these into a pipeline; nothing here imports Beam, so each step runs (and
is tested) on its own. What each step takes and gives, for n examples in P pieces::

    scan_file          one input          -> FileScan: fingerprint, counts, lengths i64[n_f], dtype
    summarize_file     one FileScan       -> FileSummary: the scan without its lengths (gathered
                                             in one place: a few hundred bytes per input)
    cut_blocks         one FileScan       -> (block, BlockSlice) per block of `block_size`
                                             consecutive examples the input's examples fall in
    plan_block         one block's slices -> BlockPlan: its pieces i64[4, P_b] (example, start,
                                             length, row in the block) + BlockSummary (rows,
                                             counters, histograms: a few KB)
    finish_plan        every FileSummary
                       + BlockSummary     -> JobSummary (row offset of each block, manifest
                                             results) and pack_intent.json
    split_block        one BlockPlan      -> (input, pieces with their final rows) per input
    route_file         one input's pieces -> (shard, ShardPart) per shard the input feeds: the
                                             pieces + their tokens, back to back
    write_shard_parts  one shard's parts  -> the shard file; returns its row count
    finish_job         all row counts     -> manifest.json

Nothing gathers per-example data in one place: each block is planned by the worker its lengths
are grouped to (`block_size` examples, by default about four million: a few hundred MB), and
the one global step sees a summary per input and per block. Tokens travel once, from the worker
reading an input to the worker writing the shard they land in.

Same bytes as the local runner (`offline.local.pack_to_dir`): the blocks are `packer.plan_block`
on the same lengths in the same order (inputs in the order given, examples in file order), the
statistics are the sum of the blocks' histograms (as the local writer computes them), the
manifest comes from the writer's own functions, and a shard's pieces are sorted back into
(row, example) order and written by `shards.write_shard`, whatever order they arrive in.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import operator
from collections.abc import Iterable, Sequence

import numpy as np

from seqpack.packer import Counters, PackConfig, PackPlan
from seqpack.packer.assemble import fill_rows
from seqpack.packer.contract import ragged_arange
from seqpack.packer.order import BlockLayout, GlobalOrder, block_layout, global_order
from seqpack.packer.plan import order_pieces, plan_block
from seqpack.packer.stats import (
    CostSummary,
    cost_summary,
    row_histograms,
    stats_from_histograms,
)
from seqpack.pipelines.errors import InputError, one_line
from seqpack.pipelines.formats import inputs
from seqpack.pipelines.formats.inputs import ReadOptions, detect_format, read_corpus
from seqpack.pipelines.formats.manifest import INTENT, MANIFEST, Manifest
from seqpack.pipelines.formats.text import load_tokenizer
from seqpack.pipelines.offline import record
from seqpack.pipelines.offline.job import PackJob
from seqpack.pipelines.offline.outdir import (
    OutputDir,
    commit_manifest,
    prepare_dir,
    shard_done,
)
from seqpack.pipelines.offline.shards import WriteOptions, row_dtype, write_shard

# Rows of the piece tables (BlockPlan, FileJob, ShardPart).
EXAMPLE, START, LENGTH, ROW = range(4)


@dataclasses.dataclass(frozen=True)
class FileScan:
    """One input's lengths (or why it cannot be read)."""

    index: int  # position of the input in the job's list
    path: str
    info: dict  # the manifest's entry: fingerprint, format, counts, lengths digest
    lengths: np.ndarray  # i64[n_f] example lengths, in file order
    dtype: str  # numpy dtype of the file's token ids
    error: str | None = None  # the InputError's message when the file could not be read
    extra_dtypes: dict = dataclasses.field(default_factory=dict)  # extra column -> its dtype
    extra_ranges: dict = dataclasses.field(default_factory=dict)  # extra column -> (min, max)


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


@dataclasses.dataclass(frozen=True)
class BlockSlice:
    """Some consecutive examples of one block, from one input."""

    first: int  # global index of the first example
    lengths: np.ndarray  # i64


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


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    summary: BlockSummary
    pieces: np.ndarray  # i64[4, P_b]: example (global), start, length, row (in the block)
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


@dataclasses.dataclass(frozen=True)
class FileJob:
    """Where each piece of one input goes."""

    index: int
    path: str
    info: dict  # from the scan; the re-read must match it (the file must not change mid-job)
    first_example: int  # global index of the file's first example
    pieces: np.ndarray  # i64[4, P_f]: example (global), start, length, row (global)


@dataclasses.dataclass(frozen=True)
class ShardPart:
    """The pieces one input sends to one shard."""

    pieces: np.ndarray  # i64[4, P]: as in FileJob
    tokens: np.ndarray  # the pieces' tokens back to back, in the corpus dtype
    columns: dict = dataclasses.field(default_factory=dict)  # extra column -> values, as tokens


# -- scan ------------------------------------------------------------------------------------


def scan_file(index: int, path: str, options: ReadOptions) -> FileScan:
    """Reads one input for its example lengths; a bad input gives a FileScan with `error`."""
    try:
        fmt = detect_format(path, options.input_format)
        tokenizer = load_tokenizer(options.tokenizer) if options.tokenizer else None
        scan = inputs.scan_file(path, fmt, options, tokenizer)
    except (ValueError, OSError) as e:
        return FileScan(index, path, {}, np.zeros(0, np.int64), "", error=one_line(e))
    return FileScan(index, path, scan.info, scan.lengths, scan.dtype.str,
                    extra_dtypes=scan.extra_dtypes, extra_ranges=scan.extra_ranges)


def summarize_file(scan: FileScan, config: PackConfig) -> FileSummary:
    return FileSummary(scan.index, scan.path, scan.info, int(scan.lengths.size), scan.dtype,
                       int(scan.lengths.max(initial=0)), scan.error,
                       record.first_overlength(scan.lengths, config), scan.extra_dtypes,
                       scan.extra_ranges)


def _firsts(files: Sequence[FileSummary]) -> np.ndarray:
    """Global index of each input's first example (inputs in job order), plus the total."""
    counts = [f.num_examples for f in sorted(files, key=lambda f: f.index)]
    return np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))


def cut_blocks(scan: FileScan, files: Sequence[FileSummary], block_size: int
               ) -> list[tuple[int, BlockSlice]]:
    """The input's lengths cut at block boundaries; nothing when any input failed to read."""
    if any(f.error is not None for f in files):
        return []
    first = int(_firsts(files)[scan.index])
    out = []
    at = 0
    while at < scan.lengths.size:
        block = (first + at) // block_size
        end = min(scan.lengths.size, (block + 1) * block_size - first)
        out.append((block, BlockSlice(first + at, scan.lengths[at:end])))
        at = end
    return out


# -- plan --------------------------------------------------------------------------------------


def plan_block_slices(block: int, slices: Iterable[BlockSlice], files: Sequence[FileSummary],
                      job: PackJob) -> BlockPlan:
    """Plans one block from its slices (any order), as `packer.plan_rows` plans it, and lays
    its rows out for the output order (`packer.order.block_layout` on the rows' costs)."""
    config, block_size, order = job.config, job.block_size, job.order
    slices = sorted(slices, key=lambda s: s.first)
    first = block * block_size
    lengths = np.concatenate([s.lengths for s in slices]).astype(np.int64)
    total = int(_firsts(files)[-1])
    assert slices[0].first == first and lengths.size == min(block_size, total - first), block
    L, S = config.seq_len, config.max_segments
    top = max((f.max_length for f in files), default=0)
    counts = np.array(record.length_histogram(lengths, top)["counts"], np.int64)
    try:
        example, start, length, row, num_rows, counters = plan_block(lengths, config, first)
    except InputError as e:
        empty = np.zeros(0, np.int64)
        summary = BlockSummary(block, 0, Counters(), empty, empty, counts, error=one_line(e))
        return BlockPlan(summary, np.zeros((4, 0), np.int64))
    used, nseg = row_histograms(row, length, num_rows, L, S)
    layout = block_layout(order.row_costs(row, length, num_rows), order, block=block)
    summary = BlockSummary(block, num_rows, counters, used, nseg, counts,
                           layout=layout.summary(),
                           costs=cost_summary(row, length, num_rows, L, order.cost))
    return BlockPlan(summary, np.stack([example, start, length, row]).astype(np.int64), layout)


def finish_plan(files: Iterable[FileSummary], blocks: Iterable[BlockSummary], job: PackJob
                ) -> JobSummary | None:
    """Sums the blocks up, writes pack_intent.json; None when `resume` finds the run complete.

    Raises InputError for the first bad input (in input order), then the first block's planning
    error, then what the local CLI rejects too (no tokens, a non-empty directory).
    """
    config, block_size = job.config, job.block_size
    files = sorted(files, key=lambda f: f.index)
    assert [f.index for f in files] == list(range(len(files))), "an input is missing"
    for f in files:
        if f.error is not None:
            raise InputError(f.error)
    record.check_overlength([f.path for f in files], [f.overlength for f in files], config)
    blocks = sorted(blocks, key=lambda b: b.block)
    total = int(_firsts(files)[-1])
    assert [b.block for b in blocks] == list(range(-(-total // block_size))), "a block is missing"
    for b in blocks:
        if b.error is not None:
            raise InputError(b.error)
    infos = [f.info for f in files]
    num_tokens = sum(int(i["num_tokens"]) for i in infos)
    if not num_tokens:
        raise InputError(f"the inputs hold no tokens ({total} examples); nothing to pack")
    dtype = inputs.corpus_dtype([np.dtype(f.dtype) for f in files])
    num_rows = sum(b.num_rows for b in blocks)
    columns = record.column_entries(job, inputs.extra_corpus_dtypes(files))  # type: ignore
    intent = record.run_intent(job, record.inputs_record(infos, dtype, job.read_options),
                               num_rows, columns)
    # The directory is prepared once. A runner may run this step again: Beam retries a bundle
    # whose outputs were lost, and may recompute any PCollection (a side input for each step
    # reading it, even after the shards were written). prepare_dir is not idempotent: again
    # without `resume` it refuses the directory, again with `overwrite` it deletes the shards
    # written since. So when the output already records this very run (this job's earlier
    # attempt, or an identical run being overwritten), the step goes on as a resume of it:
    # nothing is deleted, and the shard writers rewrite every shard (the bytes of a fresh run).
    again = not job.resume and _records_run(job.output, intent)
    if prepare_dir(job.output, intent, overwrite=job.overwrite and not again,
                   resume=job.resume or again) is not None:
        return None
    counters = sum((b.counters for b in blocks), Counters())
    used = np.sum([b.used_hist for b in blocks if b.used_hist.size], axis=0)
    nseg = np.sum([b.nseg_hist for b in blocks if b.nseg_hist.size], axis=0)
    costs = functools.reduce(operator.add, [b.costs for b in blocks if b.costs is not None])
    stats = stats_from_histograms(used, nseg, config.seq_len, counters, costs=costs)
    hist = record.length_histogram(np.zeros(0, np.int64), max(f.max_length for f in files))
    hist["counts"] = [int(c) for c in np.sum([b.length_counts for b in blocks], axis=0)]
    base = np.concatenate(([0], np.cumsum([b.num_rows for b in blocks])))[:-1]
    order = global_order([b.layout for b in blocks if b.layout is not None], job.order)
    return JobSummary(intent, record.manifest_results(stats, hist, balance=order.balance),
                      row_dtype(dtype, config.pad_id).str, job.write_options.shard_rows,
                      [int(r) for r in base], order)


def _records_run(output_dir: str, intent: Manifest) -> bool:
    """Whether the output's pack_intent.json, or its complete manifest.json, is of `intent`."""
    out = OutputDir(output_dir)
    try:
        for name in (INTENT, MANIFEST):
            if out.exists(name) and Manifest.from_json(
                    out.read_json(name), out.path(name)).intent().to_json() == intent.to_json():
                return True
    except (OSError, ValueError):  # unreadable: not this run (prepare_dir reports it)
        pass
    finally:
        out.close()
    return False


def split_block(bp: BlockPlan, summary: JobSummary | None, files: Sequence[FileSummary]
                ) -> list[tuple[int, np.ndarray]]:
    """The block's pieces, rows made global and put in the output order, cut by the input they
    come from."""
    if summary is None or not bp.pieces.shape[1]:
        return []
    table = bp.pieces.copy()
    table[ROW] += summary.row_base[bp.summary.block]
    if summary.order is not None and bp.layout is not None:
        table[ROW] = summary.order.output_positions(table[ROW], {bp.summary.block: bp.layout})
    firsts = _firsts(files)
    file_of = np.searchsorted(firsts, table[EXAMPLE], side="right") - 1
    cuts = np.flatnonzero(np.diff(file_of)) + 1  # pieces are in example order
    return [(int(file_of[a]), table[:, a:b])
            for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), file_of.size])]


def file_job(index: int, tables: Iterable[np.ndarray], files: Sequence[FileSummary]
             ) -> FileJob:
    """One input's pieces from every block it feeds (any order)."""
    f = next(f for f in files if f.index == index)
    table = np.concatenate(list(tables), axis=1)
    return FileJob(index, f.path, f.info, int(_firsts(files)[index]), table)


# -- route and write -------------------------------------------------------------------------


def route_file(job: FileJob, options: ReadOptions, shard_rows: int, dtype: str
               ) -> list[tuple[int, ShardPart]]:
    """Re-reads one input and cuts its pieces' tokens into one ShardPart per destination shard."""
    corpus = read_corpus([job.path], options)
    if corpus.files[0] != job.info:
        raise InputError(f"{job.path}: changed while the job ran (was {job.info}, now "
                         f"{corpus.files[0]}); rerun on inputs that stay put")
    shard = job.pieces[ROW] // shard_rows
    order = np.argsort(shard, kind="stable")
    pieces = job.pieces[:, order]
    src = corpus.offsets[pieces[EXAMPLE] - job.first_example] + pieces[START]
    at = ragged_arange(src, pieces[LENGTH])
    tokens = corpus.values.astype(dtype, copy=False)[at]
    columns = {name: values[at] for name, values in corpus.extra_values.items()}
    shard = shard[order]
    keys, firsts = np.unique(shard, return_index=True)
    piece_cuts = np.append(firsts, shard.size)
    token_cuts = np.concatenate(([0], np.cumsum(pieces[LENGTH])))[piece_cuts]
    return [
        (int(k), ShardPart(pieces[:, a:b], tokens[ta:tb],
                           {name: col[ta:tb] for name, col in columns.items()}))
        for k, a, b, ta, tb in zip(keys.tolist(), piece_cuts[:-1].tolist(),
                                   piece_cuts[1:].tolist(), token_cuts[:-1].tolist(),
                                   token_cuts[1:].tolist())
    ]


def shard_plan(shard: int, parts: Iterable[ShardPart], summary: JobSummary,
               config: PackConfig) -> tuple[PackPlan, list[np.ndarray], dict[str, np.ndarray]]:
    """One shard's plan (rows from 0, pieces in (row, example) order), its pieces' tokens, and
    each extra column's `[R, L]` values in place (its pad elsewhere)."""
    parts = list(parts)
    table = np.concatenate([part.pieces for part in parts], axis=1)
    tokens = np.concatenate([part.tokens for part in parts])
    values = {c["name"]: np.concatenate([part.columns[c["name"]] for part in parts])
              for c in summary.intent.columns or []}
    r0 = shard * summary.shard_rows
    num_rows = min(summary.shard_rows, summary.intent.num_rows - r0)
    order = np.lexsort((table[EXAMPLE], table[ROW]))
    starts = (np.cumsum(table[LENGTH]) - table[LENGTH])[order]
    table = table[:, order]
    rows = table[ROW] - r0
    assert rows.size and rows[0] == 0 and rows[-1] == num_rows - 1, (shard, rows[:1], rows[-1:])
    cuts = list(zip(starts.tolist(), table[LENGTH].tolist()))
    pieces = [tokens[s : s + m] for s, m in cuts]
    p = order_pieces(table[EXAMPLE], table[START], table[LENGTH], rows, num_rows, Counters(),
                     config)
    columns = {c["name"]: fill_rows([values[c["name"]][s : s + m] for s, m in cuts], p,
                                    config.seq_len, dtype=np.dtype(c["dtype"]), pad=c["pad"])
               for c in summary.intent.columns or []}
    return p, pieces, columns


def write_shard_parts(shard: int, parts: Iterable[ShardPart], summary: JobSummary,
                      output_dir: str, config: PackConfig, *, write_options: WriteOptions,
                      resume: bool = False) -> tuple[int, tuple[int, str], np.ndarray]:
    """Writes one shard from the parts its inputs sent (unless `resume` finds it written and
    intact); returns its row count, (size, sha256) and its rows' part of the order profile
    (`record.order_profile`)."""
    parts = list(parts)
    name = summary.intent.shards[shard]
    num_rows = min(summary.shard_rows, summary.intent.num_rows - shard * summary.shard_rows)
    table = np.concatenate([part.pieces for part in parts], axis=1)
    profile = record.order_profile(table[ROW], table[LENGTH], summary.intent.num_rows)
    out = OutputDir(output_dir)
    try:
        kept = shard_done(out, name, num_rows) if resume else None
        if kept is not None:
            return num_rows, kept, profile
        p, pieces, columns = shard_plan(shard, parts, summary, config)
        return num_rows, write_shard(out, name, pieces, p, config, write_options,
                                     dtype=np.dtype(summary.row_dtype), columns=columns), profile
    finally:
        out.close()


def finish_job(rows: Iterable[tuple[int, int, tuple[int, str], np.ndarray]],
               summary: JobSummary, output_dir: str) -> Manifest:
    """Writes manifest.json once every shard is written; returns the manifest.

    `rows`: (shard, row count, (size, sha256), order profile) of every shard, any order."""
    by_shard = {k: (n, d, prof) for k, n, d, prof in rows}
    names = summary.intent.shards
    if sorted(by_shard) != list(range(len(names))):
        missing = sorted(set(range(len(names))) - set(by_shard))
        raise RuntimeError(f"shards {missing[:8]} were not written; the manifest is not written")
    done = [by_shard[k] for k in range(len(names))]
    profile = np.sum([prof for _, _, prof in done], axis=0)
    results = json.loads(json.dumps(summary.results))
    results["stats"]["along_output"] = record.along_output(profile, summary.intent.num_rows)
    return commit_manifest(output_dir, summary.intent, [n for n, _, _ in done], results,
                           [tuple(d) for _, d, _ in done])  # type: ignore[misc]


def plan_in_process(scans: Sequence[FileScan], job: PackJob
                    ) -> tuple[JobSummary | None, list[FileJob]]:
    """The planning steps one after another (tests, and a reading aid for the pipeline)."""
    config, block_size = job.config, job.block_size
    files = [summarize_file(s, config) for s in scans]
    by_block: dict[int, list[BlockSlice]] = {}
    for s in scans:
        for block, piece in cut_blocks(s, files, block_size):
            by_block.setdefault(block, []).append(piece)
    plans = [plan_block_slices(b, sl, files, job) for b, sl in by_block.items()]
    summary = finish_plan(files, [p.summary for p in plans], job)
    by_file: dict[int, list[np.ndarray]] = {}
    for p in plans:
        for index, table in split_block(p, summary, files):
            by_file.setdefault(index, []).append(table)
    return summary, [file_job(i, t, files) for i, t in sorted(by_file.items())]
