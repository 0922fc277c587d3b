"""Reads a packed directory back and proves it lossless against its inputs; reads single rows.

`verify(output_dir, inputs)` re-reads the inputs (the way the manifest says they were read) and
checks, shard by shard:

    0. every shard's size and sha256 match the manifest (which matches its own digest);
    1. each input's fingerprint and the example lengths match the manifest;
    2. every shard decodes, holds the manifest's row count, and satisfies the row contract
       (`packer.validate`: shapes, dtypes, slot order, offsets, segment ids, positions, padding);
    3. every segment's tokens equal its source: example `segment_source_index`, from
       `segment_source_start`, in order;
    4. over all shards, each example's pieces tile [0, kept) exactly once, and what is not kept is
       what the overflow policy allows and the manifest's counters say (truncated / dropped /
       split examples and tokens); the manifest's stats match the rows.

A shard that cannot be decoded is bad input (`InputError`); everything else is a violation,
collected (first `max_violations`) in the returned report.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Sequence

import numpy as np

from seqpack.packer import Counters, PackConfig, validate
from seqpack.packer.contract import ragged_arange, restore_derived
from seqpack.packer.stats import length_histograms, stats_from_histograms
from seqpack.pipelines import storage
from seqpack.pipelines.errors import InputError
from seqpack.pipelines.formats.arrayrecord import (
    close_quietly,
    decode,
    first_line,
    open_reader,
    read_raw,
)
from seqpack.pipelines.formats.inputs import (
    ReadOptions,
    combined_lengths_sha256,
    detect_format,
    fingerprint,
    scan_file,
)
from seqpack.pipelines.formats.manifest import Manifest, read_manifest
from seqpack.pipelines.formats.text import load_tokenizer
from seqpack.pipelines.offline.outdir import OutputDir
from seqpack.pipelines.offline.spill import Run, SpillReader, SpillWriter


@dataclasses.dataclass
class VerifyReport:
    ok: bool
    violations: list[str]
    num_rows: int
    num_examples: int
    tokens_checked: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def load_manifest(output_dir: str) -> tuple[Manifest, PackConfig]:
    """The manifest of a packed directory and its PackConfig; InputError if there is none."""
    manifest = read_manifest(output_dir)
    return manifest, manifest.pack_config()


def read_shard(output_dir: str, name: str, num_rows: int | None = None) -> dict[str, np.ndarray]:
    """All rows of one shard stacked into `[R, ...]` arrays; InputError if it is corrupt.
    A shard on object storage is read from a temporary local copy."""
    url = storage.join(output_dir, name)
    with storage.local_copy(url) as local, storage.named(local, url):
        return _read_local_shard(local, num_rows)


def _read_local_shard(path: str, num_rows: int | None) -> dict[str, np.ndarray]:
    reader = open_reader(path)
    try:
        try:
            n = reader.num_records()
            if num_rows is not None and n != num_rows:
                raise InputError(f"{path}: holds {n} rows, the manifest says {num_rows}; "
                                 "the shard is incomplete or replaced")
            raws = reader.read_all()
        except RuntimeError as e:
            raise InputError(f"{path}: corrupt shard ({first_line(e)})") from None
        rows = [decode(raw, path, j, restore=False) for j, raw in enumerate(raws)]
    finally:
        close_quietly(reader)
    if not rows:
        return {}
    keys = list(rows[0])
    try:
        batch = {k: np.stack([r[k] for r in rows]) for k in keys}
    except (KeyError, ValueError) as e:
        raise InputError(f"{path}: rows have different keys or shapes ({e})") from None
    return restore_derived(batch)  # once for the shard, not per row


def read_row(output_dir: str, index: int) -> tuple[dict[str, np.ndarray], Manifest, str, int]:
    """(row, manifest, shard name, record index) of packed row `index` (negative from the end)."""
    manifest, _ = load_manifest(output_dir)
    counts = manifest.shard_num_rows or []
    total = int(sum(counts))
    if not -total <= index < total:
        raise InputError(f"row {index} is out of range: {output_dir} holds {total} rows")
    index %= total
    cum = np.cumsum([0, *counts])
    shard = int(np.searchsorted(cum, index, side="right")) - 1
    name, j = manifest.shards[shard], index - int(cum[shard])
    path = storage.join(output_dir, name)
    with storage.local_copy(path) as local, storage.named(local, path):  # a URL: one shard
        reader = open_reader(local)
        try:
            row = decode(read_raw(reader, local, [j])[0], local, j)
        finally:
            close_quietly(reader)
    return row, manifest, name, j


class _Collector:
    def __init__(self, limit: int):
        self.items: list[str] = []
        self.limit = limit

    def add(self, msg: str) -> None:
        if len(self.items) < self.limit:
            self.items.append(msg)

    @property
    def full(self) -> bool:
        return len(self.items) >= self.limit


def _check_tokens(batch, config, spill: SpillReader, offsets, lengths, shard, out: _Collector):
    """Segment tokens == source tokens (read from the spill); returns (example, start, length)
    of the used slots."""
    k = config.keys()
    seg_len = batch[k.segment_lengths].astype(np.int64)
    used = seg_len > 0
    rows, slots = np.nonzero(used)
    ex = batch[k.source_index][rows, slots]
    st = batch[k.source_start][rows, slots]
    ln = seg_len[rows, slots]
    bad = (ex < 0) | (ex >= lengths.size)
    bad[~bad] |= st[~bad] + ln[~bad] > lengths[ex[~bad]]
    if bad.any():
        i = int(np.argmax(bad))
        out.add(f"{shard} row {rows[i]} slot {slots[i]}: source example {ex[i]} [{st[i]}, "
                f"{st[i] + ln[i]}) is not inside the {lengths.size} input examples")
        keep = ~bad
        rows, slots, ex, st, ln = rows[keep], slots[keep], ex[keep], st[keep], ln[keep]
    L = config.seq_len
    dst = ragged_arange(rows * L + batch[k.segment_offsets][rows, slots], ln)
    got = batch[k.values].reshape(-1)[dst]
    want = np.empty(got.size, got.dtype if got.dtype.kind in "iu" else np.int64)
    spill.read_into(want, np.cumsum(ln) - ln, offsets[ex] + st, ln)
    diff = np.flatnonzero(got != want)
    if diff.size:
        d = int(diff[0])
        seg = int(np.searchsorted(np.cumsum(ln), d, side="right"))
        r, s = int(rows[seg]), int(slots[seg])
        pos = int(dst[d] - r * L)
        within = int(st[seg] + d - (np.cumsum(ln)[seg] - ln[seg]))
        out.add(f"{shard} row {r} slot {s} position {pos}: token {got[d]} != {want[d]}, "
                f"token {within} of example {ex[seg]} ({diff.size} tokens differ in this "
                "shard)")
    return ex, st, ln, int(ln.sum())


def _read_inputs(paths: Sequence[str], options: ReadOptions, spill_dir: str
                 ) -> tuple[list[dict], np.ndarray, list[Run]]:
    """The inputs read once, chunk by chunk: each one's manifest entry (fingerprint, counts,
    lengths digest), every example length, and their tokens spilled to `spill_dir` (what the
    rows are compared against, a shard at a time: memory bounded by examples, not tokens)."""
    tokenizer = load_tokenizer(options.tokenizer) if options.tokenizer else None
    files, lengths, runs = [], [], []
    for i, path in enumerate(paths):
        sink = SpillWriter(spill_dir, f"in-{i:06d}")
        try:
            scan = scan_file(path, detect_format(path, options.input_format), options,
                             tokenizer, sink)
        finally:
            runs += sink.close()
        files.append(scan.info)
        lengths.append(scan.lengths)
    return files, np.concatenate(lengths) if lengths else np.zeros(0, np.int64), runs


def _check_coverage(ex, st, ln, lengths, config, counters: Counters, out: _Collector) -> None:
    """Each example's pieces tile [0, kept) once; the rest matches the policy and counters."""
    order = np.lexsort((st, ex))
    ex, st, ln = ex[order], st[order], ln[order]
    first = np.ones(ex.size, bool)
    first[1:] = ex[1:] != ex[:-1]
    gap = np.flatnonzero(first & (st != 0))
    contiguous = ~first
    contiguous[1:] &= st[1:] != st[:-1] + ln[:-1]
    gap = np.union1d(gap, np.flatnonzero(contiguous))
    for i in gap[:3]:
        out.add(f"example {ex[i]}: a piece starts at token {st[i]} where the pieces before it "
                "end elsewhere (tokens missing or duplicated)")
    covered = np.bincount(ex, weights=ln, minlength=lengths.size).astype(np.int64)
    npieces = np.bincount(ex, minlength=lengths.size)
    missing = lengths - covered
    L = config.seq_len
    policy = config.overflow.value if config.strategy.value != "concat_split" else "split"
    cut = np.flatnonzero(missing != 0)
    if policy == "truncate":
        allowed = (lengths > L) & (covered == L)
        want = {"truncated_examples": cut.size, "truncated_tokens": int(missing[cut].sum())}
    elif policy == "drop":
        allowed = (lengths > L) & (covered == 0)
        want = {"dropped_examples": cut.size, "dropped_tokens": int(missing[cut].sum())}
    else:
        allowed = np.zeros(lengths.size, bool)
        want = {}
    for i in cut[~allowed[cut]][:3]:
        out.add(f"example {i}: {missing[i]} of its {lengths[i]} tokens are not in any row, "
                f"which overflow={policy!r} does not allow")
    split = npieces > 1
    want.update(split_examples=int(split.sum()), split_pieces=int(npieces[split].sum()),
                num_examples=int(lengths.size), input_tokens=int(lengths.sum()),
                empty_examples=int((lengths == 0).sum()))
    have = counters.to_dict()
    for key, value in want.items():
        if have.get(key) != value:
            out.add(f"manifest counter {key}={have.get(key)} but the rows give {value}")


