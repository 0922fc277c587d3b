"""Reads a packed directory back and proves it lossless against its inputs; reads single rows.

`verify(output_dir, inputs)` re-reads the inputs (as the manifest says they were read), checks:

    0. every shard's size and sha256 match the manifest (which matches its own digest);
    1. each input's fingerprint and the example lengths match the manifest;
    2. every shard decodes, holds the manifest's row count, and satisfies the row contract
       (`packer.validate`: shapes, dtypes, slot order, offsets, segment ids, positions, padding);
    3. every segment's tokens equal its source: example `segment_source_index`, from
       `segment_source_start`, in order;
    4. over all shards, each example's pieces tile [0, kept) exactly once, and what is not kept is
       what the overflow policy allows and the manifest's counters say (truncated / dropped /
       split examples and tokens); the manifest's stats match the rows.

A shard the manifest vouches for that cannot be decoded is bad input (`InputError`); all else is
a violation (a missing shard too), collected (first `max_violations`) in the returned report.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence

import numpy as np

from seqpack.packer import Counters, PackConfig, validate
from seqpack.packer.bounds import lower_bound
from seqpack.packer.contract import restore_derived
from seqpack.packer.stats import alignment_slack, length_histograms, stats_from_histograms
from seqpack.packer.validate import Coverage
from seqpack.pipelines import storage
from seqpack.pipelines.errors import InputError
from seqpack.pipelines.formats.encodings import of_manifest, with_segment_ids
from seqpack.pipelines.formats.inputs import ReadOptions, combined_lengths_sha256, fingerprint
from seqpack.pipelines.formats.manifest import Manifest, read_manifest
from seqpack.pipelines.offline.mixture import corpus_sources, example_times, loss_columns_of
from seqpack.pipelines.offline.outdir import OutputDir
from seqpack.pipelines.offline.runners import (
    Run,
    SpillReader,
    Workers,
    load_context,
    read_inputs,
    save_context,
)
from seqpack.pipelines.offline.shards import loss_tokens, read_shard


@dataclasses.dataclass
class VerifyReport:
    ok: bool
    violations: list[str]
    num_rows: int
    num_examples: int
    tokens_checked: int
    repeats: int = 0  # a mixture's: segments of an example it takes again (checked as such)
    # violations found, listed or not (a shard's check stops at the limit: there may be more)
    found: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def load_manifest(output_dir: str) -> tuple[Manifest, PackConfig]:
    """The manifest of a packed directory and its PackConfig; InputError if there is none."""
    manifest = read_manifest(output_dir)
    return manifest, manifest.pack_config()


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
    encoding, layout = of_manifest(manifest)
    with storage.local_copy(path) as local, storage.named(local, path):  # a URL: one shard
        reader = encoding.reader(local, layout)
        try:
            row = restore_derived(reader.row(j))
        finally:
            reader.close()
    return row, manifest, name, j


class _Collector:
    def __init__(self, limit: int):
        self.items: list[str] = []
        self.limit = limit

    found = 0  # every violation added, listed or not

    def add(self, msg: str) -> None:
        self.found += 1
        if len(self.items) < self.limit:
            self.items.append(msg)

    @property
    def full(self) -> bool:
        return len(self.items) >= self.limit


def _check_tokens(batch, config, spills: dict[str, tuple[SpillReader, int]], offsets, shard,
                  out: _Collector, wants: dict[str, np.ndarray] | None = None,
                  verbatim: Sequence[str] | None = None):
    """Every position of the rows, for the token feature and each extra column the shard
    holds as read (`verbatim`, default all): segment values == source values (read from the
    spill, `spills`: row key -> (reader, pad); `offsets`: i64[n + 1] of the examples), padding
    == the pad. The rows the writer should have written are rebuilt from the segment metadata
    and compared whole (and kept in `wants`, `[R, L]` each, every spilled key, when given).
    Returns (example, start, length) of the used slots and the tokens checked."""
    k = config.keys()
    seg_len = batch[k.segment_lengths].astype(np.int64)
    rows, slots = np.nonzero(seg_len > 0)
    ex = batch[k.source_index][rows, slots]
    st = batch[k.source_start][rows, slots]
    ln = seg_len[rows, slots]
    at = batch[k.segment_offsets][rows, slots].astype(np.int64)
    n = offsets.shape[0] - 1
    bad = (ex < 0) | (ex >= n)
    good = ~bad
    bad[good] |= st[good] + ln[good] > offsets[ex[good] + 1] - offsets[ex[good]]
    if bad.any():
        i = int(np.argmax(bad))
        out.add(f"{shard} row {rows[i]} slot {slots[i]}: source example {ex[i]} [{st[i]}, "
                f"{st[i] + ln[i]}) is not inside the {n} input examples")
        keep = ~bad
        rows, slots, ex, st, ln, at = (x[keep] for x in (rows, slots, ex, st, ln, at))
    L = config.seq_len
    for key, (reader, pad) in spills.items():
        # Compared in the rows' dtype when every spilled value fits it (no value can wrap into
        # it unseen), else widened; a column the encoding does not store as read is only
        # rebuilt (for `_check_derived`).
        stored = key == k.values or verbatim is None or key in verbatim
        got = batch[key].reshape(-1) if stored else np.zeros(0, np.int64)
        fits = all(np.can_cast(np.dtype(run.dtype), got.dtype) for run in reader.runs)
        wide = got.dtype if fits else np.uint64 if got.dtype == np.uint64 else np.int64
        want = np.full(batch[k.values].size, pad, wide)
        reader.read_into(want, rows * L + at, offsets[ex] + st, ln)
        if wants is not None:
            wants[key] = want.reshape(-1, L)
        if not stored:
            continue
        diff = np.flatnonzero(got.astype(wide, copy=False) != want)
        if not diff.size:
            continue
        r, pos = divmod(int(diff[0]), L)
        mine = np.flatnonzero((rows == r) & (at <= pos) & (pos < at + ln))
        what = f"{diff.size} positions of {key!r} differ in this shard"
        if mine.size:
            i = int(mine[0])
            out.add(f"{shard} row {r} slot {slots[i]} position {pos}: {key} {got[diff[0]]} != "
                    f"{want[diff[0]]}, value {st[i] + pos - at[i]} of example {ex[i]} ({what})")
        else:
            out.add(f"{shard} row {r} position {pos}: {key} padding holds {got[diff[0]]}, "
                    f"expected the pad {pad} ({what})")
    return ex, st, ln, int(ln.sum())


def _check_coverage(cover: Coverage, config, counters: Counters, out: _Collector) -> None:
    """Each example's pieces tile [0, kept) `times[e]` times (`packer.validate.Coverage`); the
    manifest's counters are the ones the pieces give."""
    problems, want = cover.check(config)
    for problem in problems:
        out.add(problem)
    have = counters.to_dict()
    for key, value in want.items():
        if have.get(key) != value:
            out.add(f"manifest counter {key}={have.get(key)} but the rows give {value}")


