"""The steps of the Beam packing job as plain functions: scan, plan, route tokens, write shards.

`offline.beam` wires these into a pipeline; nothing here imports Beam, so each step runs (and
is tested) on its own. What each step takes and gives, for n examples in P pieces::

    scan_file          one input         -> FileScan: fingerprint, counts, lengths i64[n_f], dtype
    plan_job           every FileScan    -> JobSummary + one FileJob per input holding pieces:
                                            its pieces' places, i64[6, P_f] (example, start,
                                            length, row, slot, offset)
    route_file         one FileJob       -> (shard, ShardPart) per shard the input feeds: the
                                            pieces' places + their tokens, back to back
    write_shard_parts  one shard's parts -> the shard file; returns its row count
    finish_job         all row counts    -> manifest.json

Only lengths travel to the one place that plans (8 bytes per example); tokens travel once, from
the worker reading an input to the worker writing the shard they land in.

Same bytes as the local writer (`offline.writer.pack_to_dir`): the plan is `packer.plan` on the
same lengths in the same order (inputs in the order given, examples in file order), the manifest
comes from the writer's own functions, and a shard's pieces are sorted back into (row, slot)
order and written by `writer.write_shard`, whatever order they arrive in.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence

import numpy as np

from seqpack.packer import Counters, PackConfig, PackPlan, plan
from seqpack.packer.contract import ragged_arange
from seqpack.packer.plan import DEFAULT_BLOCK_SIZE
from seqpack.pipelines.errors import InputError
from seqpack.pipelines.formats import inputs
from seqpack.pipelines.formats.inputs import ReadOptions, detect_format, read_corpus
from seqpack.pipelines.formats.manifest import Manifest
from seqpack.pipelines.formats.text import load_tokenizer
from seqpack.pipelines.offline.writer import (
    WriteOptions,
    commit_manifest,
    inputs_record,
    manifest_results,
    prepare_dir,
    row_dtype,
    run_intent,
    shard_complete,
    write_shard,
)

# Rows of FileJob.pieces / ShardPart.pieces.
EXAMPLE, START, LENGTH, ROW, SLOT, OFFSET = range(6)


@dataclasses.dataclass(frozen=True)
class FileScan:
    """Stage A's result for one input: what the plan needs from it (or why it cannot be read)."""

    index: int  # position of the input in the job's list
    path: str
    info: dict  # the manifest's entry: fingerprint, format, num_examples, num_tokens
    lengths: np.ndarray  # i64[n_f] example lengths, in file order
    dtype: str  # numpy dtype of the file's token ids
    error: str | None = None  # the InputError's message when the file could not be read


@dataclasses.dataclass(frozen=True)
class JobSummary:
    """The small, global part of the plan that the shard writers and the manifest step need."""

    intent: Manifest  # pack_intent.json: config, inputs, shard names, row count
    results: dict  # the manifest's stats and example length histogram
    row_dtype: str  # dtype of the rows' tokens
    shard_rows: int


@dataclasses.dataclass(frozen=True)
class FileJob:
    """Stage C's work for one input: where each of its pieces goes."""

    index: int
    path: str
    info: dict  # from the scan; the re-read must match it (the file must not change mid-job)
    first_example: int  # global index of the file's first example
    pieces: np.ndarray  # i64[6, P_f]: example (global), start, length, row, slot, offset
    dtype: str  # the corpus's token dtype (all inputs together), as the local reader makes it
    shard_rows: int


@dataclasses.dataclass(frozen=True)
class ShardPart:
    """The pieces one input sends to one shard."""

    pieces: np.ndarray  # i64[6, P]: as in FileJob, rows still global
    tokens: np.ndarray  # the pieces' tokens back to back, in the corpus dtype


def scan_file(index: int, path: str, options: ReadOptions) -> FileScan:
    """Reads one input for its example lengths; a bad input gives a FileScan with `error`."""
    try:
        tokenizer = load_tokenizer(options.tokenizer) if options.tokenizer else None
        scan = inputs.scan_file(path, detect_format(path, options.input_format), options,
                                tokenizer)
    except (ValueError, OSError) as e:
        return FileScan(index, path, {}, np.zeros(0, np.int64), "", error=" ".join(str(e).split()))
    return FileScan(index, path, scan.info, scan.lengths, scan.dtype.str)


def plan_job(
    scans: Iterable[FileScan],
    output_dir: str,
    config: PackConfig,
    *,
    read_options: ReadOptions,
    write_options: WriteOptions,
    overwrite: bool = False,
    resume: bool = False,
    block_size: int | None = None,
) -> tuple[JobSummary | None, list[FileJob]]:
    """Plans the whole job on the lengths and readies the output directory.

    Raises InputError for the first bad input (in input order), a ValueError for what the local
    CLI rejects too (no tokens, over-length with overflow="error", a non-empty directory). Returns
    (None, []) when `resume` finds the run already complete.
    """
    scans = sorted(scans, key=lambda s: s.index)
    assert [s.index for s in scans] == list(range(len(scans))), "a scan is missing"
    for s in scans:
        if s.error is not None:
            raise InputError(s.error)
    lengths = np.concatenate([s.lengths for s in scans])
    if not lengths.any():
        raise InputError(f"the inputs hold no tokens ({lengths.size} examples); nothing to pack")
    dtype = inputs.corpus_dtype([np.dtype(s.dtype) for s in scans])
    p = plan(lengths, config, block_size=block_size)
    record = inputs_record([s.info for s in scans], lengths, dtype, read_options)
    intent = run_intent(config, record, write_options, p.num_rows,
                        block_size or DEFAULT_BLOCK_SIZE)
    if prepare_dir(output_dir, intent, overwrite=overwrite, resume=resume) is not None:
        return None, []
    results = manifest_results(p.row, p.length, p.num_rows, p.counters, config, lengths)
    summary = JobSummary(intent, results,
                         row_dtype(dtype, config.pad_id).str, write_options.shard_rows)
    return summary, split_plan(p, scans, dtype=dtype, shard_rows=write_options.shard_rows)


