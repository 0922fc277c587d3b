"""The offline job as steps over inputs, blocks and shards, for a runner whose workers share no
disk (the Beam job, `runners.beam`; a Spark job would map the same steps): nothing per example
meets in one place, and tokens travel once, from the worker reading an input to the worker
writing the shard they land in. The plan, the order, the shard plans and the manifest are
`offline.core`'s (the steps it owns are re-exported here, so a runner imports one module).

What each step takes and gives, for n examples in P pieces::

    scan_file          one input          -> FileScan: fingerprint, counts, lengths i64[n_f], dtype
    summarize_file     one FileScan       -> FileSummary (core): the scan without its lengths
    cut_blocks         one FileScan       -> (block, BlockSlice) per block of `block_size`
                                             consecutive examples the input's examples fall in
    (a mixture: `mixture.hashed`'s steps, as `runners.mixing` maps them)
    tally, crossings,
    members, plan      every input        -> MixPlan: what the mixture takes of each dataset
                                             (sums per input and per hash bucket meet, no
                                             example does)
    picks, chunk       one input, chunk   -> the stream's chunks (about a block each): lengths
                                             and corpus examples of its takes
    cut_chunk          one chunk          -> (block, BlockSlice) per block of the stream it
                                             falls in
    plan_block_slices  one block's slices -> BlockPlan (core.plan_block): pieces + BlockSummary
    finish_plan        every FileSummary
                       + BlockSummary     -> JobSummary (core) and pack_intent.json
    split_block        one BlockPlan      -> (input, pieces with their output rows) per input
    plan_figures       one BlockPlan      -> PlanFigures: what a dry run shows of its pieces
                                             (summed over the blocks: `summarize_plan`'s run)
    file_job           one input's tables -> FileJob: where each of its pieces goes
    route_file         one FileJob        -> (shard, ShardPart) per shard the input feeds (and
                                             per `ROUTE_BYTES` of its tokens past the first): the
                                             pieces + their tokens, back to back (a plan-only
                                             job, rows by reference: the pieces, no re-read)
    write_shard_parts  one shard's parts  -> the shard file (core.write_shard): its row count,
                                             (size, sha256), ShardFacts
    finish_job         every shard's      -> manifest.json (core)

A block is planned by the worker its lengths are grouped to (`block_size` examples, by default
about four million: a few hundred MB); the global step sees a summary per input and per block.
A shard's pieces arrive in any order and are sorted back into (row, example) order by
`core.shard_plan`, so the bytes are the local runner's.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from seqpack.packer import PackConfig, PackPlan
from seqpack.packer.assemble import fill_rows
from seqpack.packer.contract import ragged_arange
from seqpack.pipelines.errors import InputError, one_line
from seqpack.pipelines.formats import inputs
from seqpack.pipelines.formats.chunks import Chunk
from seqpack.pipelines.formats.inputs import (
    LossCount,
    ReadOptions,
    detect_format,
    unstamped,
)
from seqpack.pipelines.formats.text import load_tokenizer
from seqpack.pipelines.offline.core import (
    EXAMPLE,
    LENGTH,
    ROW,
    START,
    BlockPlan,
    BlockSummary,
    FileScan,
    FileSummary,
    JobSummary,
    ShardResult,
    check_files,
    dataset_firsts,
    finish_job,
    finish_plan,
    first_examples,
    kept_shard,
    longest,
    output_rows,
    plan_block,
    shard_plan,
    summarize_file,
    summarize_plan,
    write_shard,
)
from seqpack.pipelines.offline.job import PackJob
from seqpack.pipelines.offline.mixture import Selection, firsts_of, hashed
from seqpack.pipelines.offline.outdir import OutputDir
from seqpack.pipelines.offline.record import order_profile
from seqpack.pipelines.offline.shards import WriteOptions

__all__ = [
    "EXAMPLE", "LENGTH", "ROW", "START", "BlockPlan", "BlockSlice", "BlockSummary", "FileJob",
    "Selection", "check_files", "column_dtypes",
    "FileScan", "FileSummary", "JobSummary", "PlanFigures", "ShardPart", "cut_blocks",
    "file_job", "cut_stream", "finish_job", "finish_plan", "plan_block_slices",
    "plan_figures", "plan_in_process", "route_file", "scan_file", "cut_chunk",
    "split_block", "summarize_file", "summarize_plan", "write_shard_parts",
]


@dataclasses.dataclass(frozen=True)
class BlockSlice:
    """Some consecutive examples of one block, from one input."""

    first: int  # global index of the first example (of the mixed stream with a mixture)
    lengths: np.ndarray  # i64
    refs: np.ndarray | None = None  # a mixture's: the corpus example of each


@dataclasses.dataclass(frozen=True)
class FileJob:
    """Where each piece of one input goes."""

    index: int
    path: str
    info: dict  # from the scan; the re-read must match it (the file must not change mid-job)
    first_example: int  # global index of the file's first example
    pieces: np.ndarray  # i64[4, P_f]: example (global), start, length, row (output)


@dataclasses.dataclass(frozen=True)
class ShardPart:
    """The pieces one input sends to one shard."""

    pieces: np.ndarray  # i64[4, P]: as in FileJob
    tokens: np.ndarray | None  # the pieces' tokens back to back, in the corpus dtype (None:
    # a plan-only job, `PackJob.plan_only`)
    columns: dict = dataclasses.field(default_factory=dict)  # extra column -> values, as tokens

    @staticmethod
    def of(parts: Sequence[ShardPart]) -> ShardPart:
        """Parts of one input for one shard as one (pieces, tokens and columns back to back)."""
        if len(parts) == 1:
            return parts[0]
        tokens = [p.tokens for p in parts if p.tokens is not None]
        return ShardPart(np.concatenate([p.pieces for p in parts], axis=1),
                         np.concatenate(tokens) if tokens else None,
                         {n: np.concatenate([p.columns[n] for p in parts]) for n in
                          parts[0].columns})


# -- scan and plan ---------------------------------------------------------------------------


def scan_file(index: int, path: str, options: ReadOptions,
              loss_columns: LossCount | None = None) -> FileScan:
    """Reads one input for its example lengths (`loss_columns`: and loss tokens,
    `PackJob.mix_loss_columns`); a bad input gives a FileScan with `error`."""
    try:
        fmt = detect_format(path, options.input_format)
        tokenizer = load_tokenizer(options.tokenizer) if options.tokenizer else None
        scan = inputs.scan_file(path, fmt, options, tokenizer, loss_columns=loss_columns)
    except (ValueError, OSError) as e:
        return FileScan(index, path, {}, np.zeros(0, np.int64), "", error=one_line(e))
    return FileScan.of(index, path, scan)


def cut_blocks(scan: FileScan, files: Sequence[FileSummary], block_size: int
               ) -> list[tuple[int, BlockSlice]]:
    """The input's lengths cut at block boundaries; nothing when any input failed to read."""
    if any(f.error is not None for f in files):
        return []
    return _cut(int(first_examples(files)[scan.index]), scan.lengths, None, block_size)


