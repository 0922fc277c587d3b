"""Pass 1 of the offline job, shared by `seqpack pack` and `seqpack verify`: every input read
once, in parallel over inputs, its lengths and fingerprint kept, its tokens spilled.

    read_inputs(paths, options, spill_dir, workers)  ->  Pass1(scans, runs, column_runs)

Each input is scanned chunk by chunk (`formats.inputs.scan_file`: one chunk in memory at a
time) by one worker process, which appends its tokens to raw spill files in `spill_dir`
(`runners.spill`), and each extra column's values (`ReadOptions.extra_columns`: labels, masks)
to spill files of their own, at the same positions as the tokens; the scans come back in input
order, so the lengths and the spill are the same for any number of workers. Memory in this
process: the lengths (8 bytes an example). Rows stored by reference with no extra columns
(`--format index`) need no spill (spill_dir=None): the tokens are read, checked and dropped.

    scan_lengths(paths, options, workers)  ->  each input's example lengths

is the same scan without a spill, for `seqpack stats`' dry run (in this process where the inputs
are small: `_PARALLEL_BYTES`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from seqpack.pipelines import storage
from seqpack.pipelines.errors import InputError
from seqpack.pipelines.formats.inputs import (
    FileScan,
    LossCount,
    ReadOptions,
    check_text_beside_tokens,
    detect_format,
    scan_file,
)
from seqpack.pipelines.formats.text import load_tokenizer
from seqpack.pipelines.offline.runners.spill import Run, SpillWriter
from seqpack.pipelines.offline.runners.workers import Workers

# Test-only: seconds to sleep after each input read and each shard written, so tests can stop a
# run mid-way or watch its progress.
DELAY_ENV = "SEQPACK_TEST_SHARD_DELAY"
# `scan_lengths` reads inputs of fewer bytes than this in all in this process: starting the
# workers costs about 0.3 s on 2 cores (`seqpack stats` on three 100 kB files: 0.71 s with
# them, 0.37 s without), more than scanning 4 MiB of JSONL token lists takes (about 0.2 s);
# at 8 MiB in two files the workers save 0.25 s (1.23 s -> 0.98 s)
_PARALLEL_BYTES = 4 << 20
# ... and more inputs than this count as large unseen: each size is a request on object storage
_PARALLEL_FILES = 64


class Progress(Protocol):
    """What a run reports: a phase ("reading": input bytes; "writing": tokens), then progress
    through it (`rows` written so far, while writing)."""

    def phase(self, name: str, total: int) -> None: ...
    def advance(self, amount: int, rows: int = 0) -> None: ...


def save_context(directory: str, context: Any) -> str:
    """Pickles what every worker of a run needs into `directory` (once per run); the path is
    the workers' cache key, so each run gets a name of its own."""
    import pickle

    path = os.path.join(directory, f"context-{os.getpid()}-{time.time_ns()}.pickle")
    with open(path, "wb") as f:
        pickle.dump(context, f)
    return path


@functools.lru_cache(maxsize=2)
def load_context(path: str) -> Any:
    """`save_context`'s object, loaded once per process."""
    import pickle

    with open(path, "rb") as f:
        return pickle.load(f)


def delay_seconds() -> float:
    return float(os.environ.get(DELAY_ENV, "0") or 0)


