"""Packs a corpus offline into ArrayRecord shards of packed rows plus ``manifest.json``.

One global plan (all lengths at once, so best fit decreasing sees every example), then shard by
shard: the shard's rows are assembled, encoded as SQP1 records (`formats.records`; every row of a
run has the same layout, so the record header is computed once and rows are joined around it) and
written to ``rows-00000-of-00012.arrayrecord.tmp``, renamed to its final name when complete.

Output directory::

    rows-00000-of-00003.arrayrecord     rows [0, shard_rows), one SQP1 record per packed row
    ...
    manifest.json                        written last: config, inputs, shards, stats
    pack_intent.json                     only while a run is incomplete (what --resume checks)

Crash safety: a shard exists under its final name only when complete; the manifest is written
last (temporary name + rename), so a directory without ``manifest.json`` is never complete.
`resume=True` keeps the complete shards of an interrupted run with the same inputs and options
(checked against ``pack_intent.json``) and writes the rest; the result has the same bytes as an
uninterrupted run (deterministic plan and writer, no timestamps in the manifest).

Memory: the input tokens plus one shard of rows (``shard_rows * seq_len * 12`` bytes or so).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np

from seqpack.packer import PackConfig, PackPlan, build_rows, plan, stats
from seqpack.pipelines.errors import InputError, UsageError, require
from seqpack.pipelines.formats.arrayrecord import close_quietly, open_reader
from seqpack.pipelines.formats.inputs import (
    Corpus,
    ReadOptions,
    read_corpus,
    tokenizer_fingerprint,
)
from seqpack.pipelines.formats.manifest import (
    INTENT,
    MANIFEST,
    Manifest,
    read_record,
    shard_names,
    write_manifest,
)
from seqpack.pipelines.formats.records import decode_row, encode_row

COMPRESSION = {"none": "uncompressed", "snappy": "snappy", "zstd": "zstd:3"}
# Test-only: seconds to sleep after each finished shard, so tests can kill a run mid-way.
DELAY_ENV = "SEQPACK_TEST_SHARD_DELAY"
_HIST_BINS = 50


class Progress(Protocol):
    def start(self, total_rows: int, total_tokens: int) -> None: ...
    def advance(self, rows: int, tokens: int) -> None: ...


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


def length_histogram(lengths: np.ndarray) -> dict:
    """Example lengths in 50 equal bins over [0, max]: {"edges": [51], "counts": [50]}."""
    top = max(int(lengths.max()) if lengths.size else 1, 1)
    counts, edges = np.histogram(lengths, bins=_HIST_BINS, range=(0, top))
    return {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts]}


def lengths_digest(lengths: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(lengths, "<i8").tobytes()).hexdigest()


def describe_inputs(corpus: Corpus, options: ReadOptions) -> dict:
    """The manifest's ``inputs``: how they were read, fingerprints, counts."""
    return inputs_record(corpus.files, corpus.lengths, corpus.values.dtype, options)


def inputs_record(files: list[dict], lengths: np.ndarray, dtype: np.dtype,
                  options: ReadOptions) -> dict:
    """`describe_inputs` from its parts: per-file info, all example lengths, the token dtype."""
    return {
        "read_options": dataclasses.asdict(options),
        "tokenizer": tokenizer_fingerprint(options.tokenizer),
        "files": files,
        "num_examples": int(lengths.size),
        "num_tokens": int(lengths.sum()),
        "token_dtype": np.dtype(dtype).str,
        "lengths_sha256": lengths_digest(lengths),
    }


def run_intent(config: PackConfig, inputs: dict, options: WriteOptions, num_rows: int
               ) -> Manifest:
    """What the run writes (``pack_intent.json``: the manifest without its results)."""
    return Manifest(
        config=config.to_dict(),
        inputs=json.loads(json.dumps(inputs)),
        writer_options=options.arrayrecord_options,
        stored_keys=stored_keys(config, options),
        shard_rows=options.shard_rows,
        num_rows=num_rows,
        shards=shard_names(num_rows, options.shard_rows),
    )