def cut_chunk(chunk: tuple[int, np.ndarray, np.ndarray], sizes: Iterable[tuple[int, int]],
              block_size: int) -> list[tuple[int, BlockSlice]]:
    """One chunk of a mixed stream (`mixture.hashed.chunk`: chunk, lengths, corpus examples)
    cut at the stream's block boundaries (`sizes`: every chunk's examples)."""
    g, lengths, refs = chunk
    return _cut(sum(n for c, n in sizes if c < g), lengths, refs, block_size)


def _cut(first: int, lengths: np.ndarray, refs: np.ndarray | None, block_size: int
         ) -> list[tuple[int, BlockSlice]]:
    """Consecutive examples from global index `first` (a mixture's: their corpus examples
    `refs`) cut at the boundaries of blocks of `block_size`."""
    out, at = [], 0
    while at < lengths.size:
        block = (first + at) // block_size
        end = min(lengths.size, (block + 1) * block_size - first)
        out.append((block, BlockSlice(first + at, lengths[at:end],
                                      None if refs is None else refs[at:end])))
        at = end
    return out


def cut_stream(selection: Selection, block_size: int) -> list[tuple[int, BlockSlice]]:
    """A mixed stream at hand cut into its blocks."""
    return cut_chunk((0, selection.lengths, selection.ref), [], block_size)