def split_plan(p: PackPlan, scans: Sequence[FileScan], *, dtype: np.dtype,
               shard_rows: int) -> list[FileJob]:
    """One FileJob per input holding pieces (scans in input order)."""
    bounds = np.cumsum([0] + [s.lengths.size for s in scans])
    table = np.stack([p.example, p.start, p.length, p.row, p.slot, p.offset]).astype(np.int64)
    file_of = np.searchsorted(bounds, p.example, side="right") - 1
    order = np.argsort(file_of, kind="stable")
    cuts = np.searchsorted(file_of[order], np.arange(len(scans) + 1))
    jobs = []
    for s, a, b in zip(scans, cuts[:-1].tolist(), cuts[1:].tolist()):
        if b > a:
            jobs.append(FileJob(s.index, s.path, s.info, int(bounds[s.index]),
                                table[:, order[a:b]], np.dtype(dtype).str, shard_rows))
    return jobs


def route_file(job: FileJob, options: ReadOptions) -> list[tuple[int, ShardPart]]:
    """Re-reads one input and cuts its pieces' tokens into one ShardPart per destination shard."""
    corpus = read_corpus([job.path], options)
    if corpus.files[0] != job.info:
        raise InputError(f"{job.path}: changed while the job ran (was {job.info}, now "
                         f"{corpus.files[0]}); rerun on inputs that stay put")
    shard = job.pieces[ROW] // job.shard_rows
    order = np.argsort(shard, kind="stable")
    pieces = job.pieces[:, order]
    src = corpus.offsets[pieces[EXAMPLE] - job.first_example] + pieces[START]
    values = corpus.values.astype(job.dtype, copy=False)
    tokens = values[ragged_arange(src, pieces[LENGTH])]
    shard = shard[order]
    keys, firsts = np.unique(shard, return_index=True)
    piece_cuts = np.append(firsts, shard.size)
    token_cuts = np.concatenate(([0], np.cumsum(pieces[LENGTH])))[piece_cuts]
    return [
        (int(k), ShardPart(pieces[:, a:b], tokens[ta:tb]))
        for k, a, b, ta, tb in zip(keys.tolist(), piece_cuts[:-1].tolist(),
                                   piece_cuts[1:].tolist(), token_cuts[:-1].tolist(),
                                   token_cuts[1:].tolist())
    ]


def shard_plan(shard: int, parts: Iterable[ShardPart], summary: JobSummary,
               config: PackConfig) -> tuple[PackPlan, list[np.ndarray]]:
    """One shard's plan (rows from 0, pieces in (row, slot) order) and its pieces' tokens."""
    parts = list(parts)
    table = np.concatenate([part.pieces for part in parts], axis=1)
    tokens = np.concatenate([part.tokens for part in parts])
    r0 = shard * summary.shard_rows
    num_rows = min(summary.shard_rows, summary.intent.num_rows - r0)
    order = np.argsort((table[ROW] - r0) * config.max_segments + table[SLOT], kind="stable")
    starts = (np.cumsum(table[LENGTH]) - table[LENGTH])[order]
    table = table[:, order]
    rows = table[ROW] - r0
    assert rows.size and rows[0] == 0 and rows[-1] == num_rows - 1, (shard, rows[:1], rows[-1:])
    pieces = [tokens[s : s + m] for s, m in zip(starts.tolist(), table[LENGTH].tolist())]
    p = PackPlan(example=table[EXAMPLE], start=table[START], length=table[LENGTH], row=rows,
                 slot=table[SLOT], offset=table[OFFSET], num_rows=num_rows, counters=Counters())
    return p, pieces


def write_shard_parts(shard: int, parts: Iterable[ShardPart], summary: JobSummary,
                      output_dir: str, config: PackConfig, *, write_options: WriteOptions,
                      resume: bool = False) -> int:
    """Writes one shard from the parts its inputs sent; returns its row count."""
    path = os.path.join(output_dir, summary.intent.shards[shard])
    num_rows = min(summary.shard_rows, summary.intent.num_rows - shard * summary.shard_rows)
    if resume and shard_complete(path, num_rows):
        return num_rows
    p, pieces = shard_plan(shard, parts, summary, config)
    write_shard(path, pieces, p, config, write_options, dtype=np.dtype(summary.row_dtype))
    return num_rows


def finish_job(rows: Iterable[tuple[int, int]], summary: JobSummary, output_dir: str
               ) -> Manifest:
    """Writes manifest.json once every shard is written; returns the manifest."""
    by_shard = dict(rows)
    names = summary.intent.shards
    if sorted(by_shard) != list(range(len(names))):
        missing = sorted(set(range(len(names))) - set(by_shard))
        raise RuntimeError(f"shards {missing[:8]} were not written; the manifest is not written")
    return commit_manifest(output_dir, summary.intent, [by_shard[k] for k in range(len(names))],
                           summary.results)