@dataclasses.dataclass(frozen=True)
class _VerifyContext:
    """What every worker checking a shard needs, written once to the temporary directory."""

    output_dir: str
    config: PackConfig
    runs: list[Run]  # the inputs' tokens, spilled by pass 1
    columns: list[tuple[str, int, list[Run]]]  # extra columns: name, pad, spill
    manifest: Manifest  # the run's (its encoding, the keys every row holds)
    offsets_path: str  # i64[n + 1] example offsets (np.save; memory-mapped by the workers)


@dataclasses.dataclass
class _ShardCheck:
    """What checking one shard found."""

    violations: list[str]
    pieces: tuple[np.ndarray, np.ndarray, np.ndarray] | None  # (example, start, length)
    used_hist: np.ndarray | None
    nseg_hist: np.ndarray | None
    tokens: int = 0
    loss_tokens: int = 0
    covered: bool = False  # its pieces went to the run's `Coverage`
    slack: int = 0  # tokens the segment alignment adds (`packer.stats.alignment_slack`)


def _check_derived(batch, wants: dict[str, np.ndarray], manifest: Manifest, shard: str,
                   out: _Collector) -> None:
    """The columns the encoding computes from the rows (TRL's labels and position ids,
    Megatron-Bridge's loss mask) against the same computed from the rows rebuilt from the
    inputs (`wants`) under the shard's own segment metadata."""
    encoding, layout = of_manifest(manifest)
    expected = with_segment_ids({k: v for k, v in batch.items() if k not in wants} | wants,
                                layout.config)
    for key, want in encoding.derived(expected, layout).items():
        diff = np.flatnonzero(np.asarray(batch[key]).reshape(-1) != want.reshape(-1))
        if diff.size:
            r, pos = divmod(int(diff[0]), layout.config.seq_len)
            out.add(f"{shard} row {r} position {pos}: {key} {batch[key][r, pos]} != "
                    f"{want[r, pos]}, what the inputs give ({diff.size} positions of {key!r} "
                    "differ in this shard)")