def plan_block_slices(block: int, slices: Iterable[BlockSlice], files: Sequence[FileSummary],
                      job: PackJob) -> BlockPlan:
    """Plans one block from its slices (any order): `core.plan_block` on their lengths (a
    mixture's: on the stream's, its pieces naming the corpus examples)."""
    slices = sorted(slices, key=lambda s: s.first)
    first = block * job.block_size
    lengths = np.concatenate([s.lengths for s in slices]).astype(np.int64)
    refs = None if slices[0].refs is None else np.concatenate([s.refs for s in slices])
    total = int(first_examples(files)[-1])
    assert slices[0].first == first and (refs is not None or lengths.size == min(
        job.block_size, total - first)), block
    return plan_block(block, lengths, job, refs, top=longest(files),
                      firsts=None if refs is None else dataset_firsts(job, files))


def split_block(bp: BlockPlan, summary: JobSummary | None, files: Sequence[FileSummary]
                ) -> list[tuple[int, np.ndarray]]:
    """The block's pieces with their output rows (`core.output_rows`), i64, cut by the input
    they come from."""
    if summary is None or not bp.pieces.shape[1]:
        return []
    table = bp.pieces.astype(np.int64)
    table[ROW] = output_rows(bp, summary)
    file_of = np.searchsorted(first_examples(files), table[EXAMPLE], side="right") - 1
    cuts = np.flatnonzero(np.diff(file_of)) + 1  # pieces are in example order
    return [(int(file_of[a]), table[:, a:b])
            for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), file_of.size])]


@dataclasses.dataclass(frozen=True)
class PlanFigures:
    """What a dry run shows of some blocks' pieces in the output; blocks' figures add up."""

    profile: np.ndarray  # i64[10, 2]: `record.order_profile`
    tokens: np.ndarray | None = None  # a mixture's: i64[K] each dataset's tokens
    steps: np.ndarray | None = None  # i64[m]: full steps the pieces reach, ascending
    step_tokens: np.ndarray | None = None  # i64[m, K]: each one's tokens of each dataset

    def __add__(self, other: PlanFigures) -> PlanFigures:
        if self.tokens is None or other.tokens is None:
            return PlanFigures(self.profile + other.profile)
        assert self.steps is not None and other.steps is not None
        steps, at = np.unique(np.concatenate([self.steps, other.steps]), return_inverse=True)
        summed = np.zeros((steps.size, self.tokens.size), np.int64)
        np.add.at(summed, at, np.concatenate([self.step_tokens, other.step_tokens]))
        return PlanFigures(self.profile + other.profile, self.tokens + other.tokens, steps,
                           summed)


def plan_figures(bp: BlockPlan, summary: JobSummary, step_rows: int | None) -> PlanFigures:
    """One block's `PlanFigures`: its pieces' output rows profiled, and a mixture's tokens per
    dataset, in all and per full step of `step_rows` rows (None: a row), as the rows'
    `packer.mixing.row_units` would count them."""
    rows, length = output_rows(bp, summary), np.asarray(bp.pieces[LENGTH], np.int64)
    num_rows = summary.intent.num_rows
    profile = order_profile(rows, length, num_rows)
    firsts = firsts_of(summary.intent.mixture)
    if firsts is None:
        return PlanFigures(profile)
    k = firsts.size
    dataset = np.searchsorted(firsts, np.asarray(bp.pieces[EXAMPLE], np.int64), "right") - 1
    step = rows // (step_rows or 1)
    full = step < num_rows // (step_rows or 1)
    steps, at = np.unique(step[full], return_inverse=True)
    step_tokens = np.bincount(at * k + dataset[full], weights=length[full],
                              minlength=steps.size * k).astype(np.int64).reshape(-1, k)
    return PlanFigures(profile, np.bincount(dataset, weights=length, minlength=k).astype(
        np.int64), steps, step_tokens)


def file_job(index: int, tables: Iterable[np.ndarray], files: Sequence[FileSummary]
             ) -> FileJob:
    """One input's pieces from every block it feeds (any order)."""
    f = next(f for f in files if f.index == index)
    table = np.concatenate(list(tables), axis=1)
    return FileJob(index, f.path, f.info, int(first_examples(files)[index]), table)


# -- route and write -------------------------------------------------------------------------


ROUTE_BYTES = 1 << 28  # the tokens (and columns) a route step holds before it sends them on