def stored_keys(config: PackConfig, options: WriteOptions) -> list[str]:
    """The contract keys each record holds (segment ids / positions only with store_derived)."""
    k = config.keys()
    derived = () if options.store_derived else k.derived
    return [name for name in k.roles().values() if name not in derived]


def manifest_results(p: PackPlan, config: PackConfig, lengths: np.ndarray) -> dict:
    """The manifest's ``stats`` and ``example_length_histogram``."""
    return json.loads(json.dumps({
        "stats": stats(p, seq_len=config.seq_len, max_segments=config.max_segments).to_dict(),
        "example_length_histogram": length_histogram(lengths),
    }))


def commit_manifest(output_dir: str, intent: Manifest, shard_num_rows: list[int],
                    results: dict) -> Manifest:
    """Writes ``manifest.json`` (from here on the run is complete), then drops the intent."""
    manifest = intent.completed(shard_num_rows, results)
    write_manifest(output_dir, manifest)
    os.remove(os.path.join(output_dir, INTENT))
    return manifest


def row_dtype(values_dtype: np.dtype, pad_id: int) -> np.dtype:
    """The rows' token dtype: the inputs' dtype, widened when it cannot hold `pad_id`."""
    dtype = np.dtype(values_dtype)
    if not np.can_cast(np.min_scalar_type(pad_id), dtype):
        dtype = np.result_type(dtype, np.min_scalar_type(pad_id))
    return dtype


def _owned(name: str) -> bool:
    return name.startswith("rows-") and ".arrayrecord" in name or name in (
        MANIFEST, INTENT, MANIFEST + ".tmp", INTENT + ".tmp")


def prepare_dir(output_dir: str, intent: Manifest, *, overwrite: bool, resume: bool
                ) -> Manifest | None:
    """Readies the directory; returns the finished manifest when resuming a complete run."""
    if overwrite and resume:
        raise UsageError("pass either --overwrite or --resume, not both")
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise UsageError(f"{output_dir}: exists and is not a directory")
    os.makedirs(output_dir, exist_ok=True)
    names = os.listdir(output_dir)
    recorded = [n for n in (MANIFEST, INTENT) if n in names]
    if resume and recorded:
        path = os.path.join(output_dir, recorded[0])
        try:
            old = read_record(path)
        except InputError as e:
            raise InputError(f"{e}; rerun with --overwrite") from None
        _check_same_run(path, old.intent().to_json(), intent.to_json())
        if old.complete:  # the run had finished
            if INTENT in names:  # killed between writing the manifest and this cleanup
                os.remove(os.path.join(output_dir, INTENT))
            return old
    elif names and not overwrite and any(not n.endswith(".tmp") for n in names):
        hint = "--overwrite to replace it" + ("" if resume else " or --resume to finish an "
                                               "interrupted run")
        what = "holds no interrupted run to resume" if resume else "exists and is not empty"
        raise UsageError(f"{output_dir}: {what}; pass {hint}")
    for name in names:
        if _owned(name) and (overwrite or name.endswith(".tmp")):
            os.remove(os.path.join(output_dir, name))
    write_manifest(output_dir, intent)
    return None


def _check_same_run(path: str, old: dict, new: dict) -> None:
    diff = [k for k in new if old.get(k) != new[k]]
    if diff:
        raise UsageError(f"cannot resume: {', '.join(diff)} differ from the run recorded in "
                         f"{path}; rerun with --overwrite")


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


def sub_plan(p: PackPlan, bounds: np.ndarray, r0: int, r1: int) -> PackPlan:
    """The pieces of rows [r0, r1) of plan `p`, rows renumbered from 0."""
    a, b = int(bounds[r0]), int(bounds[r1])
    return dataclasses.replace(
        p, example=p.example[a:b], start=p.start[a:b], length=p.length[a:b],
        row=p.row[a:b] - r0, slot=p.slot[a:b], offset=p.offset[a:b], num_rows=r1 - r0,
    )


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