def _verify_context(path: str) -> tuple[_VerifyContext, dict[str, tuple[SpillReader, int]],
                                        np.ndarray]:
    context = load_context(path)
    spills = {context.config.keys().values: (SpillReader(context.runs), context.config.pad_id)}
    spills.update((name, (SpillReader(runs), pad)) for name, pad, runs in context.columns)
    return context, spills, np.load(context.offsets_path, mmap_mode="r")


def _check_shard(context_path: str, name: str, num_rows: int, digest: tuple[int, str],
                 limit: int) -> _ShardCheck:
    """One shard, in a worker: its digest, decoding, the row contract, tokens against the spill."""
    from concurrent.futures import ThreadPoolExecutor

    context, spills, offsets = _verify_context(context_path)
    config, out = context.config, _Collector(limit)
    with ThreadPoolExecutor(1) as hasher:  # sha256 (no GIL) while the shard is decoded
        found = hasher.submit(OutputDir(context.output_dir).digest, name)
        try:
            batch, error = read_shard(context.output_dir, name, num_rows, restore=False,
                                      manifest=context.manifest), None
        except InputError as e:
            batch, error = {}, e
        damaged = (held := found.result()) != tuple(digest)  # missing (None) too
    if damaged:
        out.add((f"{name}: missing ({num_rows} rows)" if held is None else
                 f"{name}: size or sha256 differs from the manifest's ({digest[0]} bytes, "
                 f"{digest[1][:12]}...): the shard was damaged or replaced after the run")
                + " (`seqpack pack ... --resume` rewrites it)")
    if error is not None:
        if not damaged:  # a shard the manifest vouches for must decode
            raise error
        if held is not None:
            out.add(f"{name}: cannot be decoded ({error})")
        return _ShardCheck(out.items, None, None, None)
    if not batch:
        return _ShardCheck(out.items, None, None, None)
    encoding, layout = of_manifest(context.manifest)
    missing = [key for key in encoding.decoded_keys(layout) if key not in batch]
    if missing:
        out.add(f"{name}: the rows lack {missing}, which the manifest says every row holds")
        return _ShardCheck(out.items, None, None, None)
    for problem in corpus_sources(batch, context.manifest.mixture, config.keys()):
        out.add(f"{name}: {problem}")  # a mixture's (dataset, index) as corpus examples
    # Segment ids / positions only where stored (else they are made from what is checked);
    # padding with the tokens, position by position (`_check_tokens`).
    try:
        validate(batch, config, derived=config.keys().segment_ids in batch, padding=False)
    except ValueError as e:
        out.add(f"{name}: {e}")
    wants: dict[str, np.ndarray] = {}
    try:  # still compare tokens and count pieces where the segment metadata allows it
        ex, st, ln, n = _check_tokens(batch, config, spills, offsets, name, out, wants,
                                      encoding.verbatim(layout))
        _check_derived(batch, wants, context.manifest, name, out)
        loss = loss_tokens(batch, context.manifest)
    except (IndexError, KeyError, ValueError):
        return _ShardCheck(out.items, None, None, None)
    seg = batch[config.keys().segment_lengths]
    used, nseg = length_histograms(seg, config.seq_len)
    return _ShardCheck(out.items, (_narrow(ex), _narrow(st), _narrow(ln)), used, nseg, n, loss,
                       slack=alignment_slack(seg, config.alignment))


