"""Packs a corpus offline into ArrayRecord shards of packed rows plus ``manifest.json``.

Two passes, memory bounded by the number of examples, not tokens:

1. read: every input is read once, chunk by chunk (`formats.inputs.scan_file`), in parallel over
   inputs: its example lengths and fingerprint come back, its tokens go to raw spill files in
   ``spill.tmp/`` (`offline.spill`).
2. plan: one plan on all the lengths (`packer.plan_rows`: best fit decreasing sees every example
   of a block of `block_size` examples, by default about four million), 4 bytes a piece.
3. write: shard by shard, in parallel: the shard's pieces are gathered from the spill, its rows
   assembled, encoded as SQP1 records (`formats.records`; every row of a run has the same layout,
   so the record header is computed once and rows are joined around it) and written to
   ``rows-00000-of-00012.arrayrecord.tmp``, renamed to its final name when complete.

The main process holds a few dozen bytes per example (lengths, the plan, each piece's source:
27 bytes an added example measured at 48x chat_dev) and hands out one shard at a time to each
worker; a worker holds one input chunk or one shard's rows. `workers` processes (`seqpack pack`:
the CPU count) read inputs and write shards; the bytes are the same for any number of workers,
and the same as `packer.pack_ragged` on the whole corpus.

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
directory without ``manifest.json`` is never complete. `resume=True` keeps the shards of an
interrupted run with the same inputs and options (checked against ``pack_intent.json``) whose
content matches their record, rewrites the rest, and repairs a complete run whose shards no
longer match the manifest; the result has the same bytes as an uninterrupted run (deterministic
plan and writer, no timestamps in the manifest). A resumed run reads the inputs again (pass 1
keeps nothing across runs: the spill is a cache of this run).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from seqpack.packer import Counters, PackConfig, PackPlan, build_rows
from seqpack.packer.plan import RowAssignment, order_pieces, pieces, plan_rows
from seqpack.packer.stats import PackingStats, stats_of_pieces
from seqpack.pipelines import storage
from seqpack.pipelines.errors import InputError, UsageError, require
from seqpack.pipelines.formats.inputs import (
    FileScan,
    ReadOptions,
    combined_lengths_sha256,
    corpus_dtype,
    detect_format,
    scan_file,
    tokenizer_fingerprint,
)
from seqpack.pipelines.formats.manifest import (
    Manifest,
    file_digest,
    shard_names,
)
from seqpack.pipelines.formats.records import decode_row, encode_row
from seqpack.pipelines.formats.text import load_tokenizer
from seqpack.pipelines.offline.outdir import (
    DirLock,
    OutputDir,
    as_output_dir,
    check_dir,
    commit_manifest,
    prepare_dir,
    shard_done,
    write_done,
)
from seqpack.pipelines.offline.spill import SPILL_DIR, Run, SpillReader, SpillWriter
from seqpack.pipelines.offline.workers import Workers

COMPRESSION = {"none": "uncompressed", "snappy": "snappy", "zstd": "zstd:3"}
# Test-only: seconds to sleep after each input read and each shard written, so tests can kill a
# run mid-way or watch its progress.
DELAY_ENV = "SEQPACK_TEST_SHARD_DELAY"
_HIST_BINS = 50


class Progress(Protocol):
    """What the writer reports: a phase ("reading": input bytes; "writing": tokens), then
    progress through it (`rows` written so far, while writing)."""

    def phase(self, name: str, total: int) -> None: ...
    def advance(self, amount: int, rows: int = 0) -> None: ...


@dataclasses.dataclass(frozen=True)
class WriteOptions:
    """How the rows are stored."""

    shard_rows: int = 1024  # packed rows per shard file
    compression: str = "none"  # a key of COMPRESSION
    fsync: bool = False  # fsync each shard before its rename (durability beyond process crashes)
    # Also store f_segment_ids / f_positions. Off: readers rebuild them from the [S] metadata
    # (`packer.contract.restore_derived`), and the shards are about a third of the size.
    store_derived: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.shard_rows, bool) or not isinstance(self.shard_rows, int) \
                or self.shard_rows < 1:
            raise ValueError(f"shard_rows={self.shard_rows!r} must be an int >= 1")
        if self.compression not in COMPRESSION:
            raise ValueError(f"compression={self.compression!r} must be one of {list(COMPRESSION)}")

    @property
    def arrayrecord_options(self) -> str:
        return f"group_size:1,{COMPRESSION[self.compression]}"


def length_histogram(lengths: np.ndarray, top: int | None = None) -> dict:
    """Example lengths in 50 equal bins over [0, max(top, 1)] (top: the longest example, by
    default of `lengths`): {"edges": [51], "counts": [50]}. Counts of parts of a corpus
    binned with the corpus's `top` add up to the corpus's."""
    if top is None:
        top = int(lengths.max()) if lengths.size else 1
    counts, edges = np.histogram(lengths, bins=_HIST_BINS, range=(0, max(top, 1)))
    return {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts]}


def inputs_record(files: list[dict], dtype: np.dtype, options: ReadOptions) -> dict:
    """The manifest's ``inputs``: how they were read, each input's entry (fingerprint, counts,
    lengths digest), totals, the token dtype."""
    return {
        "read_options": dataclasses.asdict(options),
        "tokenizer": tokenizer_fingerprint(options.tokenizer),
        "files": files,
        "num_examples": sum(int(f["num_examples"]) for f in files),
        "num_tokens": sum(int(f["num_tokens"]) for f in files),
        "token_dtype": np.dtype(dtype).str,
        "lengths_sha256": combined_lengths_sha256(files),
    }


def run_intent(config: PackConfig, inputs: dict, options: WriteOptions, num_rows: int,
               block_size: int) -> Manifest:
    """What the run writes (``pack_intent.json``: the manifest without its results)."""
    return Manifest(
        config=config.to_dict(),
        inputs=json.loads(json.dumps(inputs)),
        writer_options=options.arrayrecord_options,
        stored_keys=stored_keys(config, options),
        shard_rows=options.shard_rows,
        num_rows=num_rows,
        shards=shard_names(num_rows, options.shard_rows),
        plan_block_size=block_size,
    )


def stored_keys(config: PackConfig, options: WriteOptions) -> list[str]:
    """The contract keys each record holds (segment ids / positions only with store_derived)."""
    k = config.keys()
    derived = () if options.store_derived else k.derived
    return [name for name in k.roles().values() if name not in derived]


def manifest_results(stats: PackingStats, length_hist: dict) -> dict:
    """The manifest's ``stats`` and ``example_length_histogram``."""
    return json.loads(json.dumps({"stats": stats.to_dict(),
                                  "example_length_histogram": length_hist}))