def shard_complete(path: str, num_rows: int) -> bool:
    if not os.path.isfile(path):
        return False
    try:
        reader = open_reader(path)
    except InputError:
        return False
    try:
        return reader.num_records() == num_rows
    except RuntimeError:
        return False
    finally:
        close_quietly(reader)


def write_shard(path: str, pieces: Sequence[np.ndarray], p: PackPlan, config: PackConfig,
                options: WriteOptions, *, dtype: np.dtype,
                encoder: RowEncoder | None = None) -> RowEncoder:
    """Assembles the rows of plan `p` (one shard's rows, numbered from 0) and writes them.

    `pieces[i]` holds the tokens of the plan's i-th piece. Writes `path.tmp`, renamed to `path`
    when complete; returns the encoder, for the next shard of the run (same row layout).
    """
    batch = build_rows(pieces, p, config, dtype=dtype, derived=options.store_derived)
    encoder = encoder or RowEncoder(batch)
    writer = _open_writer(path + ".tmp", options.arrayrecord_options)
    for record in encoder.records(batch):
        writer.write(record)
    writer.close()
    del batch
    if options.fsync:
        _fsync(path + ".tmp")
    os.replace(path + ".tmp", path)
    if options.fsync:
        _fsync(os.path.dirname(path) or ".")  # the rename itself
    return encoder


def write_shards(corpus: Corpus, p: PackPlan, config: PackConfig, output_dir: str,
                 names: list[str], options: WriteOptions, *, resume: bool = False,
                 progress: Progress | None = None) -> list[int]:
    """Assembles and writes every shard not already complete; returns rows per shard."""
    values, offsets = corpus.values, corpus.offsets
    dtype = row_dtype(values.dtype, config.pad_id)
    bounds = p.row_slices()
    src = offsets[p.example] + p.start
    delay = float(os.environ.get(DELAY_ENV, "0") or 0)
    encoder = None
    rows_per_shard = []
    for i, name in enumerate(names):
        r0 = i * options.shard_rows
        r1 = min(r0 + options.shard_rows, p.num_rows)
        rows_per_shard.append(r1 - r0)
        a, b = int(bounds[r0]), int(bounds[r1])
        tokens = int(p.length[a:b].sum())
        path = os.path.join(output_dir, name)
        if resume and shard_complete(path, r1 - r0):
            if progress:
                progress.advance(r1 - r0, tokens)
            continue
        pieces = [values[s : s + m] for s, m in zip(src[a:b].tolist(), p.length[a:b].tolist())]
        encoder = write_shard(path, pieces, sub_plan(p, bounds, r0, r1), config, options,
                              dtype=dtype, encoder=encoder)
        del pieces
        if progress:
            progress.advance(r1 - r0, tokens)
        if delay:
            time.sleep(delay)
    return rows_per_shard


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
) -> Manifest:
    """Reads, plans, writes shards, then the manifest; returns the manifest."""
    output_dir = os.fspath(output_dir)
    read_options = read_options or ReadOptions()
    write_options = write_options or WriteOptions()
    corpus = read_corpus(paths, read_options)
    if corpus.offsets[-1] == corpus.offsets[0]:
        raise InputError(f"the inputs hold no tokens ({corpus.offsets.size - 1} examples); "
                         "nothing to pack")
    p = plan(corpus.lengths, config)
    intent = run_intent(config, describe_inputs(corpus, read_options), write_options, p.num_rows)
    done = prepare_dir(output_dir, intent, overwrite=overwrite, resume=resume)
    if done is not None:
        return done
    if progress:
        progress.start(p.num_rows, int(p.length.sum()))
    rows = write_shards(corpus, p, config, output_dir, intent.shards, write_options,
                        resume=resume, progress=progress)
    return commit_manifest(output_dir, intent, rows, manifest_results(p, config, corpus.lengths))