def _narrow(x: np.ndarray) -> np.ndarray:
    """`x` as int32 where its values fit (the pieces a worker sends back: half the bytes)."""
    return x.astype(np.int32) if not x.size or (x.min() >= 0 and x.max() < 2**31) else x


def verify(output_dir: str, inputs: Sequence[str] | None = None, *, max_violations: int = 20,
           workers: int = 1) -> VerifyReport:
    """Checks a packed directory against its inputs (default: the paths in the manifest).

    `workers` processes read the inputs (pass 1 of `seqpack pack`, `runners.read_inputs`) and check
    the shards, one at a time each; the report does not depend on it."""
    manifest = read_manifest(output_dir, check_shards=False)  # damaged shards are violations
    config = manifest.pack_config()
    out = _Collector(max_violations)
    paths = _input_paths(manifest, inputs)
    options = ReadOptions(**manifest.inputs["read_options"])
    _check_tokenizer(manifest, options, out)
    pool = Workers(workers)
    try:
        with storage.scratch("verify") as spill_dir:
            read = read_inputs(paths, options, spill_dir, pool, loss_columns=loss_columns_of(
                manifest.mixture, manifest.columns))
            scans, columns = read.scans, manifest.columns or []
            lengths = np.concatenate([s.lengths for s in scans])
            _check_inputs(paths, [s.info for s in scans], lengths, manifest, out)
            times, problems = example_times(manifest.mixture, [s.lengths for s in scans],
                                            [s.loss_counts for s in scans])
            for problem in problems:
                out.add(problem)
            offsets = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
            np.save(os.path.join(spill_dir, "offsets.npy"), offsets)
            del offsets, scans
            context = save_context(spill_dir, _VerifyContext(
                output_dir, config, read.runs,
                [(c["name"], c["pad"], read.column_runs[c["source"]]) for c in columns],
                manifest, os.path.join(spill_dir, "offsets.npy")))
            cover = Coverage(lengths, times)
            checks = _check_shards(manifest, context, pool, out, cover)
    except BaseException:
        pool.close(kill=True)
        raise
    pool.close()
    _check_results(checks, cover, manifest, out, output_dir)
    return VerifyReport(not out.items, out.items, int(sum(manifest.shard_num_rows or [])),
                        int(lengths.size), sum(c.tokens for c in checks),
                        int(times.sum()) - int(np.count_nonzero(times)), out.found)


def _input_paths(manifest: Manifest, inputs: Sequence[str] | None) -> list[str]:
    recorded = manifest.inputs["files"]
    paths = list(inputs) if inputs else [f["path"] for f in recorded]
    if len(paths) != len(recorded):
        raise InputError(f"{len(paths)} inputs given, the manifest lists {len(recorded)}: "
                         + ", ".join(f["path"] for f in recorded))
    for path in paths:
        if not storage.exists(path):
            raise InputError(f"{path}: no such {'object' if storage.is_url(path) else 'file'}")
    return paths


def _check_tokenizer(manifest: Manifest, options: ReadOptions, out: _Collector) -> None:
    """The tokenizer verify reads with (the manifest's read options) against the fingerprint
    the run recorded."""
    tokenizer = manifest.inputs.get("tokenizer")
    if tokenizer and options.tokenizer and os.path.isfile(options.tokenizer):
        if fingerprint(options.tokenizer)["sha256"] != tokenizer.get("sha256"):
            out.add(f"tokenizer {options.tokenizer} is not the one that packed the rows (its "
                    f"sha256 differs from that of {tokenizer['path']} when they were packed)")