def row_dtype(values_dtype: np.dtype, pad_id: int) -> np.dtype:
    """The rows' token dtype: the inputs' dtype, widened when it cannot hold `pad_id`."""
    dtype = np.dtype(values_dtype)
    if not np.can_cast(np.min_scalar_type(pad_id), dtype):
        dtype = np.result_type(dtype, np.min_scalar_type(pad_id))
    return dtype


class RowEncoder:
    """SQP1 records for the rows of a batch; same bytes as `encode_row` row by row."""

    def __init__(self, batch: dict[str, np.ndarray]):
        self.keys = list(batch)
        template = encode_row({k: batch[k][0] for k in self.keys})
        views = decode_row(template, restore=False)
        base = np.frombuffer(template, np.uint8).ctypes.data
        self.parts: list = []
        self.slots: list[int] = []
        pos = 0
        for k in self.keys:
            start = views[k].ctypes.data - base
            assert views[k].nbytes and start >= pos, k
            self.parts.append(template[pos:start])
            self.slots.append(len(self.parts))
            self.parts.append(b"")
            pos = start + views[k].nbytes
        self.parts.append(template[pos:])
        self.fast = sys.byteorder == "little"

    def records(self, batch: dict[str, np.ndarray]) -> Iterator[bytes]:
        """Yields the record of each row in order."""
        arrays = [np.ascontiguousarray(batch[k]) for k in self.keys]
        num_rows = arrays[0].shape[0]
        if not self.fast:  # pragma: no cover - big-endian hosts
            for r in range(num_rows):
                yield encode_row({k: a[r] for k, a in zip(self.keys, arrays)})
            return
        parts, slots = list(self.parts), self.slots
        for r in range(num_rows):
            for slot, a in zip(slots, arrays):
                parts[slot] = a[r].data
            yield b"".join(parts)