def route_file(job: FileJob, options: ReadOptions, shard_rows: int, dtype: str, *,
               plan_only: bool = False, columns: dict[str, str] | None = None,
               budget: int = ROUTE_BYTES) -> Iterator[tuple[int, ShardPart]]:
    """Re-reads one input and cuts its pieces' tokens into ShardParts for their shards
    (`columns`: each extra column's dtype in the rows, else int64), sent on whenever they
    reach `budget` bytes (an input below it: one part per shard); `plan_only`
    (`PackJob.plan_only`): the pieces alone, the input not read again. The input is read a
    chunk at a time (in a thread, while the parts before go on), so a step holds its pieces and
    at most three budgets of tokens, whatever the input. A changed input raises InputError at the
    end, after some parts may have gone: a runner fails the step whole."""
    shard = job.pieces[ROW] // shard_rows
    if plan_only:
        order = np.argsort(shard, kind="stable")
        keys, firsts = np.unique(shard[order], return_index=True)
        cuts = np.append(firsts, shard.size).tolist()
        yield from ((k, ShardPart(job.pieces[:, order[a:b]], None))
                    for k, a, b in zip(keys.tolist(), cuts[:-1], cuts[1:]))
        return
    pieces, example = job.pieces, job.pieces[EXAMPLE] - job.first_example
    if (np.diff(example) < 0).any():  # blocks' tables in any order: by example
        by_example = np.argsort(example, kind="stable")
        pieces, shard, example = pieces[:, by_example], shard[by_example], example[by_example]
    got: dict[int, list[ShardPart]] = {}
    held, changed, stop = [0], [False], threading.Event()
    sent: queue.Queue[tuple] = queue.Queue(maxsize=1)

    def flush() -> list[tuple[int, ShardPart]]:
        held[0] = 0
        return [(k, ShardPart.of(got.pop(k))) for k in sorted(got)]  # each shard's copy freed

    def route(chunk: Chunk) -> None:  # the chunk's pieces' tokens, to their shards
        a, b = np.searchsorted(example, [chunk.first, chunk.first + chunk.num_records])
        if stop.is_set():
            raise _Stopped
        if a == b or changed[0]:
            return
        own = np.argsort(shard[a:b], kind="stable") + a
        i = example[own] - chunk.first
        if (pieces[START, own] + pieces[LENGTH, own] > np.diff(chunk.offsets)[i]).any():
            changed[0] = True  # an example shorter than planned: named below
            return
        src = chunk.offsets[i] - chunk.offsets[0] + pieces[START, own]
        at = ragged_arange(src, pieces[LENGTH, own])
        tokens = chunk.tokens().astype(dtype, copy=False)[at]
        cols = {n: chunk.column(n)[at].astype((columns or {}).get(n, np.int64), copy=False)
                for n in options.extra_columns}
        keys, firsts = np.unique(shard[own], return_index=True)
        cuts = np.append(firsts, own.size)
        ends = np.concatenate(([0], np.cumsum(pieces[LENGTH, own])))[cuts].tolist()
        for k, pa, pb, ta, tb in zip(keys.tolist(), cuts[:-1], cuts[1:], ends[:-1], ends[1:]):
            got.setdefault(k, []).append(ShardPart(pieces[:, own[pa:pb]], tokens[ta:tb], {
                n: c[ta:tb] for n, c in cols.items()}))
        held[0] += tokens.nbytes + sum(c.nbytes for c in cols.values())
        if held[0] >= budget:
            _put(sent, ("parts", flush()), stop)

    def scan() -> None:
        try:
            done: tuple = ("done", inputs.scan_file(
                job.path, detect_format(job.path, options.input_format), options,
                load_tokenizer(options.tokenizer) if options.tokenizer else None,
                column_sinks=None, chunk_sink=route))
        except BaseException as e:  # noqa: BLE001 (raised again by the consumer)
            done = ("error", e)
        _put(sent, done, stop)

    thread = threading.Thread(target=scan, name=f"route {job.path}", daemon=True)
    thread.start()
    try:
        while (item := sent.get())[0] == "parts":
            yield from item[1]
    finally:
        stop.set()  # a consumer that stops early stops the scan
        thread.join()
    if item[0] == "error":
        raise item[1]
    if changed[0] or unstamped(item[1].info) != unstamped(job.info):
        raise InputError(f"{job.path}: changed while the job ran (was {job.info}, now "
                         f"{item[1].info}); rerun on inputs that stay put")
    yield from flush()