def verify(output_dir: str, inputs: Sequence[str] | None = None, *,
           max_violations: int = 20) -> VerifyReport:
    """Checks a packed directory against its inputs (default: the paths in the manifest)."""
    manifest = read_manifest(output_dir, check_shards=False)  # damaged shards are violations
    config = manifest.pack_config()
    out = _Collector(max_violations)
    damaged = set()
    location = OutputDir(output_dir)
    for name, size, sha in zip(manifest.shards, manifest.shard_bytes or [],
                               manifest.shard_sha256 or []):
        digest = location.digest(name)
        if digest is not None and digest != (size, sha):
            damaged.add(name)
            out.add(f"{name}: size or sha256 differs from the manifest's ({size} bytes, "
                    f"{sha[:12]}...): the shard was damaged or replaced after the run "
                    "(`seqpack pack ... --resume` rewrites it)")
    recorded = manifest.inputs["files"]
    paths = list(inputs) if inputs else [f["path"] for f in recorded]
    if len(paths) != len(recorded):
        raise InputError(f"{len(paths)} inputs given, the manifest lists {len(recorded)}: "
                         + ", ".join(f["path"] for f in recorded))
    for path in paths:
        if not storage.exists(path):
            raise InputError(f"{path}: no such {'object' if storage.is_url(path) else 'file'}")
    options = ReadOptions(**manifest.inputs["read_options"])
    tokenizer = manifest.inputs.get("tokenizer")
    if tokenizer and os.path.isfile(tokenizer["path"]):
        fp = fingerprint(tokenizer["path"])
        if fp["sha256"] != tokenizer.get("sha256"):
            out.add(f"tokenizer {tokenizer['path']} changed since the run that packed the rows")
    with tempfile.TemporaryDirectory(prefix="seqpack-verify-") as spill_dir:
        files, lengths, runs = _read_inputs(paths, options, spill_dir)
        for i, (path, info, rec) in enumerate(zip(paths, files, recorded)):
            for key in ("size", "sha256"):
                if info[key] != rec.get(key):
                    out.add(f"input {i} ({path}): {key} {info[key]} differs from the packed "
                            f"input's {rec[key]} ({rec['path']})")
        if combined_lengths_sha256(files) != manifest.inputs["lengths_sha256"]:
            out.add(f"the inputs' {lengths.size} example lengths differ from the packed inputs' "
                    f"{manifest.inputs['num_examples']}")
        offsets = np.zeros(lengths.size + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        spill = SpillReader(runs)
        shard_num_rows, recorded_stats = manifest.shard_num_rows or [], manifest.stats or {}
        pieces, checked = [], 0
        used_hist = np.zeros(config.seq_len + 1, np.int64)
        nseg_hist = np.zeros(config.max_segments + 1, np.int64)
        for name, num_rows in zip(manifest.shards, shard_num_rows, strict=True):
            try:
                batch = read_shard(output_dir, name, num_rows)
            except InputError as e:
                if name not in damaged:  # a shard the manifest vouches for must decode
                    raise
                out.add(f"{name}: cannot be decoded ({e})")
                continue
            if not batch:
                continue
            try:
                validate(batch, config)
            except ValueError as e:
                out.add(f"{name}: {e}")
            try:  # still compare tokens and count pieces where the segment metadata allows it
                ex, st, ln, n = _check_tokens(batch, config, spill, offsets, lengths, name, out)
            except (IndexError, KeyError, ValueError):
                continue
            hists = length_histograms(batch[config.keys().segment_lengths], config.seq_len)
            used_hist += hists[0]
            nseg_hist += hists[1]
            pieces.append((ex, st, ln))
            checked += n
    if pieces:
        ex, st, ln = (np.concatenate(x) for x in zip(*pieces))
        del pieces
        counters = Counters(**recorded_stats["counters"])
        _check_coverage(ex, st, ln, lengths, config, counters, out)
    got = stats_from_histograms(used_hist, nseg_hist, config.seq_len).to_dict()
    for key in ("num_rows", "num_segments", "real_tokens", "lower_bound_rows",
                "segments_per_row", "row_fill_histogram"):
        if got[key] != recorded_stats[key]:
            out.add(f"manifest stats {key}={recorded_stats[key]} but the rows give {got[key]}")
    return VerifyReport(ok=not out.items, violations=out.items,
                        num_rows=int(sum(shard_num_rows)),
                        num_examples=int(lengths.size), tokens_checked=checked)