def _open_writer(path: str, options: str):
    module = require("array_record.python.array_record_module", "writing shards")
    return module.ArrayRecordWriter(path, options)


def _fsync(path: str) -> None:
    """fsync a file or a directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_shard(output_dir: str | OutputDir, name: str, pieces: Sequence[np.ndarray] | None,
                p: PackPlan, config: PackConfig, options: WriteOptions, *, dtype: np.dtype,
                values: np.ndarray | None = None) -> tuple[int, str]:
    """Assembles the rows of plan `p` (one shard's rows, numbered from 0) and writes them.

    `pieces[i]` holds the tokens of the plan's i-th piece (or `values` the rows' tokens already
    in place, see `packer.build_rows`). Writes ``name.tmp`` in the output's staging directory,
    published as `name` when complete (a rename, or an upload), then the shard's completion
    record (`name` + ".done": rows, size, sha256); returns (size, sha256).
    """
    out = as_output_dir(output_dir)
    path = os.path.join(out.staging(), name)
    batch = build_rows(pieces, p, config, dtype=dtype, derived=options.store_derived,
                       values=values)
    encoder = RowEncoder(batch)
    writer = _open_writer(path + ".tmp", options.arrayrecord_options)
    for record in encoder.records(batch):
        writer.write(record)
    writer.close()
    del batch
    if options.fsync:
        _fsync(path + ".tmp")
    digest = file_digest(path + ".tmp")
    out.publish(path + ".tmp", name)
    if options.fsync and not out.remote:
        _fsync(out.location)  # the rename itself
    write_done(out, name, p.num_rows, digest)
    return digest


# -- the run: workers, pass 1 (read), plan, pass 2 (write) ---------------------------------------


@dataclasses.dataclass(frozen=True)
class _RunContext:
    """What every worker needs for pass 2, written once to the spill directory."""

    output_dir: str
    stage: str  # where shards are written before they are published (output_dir when local)
    config: PackConfig
    options: WriteOptions
    dtype: str  # the rows' token dtype
    runs: list[Run]  # the spill, inputs back to back


@dataclasses.dataclass(frozen=True)
class _ShardTask:
    index: int
    name: str
    plan: PackPlan  # the shard's rows, numbered from 0
    src: np.ndarray  # i64[P] global token position of each piece


@functools.lru_cache(maxsize=2)
def _context(path: str) -> tuple[_RunContext, SpillReader]:
    import pickle

    with open(path, "rb") as f:
        context = pickle.load(f)
    return context, SpillReader(context.runs)


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str) -> Any:
    return load_tokenizer(path)


def _read_input(index: int, path: str, fmt: str, options: ReadOptions, spill_dir: str
                ) -> tuple[FileScan, list[Run]]:
    """Pass 1 for one input: scans it, its tokens to the spill."""
    tokenizer = _tokenizer(options.tokenizer) if options.tokenizer else None
    sink = SpillWriter(spill_dir, f"in-{index:06d}")
    try:
        scan = scan_file(path, fmt, options, tokenizer, sink)
    finally:
        runs = sink.close()
    return scan, runs


def _write_task(context_path: str, task: _ShardTask) -> tuple[int, int, tuple[int, str]]:
    """Pass 2 for one shard: gathers its pieces from the spill, writes it; (index, rows,
    (size, sha256))."""
    context, spill = _context(context_path)
    p, config = task.plan, context.config
    values = np.full(p.num_rows * config.seq_len, config.pad_id, np.dtype(context.dtype))
    spill.read_into(values, p.row * config.seq_len + p.offset, task.src, p.length)
    out = OutputDir(context.output_dir, stage=context.stage)
    digest = write_shard(out, task.name, None, p, config, context.options, dtype=values.dtype,
                         values=values.reshape(p.num_rows, config.seq_len))
    return task.index, p.num_rows, digest


def read_inputs(paths: Sequence[str], options: ReadOptions, spill_dir: str, workers: Workers,
                progress: Progress | None = None) -> tuple[list[FileScan], list[Run]]:
    """Pass 1: every input scanned (in parallel), its tokens spilled; scans and runs in order."""
    if not paths:
        raise InputError("no input files given")
    sizes = [storage.size(os.fspath(p)) for p in paths]  # InputError naming a missing input
    if options.tokenizer:
        load_tokenizer(options.tokenizer)  # a bad tokenizer fails here, once
    if progress:
        progress.phase("reading", sum(sizes))
    calls = [(i, os.fspath(p), detect_format(os.fspath(p), options.input_format), options,
              spill_dir) for i, p in enumerate(paths)]
    scans, runs = [], []
    delay = float(os.environ.get(DELAY_ENV, "0") or 0)
    for nbytes, (scan, file_runs) in zip(sizes, workers.map(_read_input, calls, len(calls))):
        scans.append(scan)
        runs.extend(file_runs)
        if progress:
            progress.advance(nbytes)
        if delay:
            time.sleep(delay)
    return scans, runs


@dataclasses.dataclass(frozen=True)
class _Pieces:
    """Every piece of a `RowAssignment`, sorted by row: where it comes from and where it goes."""

    example: np.ndarray  # i64[P]
    start: np.ndarray  # i32/i64[P]
    length: np.ndarray  # i32/i64[P]
    row: np.ndarray  # i32/i64[P], sorted
    bounds: np.ndarray  # i64[R + 1]: pieces of row r are [bounds[r], bounds[r + 1])


def _sorted_pieces(a: RowAssignment, lengths: np.ndarray, config: PackConfig) -> _Pieces:
    """12 bytes a piece (16 past 2**31 examples), plus the row; the piece order is a plan's:
    (row, example, start)."""
    small = np.int32 if int(lengths.max(initial=0)) < 2**31 else np.int64
    example = np.empty(a.num_pieces, np.int32 if lengths.size < 2**31 else np.int64)
    start = np.empty(a.num_pieces, small)
    length = np.empty(a.num_pieces, small)
    at = 0
    for e, s, n in pieces(lengths, config, block_size=a.block_size):
        example[at : at + e.size], start[at : at + e.size], length[at : at + e.size] = e, s, n
        at += e.size
    order = np.argsort(a.row, kind="stable")
    example = example[order]  # one array at a time: one extra copy alive, not three
    start = start[order]
    length = length[order]
    row = a.row[order]
    del order
    bounds = np.zeros(a.num_rows + 1, np.int64)
    np.cumsum(np.bincount(row, minlength=a.num_rows), out=bounds[1:])
    return _Pieces(example, start, length, row, bounds)


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
    delay = float(os.environ.get(DELAY_ENV, "0") or 0)
    tasks = _shard_tasks(ps, offsets, context.config, names, shard_rows, todo)
    calls = ((context_path, t) for t in tasks)
    for i, n, digest in workers.map(_write_task, calls, len(todo)):
        assert n == rows[i]
        digests[i] = digest
        done += n
        if progress:
            progress.advance(tokens[i], done)
        if delay:
            time.sleep(delay)
    return rows, digests


def _save_context(spill_dir: str, context: _RunContext) -> str:
    import pickle

    # A name of its own per run: workers cache the context by path.
    path = os.path.join(spill_dir, f"context-{os.getpid()}-{time.time_ns()}.pickle")
    with open(path, "wb") as f:
        pickle.dump(context, f)
    return path


def pack_to_dir(
    paths: Sequence[str],
    output_dir: str,
    config: PackConfig,
    *,
    read_options: ReadOptions | None = None,
    write_options: WriteOptions | None = None,
    overwrite: bool = False,
    resume: bool = False,
    progress: Progress | None = None,
    workers: int | None = None,
    block_size: int | None = None,
) -> Manifest:
    """Reads, plans, writes shards, then the manifest; returns the manifest.

    `workers`: processes that read inputs and write shards (1, the default, runs everything in
    this process; `seqpack pack` passes the CPU count); the output does not depend on it. A
    script calling this with workers > 1 needs the ``if __name__ == "__main__":`` guard
    (the workers start through multiprocessing's fork server, which imports the main module).
    `block_size`: examples planned together (`packer.plan_rows`); it is part of the run
    (recorded in the manifest).
    """
    output_dir = os.fspath(output_dir)
    read_options = read_options or ReadOptions()
    write_options = write_options or WriteOptions()
    if workers is not None and (isinstance(workers, bool) or workers < 1):
        raise UsageError(f"workers={workers!r} must be >= 1")
    block_size = plan_rows(np.zeros(0, np.int64), config, block_size=block_size).block_size
    out = OutputDir(output_dir)
    check_dir(out, overwrite=overwrite, resume=resume)
    created = out.makedirs()
    spill_dir = os.path.join(out.staging(), SPILL_DIR)  # a local directory either way
    pool = Workers(workers or 1)
    started = False
    lock = DirLock(out)
    try:
        lock.__enter__()  # one run per directory, from here to the end
        shutil.rmtree(spill_dir, ignore_errors=True)
        os.makedirs(spill_dir)
        scans, runs = read_inputs(paths, read_options, spill_dir, pool, progress)
        infos, dtype = [s.info for s in scans], corpus_dtype([s.dtype for s in scans])
        lengths = np.concatenate([s.lengths for s in scans])
        del scans
        if not lengths.sum():
            raise InputError(f"the inputs hold no tokens ({lengths.size} examples); nothing to "
                             "pack")
        if lengths.max() < 2**31:
            lengths = lengths.astype(np.int32)  # 4 bytes an example from here on
        assignment = plan_rows(lengths, config, block_size=block_size)
        inputs = inputs_record(infos, dtype, read_options)
        intent = run_intent(config, inputs, write_options, assignment.num_rows, block_size)
        done = prepare_dir(out, intent, overwrite=overwrite, resume=resume)
        if done is not None:
            return done
        started = True
        ps = _sorted_pieces(assignment, lengths, config)
        s = stats_of_pieces(ps.row, ps.length, assignment.num_rows, config.seq_len,
                            config.max_segments, assignment.counters)
        results = manifest_results(s, length_histogram(lengths))
        offsets = np.zeros(lengths.size + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        del lengths, assignment
        context = _RunContext(output_dir, out.staging(), config, write_options,
                              row_dtype(dtype, config.pad_id).str, runs)
        rows, digests = write_shards(ps, offsets, context, intent.shards, pool,
                                     _save_context(spill_dir, context), resume=resume,
                                     progress=progress)
        return commit_manifest(out, intent, rows, results, digests)
    finally:
        pool.close()
        if lock.held:
            shutil.rmtree(spill_dir, ignore_errors=True)
        lock.__exit__()
        out.close()
        if created and not started and os.path.isdir(output_dir) and not os.listdir(output_dir):
            os.rmdir(output_dir)