def _tokenizer(path: str) -> Any:
    """The tokenizer at `path`, loaded once per process while the file stays the same."""
    st = os.stat(path)
    return _load_tokenizer(path, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _load_tokenizer(path: str, size: int, mtime_ns: int) -> Any:
    return load_tokenizer(path)


def _scan_lengths(path: str, fmt: str, options: ReadOptions) -> tuple[np.ndarray, str]:
    """One input's example lengths (its tokens read and dropped), and its format as read."""
    try:
        scan = scan_file(path, fmt, options, _tokenizer(options.tokenizer) if options.tokenizer
                         else None)
        return scan.lengths, str(scan.info["format"])
    finally:
        _release_arrow_memory()


def _small_inputs(paths: Sequence[str]) -> bool:
    """Whether `paths` hold fewer than `_PARALLEL_BYTES` in all: sizes are asked for one input at
    a time until they pass it, and not at all for more than `_PARALLEL_FILES` inputs (an
    InputError names a missing input asked for)."""
    if len(paths) > _PARALLEL_FILES:
        return False
    total = 0
    for p in paths:
        total += storage.size(os.fspath(p))
        if total >= _PARALLEL_BYTES:
            return False
    return True


def scan_lengths(paths: Sequence[str], options: ReadOptions, workers: Workers
                 ) -> list[np.ndarray]:
    """Each input's example lengths, in input order (`formats.inputs.read_lengths`'s, with the
    inputs scanned in the worker processes: the same for any number of workers)."""
    if not paths:
        raise InputError("no input files given")
    small = _small_inputs(paths)
    if options.tokenizer:
        load_tokenizer(options.tokenizer)  # a bad tokenizer fails here, once
    calls = [(os.fspath(p), detect_format(os.fspath(p), options.input_format), options)
             for p in paths]
    if small:  # starting the worker processes would cost more
        scans = [_scan_lengths(*call) for call in calls]
    else:
        scans = list(workers.map(_scan_lengths, calls, len(calls), what="reading the inputs"))
    check_text_beside_tokens([(call[0], fmt) for call, (_, fmt) in zip(calls, scans)],
                             tokenized=bool(options.tokenizer))
    return [lengths for lengths, _ in scans]


@dataclasses.dataclass(frozen=True)
class Pass1:
    """What pass 1 gives: each input's scan, and the spill (inputs back to back)."""

    scans: list[FileScan]
    runs: list[Run]  # the tokens
    column_runs: dict[str, list[Run]]  # each extra column's values, at the tokens' positions


def _read_input(index: int, path: str, fmt: str, options: ReadOptions, spill_dir: str | None,
                loss_columns: LossCount | None = None
                ) -> tuple[FileScan, list[Run], dict[str, list[Run]]]:
    """Pass 1 for one input: scans it, its tokens (and extra columns) to the spill, or nowhere
    without `spill_dir` (`loss_columns`: count each example's loss tokens too)."""
    tokenizer = _tokenizer(options.tokenizer) if options.tokenizer else None
    if spill_dir is None:
        try:
            return scan_file(path, fmt, options, tokenizer, loss_columns=loss_columns), [], {}
        finally:
            _release_arrow_memory()
    sink = SpillWriter(spill_dir, f"in-{index:06d}")
    columns = {name: SpillWriter(spill_dir, f"in-{index:06d}-c{j}", signed=True)
               for j, name in enumerate(options.extra_columns)}
    try:
        scan = scan_file(path, fmt, options, tokenizer, sink, column_sinks=columns,
                         loss_columns=loss_columns)
    finally:
        runs = sink.close()
        column_runs = {name: w.close() for name, w in columns.items()}
        _release_arrow_memory()
    return scan, runs, column_runs


def _release_arrow_memory() -> None:
    """Gives the memory pyarrow's pool keeps after an input is read back to the system.

    pyarrow's default pool (mimalloc) keeps the pages of a file's batches once they are freed,
    for the next file; nothing after pass 1 allocates from it, so without this the run would
    hold them, unused, through the plan and the shards (more with each input read). Nothing
    happens where pyarrow was never imported (no Parquet input)."""
    pa = sys.modules.get("pyarrow")
    if pa is not None:
        pa.default_memory_pool().release_unused()


def read_inputs(paths: Sequence[str], options: ReadOptions, spill_dir: str | None,
                workers: Workers, progress: Progress | None = None, *,
                loss_columns: LossCount | None = None) -> Pass1:
    """Every input scanned (in parallel), its tokens spilled (spill_dir=None: its tokens read,
    checked and dropped, no runs); scans and runs in input order (`loss_columns`: each scan
    counts its examples' loss tokens, `FileScan.loss_counts`)."""
    if not paths:
        raise InputError("no input files given")
    sizes = [storage.size(os.fspath(p)) for p in paths]  # InputError naming a missing input
    if options.tokenizer:
        load_tokenizer(options.tokenizer)  # a bad tokenizer fails here, once
    if progress:
        progress.phase("reading", sum(sizes))
    calls = [(i, os.fspath(p), detect_format(os.fspath(p), options.input_format), options,
              spill_dir, loss_columns) for i, p in enumerate(paths)]
    done = Pass1([], [], {name: [] for name in options.extra_columns})
    delay = delay_seconds()
    for nbytes, (scan, runs, column_runs) in zip(sizes, workers.map(
            _read_input, calls, len(calls), what="reading the inputs")):
        done.scans.append(scan)
        done.runs.extend(runs)
        for name, more in column_runs.items():
            done.column_runs[name].extend(more)
        if progress:
            progress.advance(nbytes)
        if delay:
            time.sleep(delay)
    return done