def _check_inputs(paths: Sequence[str], files: list[dict], lengths: np.ndarray,
                  manifest: Manifest, out: _Collector) -> None:
    """Each input's fingerprint (a Megatron .bin's .idx too) and lengths against the manifest."""
    for i, (path, info, rec) in enumerate(zip(paths, files, manifest.inputs["files"])):
        pair: dict = info.get("companion") or {}
        for got, was in ((info, rec), (pair, rec.get("companion") or {})):
            for key in ("size", "sha256") if got else ():
                if got[key] != was.get(key):
                    out.add(f"input {i} ({path}): {key} {got[key]} of {got['path']} differs "
                            f"from the packed input's {was.get(key)} ({was.get('path')})")
    if combined_lengths_sha256(files) != manifest.inputs["lengths_sha256"]:
        out.add(f"the inputs' {lengths.size} example lengths differ from the packed inputs' "
                f"{manifest.inputs['num_examples']}")


def _check_shards(manifest: Manifest, context_path: str, pool: Workers, out: _Collector,
                  cover: Coverage) -> list[_ShardCheck]:
    """Every shard checked by a worker; their violations collected in shard order, their
    pieces added to `cover` as they come (and dropped)."""
    digests = list(zip(manifest.shard_bytes or [], manifest.shard_sha256 or []))
    calls = [(context_path, name, rows, digest, out.limit) for name, rows, digest in
             zip(manifest.shards, manifest.shard_num_rows or [], digests, strict=True)]
    checks = []
    for check in pool.map(_check_shard, calls, len(calls), what="checking shards"):
        if check.pieces is not None:
            cover.add(*check.pieces)
            check.pieces, check.covered = None, True
        checks.append(check)
    for v in (v for check in checks for v in check.violations):
        out.add(v)
    return checks


def _check_results(checks: list[_ShardCheck], cover: Coverage, manifest: Manifest,
                   out: _Collector, output_dir: str) -> None:
    """Coverage of every example over all shards, and the manifest's stats against the rows."""
    config = manifest.pack_config()
    recorded = manifest.stats or {}
    pieces = any(c.covered for c in checks)
    if pieces:
        _check_coverage(cover, config, Counters(**recorded["counters"]), out)
    used = sum((c.used_hist for c in checks if c.used_hist is not None),
               np.zeros(config.seq_len + 1, np.int64))
    nseg = sum((c.nseg_hist for c in checks if c.nseg_hist is not None),
               np.zeros(config.max_segments + 1, np.int64))
    got = stats_from_histograms(used, nseg, config.seq_len,
                                slack=sum(c.slack for c in checks)).to_dict()
    # a manifest written before the bound counted the alignment holds the tokens' bound
    plain = lower_bound(got["real_tokens"], got["num_segments"], config.seq_len,
                        config.max_segments)
    for key in ("num_rows", "num_segments", "real_tokens", "lower_bound_rows",
                "segments_per_row", "row_fill_histogram"):
        if key == "lower_bound_rows" and recorded[key] == plain:
            continue
        if got[key] != recorded[key]:
            out.add(f"manifest stats {key}={recorded[key]} but the rows give {got[key]}")
    if manifest.shapes is not None and pieces:
        _check_shapes(manifest, used, nseg, cover.longest,
                      sum(c.loss_tokens for c in checks), out, OutputDir(output_dir))


def _check_shapes(manifest: Manifest, used: np.ndarray, nseg: np.ndarray, longest: int,
                  loss: int, out: _Collector, where: OutputDir) -> None:
    """The manifest's `shapes` against the rows, then the encoding's side files (Megatron-
    Bridge's metadata) against the manifest."""
    shapes = manifest.shapes or {}
    filled, segs = np.flatnonzero(used), np.flatnonzero(nseg)
    got = {"max_row_segments": int(segs[-1]) if segs.size else 0, "longest_segment": longest,
           "shortest_row": int(filled[0]) if filled.size else 0, "loss_tokens": loss}
    for key, value in got.items():
        if shapes.get(key) != value:
            out.add(f"manifest shapes {key}={shapes.get(key)} but the rows give {value}")
    encoding, layout = of_manifest(manifest)
    for name, want in encoding.side_files({"shapes": shapes, "stats": manifest.stats},
                                          layout).items():
        try:
            have = where.read_json(name)
        except (OSError, ValueError):
            have = None
        if have != json.loads(json.dumps(want)):
            out.add(f"{where.path(name)}: {'differs from' if have else 'missing, not'} what "
                    "the manifest gives (repack with `seqpack pack ... --overwrite`)")