class _Stopped(Exception):
    """The consumer of `route_file`'s parts stopped: its scan stops too."""


def _put(q: queue.Queue, item: tuple, stop: threading.Event) -> None:
    """q.put(item), unless the consumer stopped."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return
        except queue.Full:
            continue


def column_dtypes(summary: JobSummary) -> dict[str, str]:
    """Each extra column's dtype in the rows (`route_file`'s `columns`)."""
    return {c["name"]: c["dtype"] for c in summary.intent.columns or []}


def plan_parts(shard: int, parts: Sequence[ShardPart], summary: JobSummary, config: PackConfig
               ) -> tuple[PackPlan, list[np.ndarray] | None, dict[str, np.ndarray]]:
    """One shard's plan (`core.shard_plan`), its pieces' tokens in the plan's order (None for
    plan-only parts), and each extra column's `[R, L]` values in place (its pad elsewhere)."""
    table = np.concatenate([part.pieces for part in parts], axis=1)
    p, order = shard_plan(table, shard, summary, config)
    if any(part.tokens is None for part in parts):  # plan-only: the shard is its plan
        return p, None, {}
    tokens = np.concatenate([part.tokens for part in parts])
    starts = (np.cumsum(table[LENGTH]) - table[LENGTH])[order]
    cuts = list(zip(starts.tolist(), table[LENGTH, order].tolist()))
    pieces = [tokens[s : s + m] for s, m in cuts]
    columns = {}
    for c in summary.intent.columns or []:
        values = np.concatenate([part.columns[c["name"]] for part in parts])
        columns[c["name"]] = fill_rows([values[s : s + m] for s, m in cuts], p,
                                       config.seq_len, dtype=np.dtype(c["dtype"]), pad=c["pad"])
    return p, pieces, columns


def write_shard_parts(shard: int, parts: Iterable[ShardPart], summary: JobSummary,
                      output_dir: str, config: PackConfig, *, write_options: WriteOptions,
                      resume: bool = False) -> ShardResult:
    """Writes one shard from the parts its inputs sent (unless `resume` finds it written and
    intact); returns its row count, (size, sha256) and its rows' `ShardFacts` (their part of
    the order profile, `record.order_profile`, and their loss tokens)."""
    parts = list(parts)
    out = OutputDir(output_dir)
    try:
        if resume:
            table = np.concatenate([part.pieces for part in parts], axis=1)
            kept = kept_shard(out, shard, table, summary)
            if kept is not None:
                return kept
        p, pieces, columns = plan_parts(shard, parts, summary, config)
        return write_shard(out, shard, p, summary, config, write_options, pieces=pieces,
                           columns=columns)
    finally:
        out.close()


def plan_in_process(scans: Sequence[FileScan], job: PackJob
                    ) -> tuple[JobSummary | None, list[FileJob]]:
    """The planning steps one after another (tests, and a reading aid for the pipeline)."""
    config, block_size = job.config, job.block_size
    files = [summarize_file(s, config) for s in scans]
    by_block: dict[int, list[BlockSlice]] = {}
    mixed = None
    if job.mixture is not None and not any(f.error for f in files):
        mixed = hashed.select_inputs(job.mixture, [s.lengths for s in scans],
                                     [s.loss_counts for s in scans], block_size)
    cuts = [cut_blocks(s, files, block_size) for s in scans] if job.mixture is None else \
        [cut_stream(mixed, block_size)] if mixed is not None else []
    for block, piece in (c for cut in cuts for c in cut):
        by_block.setdefault(block, []).append(piece)
    plans = [plan_block_slices(b, sl, files, job) for b, sl in by_block.items()]
    summary = finish_plan(files, [p.summary for p in plans], job,
                          mixture=None if mixed is None else mixed.record)
    by_file: dict[int, list[np.ndarray]] = {}
    for p in plans:
        for index, table in split_block(p, summary, files):
            by_file.setdefault(index, []).append(table)
    return summary, [file_job(i, t, files) for i, t in sorted(by_file.items())]
