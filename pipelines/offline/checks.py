"""The checks `verify` makes, whatever runs them: a shard's rows against their sources, and the
totals over every shard against the manifest.

A shard's check (`check_shard`) reads its sources through a `Source`: the local verify's spill
of every input, or the pieces an input's worker sent it (`verify.RoutedSource`, the Beam and
Spark jobs). Each example's coverage is `packer.validate.Coverage`'s, over the pieces the
shards hold.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np

from seqpack.packer import Counters, PackConfig, validate
from seqpack.packer.bounds import lower_bound
from seqpack.packer.contract import ragged_arange
from seqpack.packer.stats import alignment_slack, length_histograms, stats_from_histograms
from seqpack.packer.validate import Coverage, coverage_problems
from seqpack.pipelines.errors import InputError
from seqpack.pipelines.formats.encodings import of_manifest, with_segment_ids
from seqpack.pipelines.formats.manifest import Manifest
from seqpack.pipelines.offline.mixture import corpus_sources
from seqpack.pipelines.offline.outdir import OutputDir
from seqpack.pipelines.offline.shards import loss_tokens, read_shard


class Collector:
    """Violations: every one counted (`found`), the first `limit` kept."""

    def __init__(self, limit: int):
        self.items: list[str] = []
        self.limit = limit
        self.found = 0

    def add(self, msg: str) -> None:
        self.found += 1
        if len(self.items) < self.limit:
            self.items.append(msg)

    def merge(self, items: Sequence[str], found: int) -> None:
        """Another collector's violations (`found` of them, `items` listed)."""
        for msg in items:
            self.add(msg)
        self.found += found - len(items)

    @property
    def full(self) -> bool:
        return len(self.items) >= self.limit


class Source(Protocol):
    """Where a shard's check reads what its segments should hold."""

    num_examples: int  # the examples the run packed (its numbering: the manifest's)

    def pads(self) -> dict[str, int]:
        """Each key the rows take from the inputs (the tokens, extra columns) -> its pad."""

    def dtypes(self, key: str) -> list[np.dtype]:
        """The dtypes `key`'s source values come in."""

    def outside(self, ex: np.ndarray, st: np.ndarray, ln: np.ndarray) -> np.ndarray:
        """bool per piece (example, start, length): not inside the inputs' examples."""

    def read_into(self, key: str, want: np.ndarray, dst: np.ndarray, ex: np.ndarray,
                  st: np.ndarray, ln: np.ndarray, which: np.ndarray) -> None:
        """want[dst[i] : dst[i] + ln[i]] = piece i's source values of `key` (`which`: the
        pieces' places among the shard's used slots, in row-major order)."""


@dataclasses.dataclass
class InputCheck:
    """What checking one input (the distributed verify's `input_records`) found."""

    index: int
    violations: list[str]
    found: int = 0
    info: dict | None = None  # its fingerprint, lengths digest and counts
    coverage: tuple[dict, dict, dict] | None = None  # `Coverage.findings` of its examples
    longest: int = 0
    error: str | None = None  # the input cannot be read (the run fails with it)
    routed: int = 0  # pieces it sent to their shards
    repeats: int = 0  # takes of its examples past their first (a mixture's)


@dataclasses.dataclass
class RoutedPart:
    """Some pieces of a shard (their places among its used slots) with their source values."""

    slots: np.ndarray
    lengths: np.ndarray
    values: dict[str, np.ndarray]


class RoutedSource:
    """The distributed verify's `Source`: the values inputs routed to one shard."""

    def __init__(self, parts: list[RoutedPart], pads: dict[str, int], num_examples: int):
        self._pads, self.num_examples, self.parts = pads, num_examples, parts
        slots = np.concatenate([p.slots for p in parts] + [np.zeros(0, np.int64)])
        lengths = np.concatenate([p.lengths for p in parts] + [np.zeros(0, np.int64)])
        self.slots = slots.astype(np.int64)
        self.start = np.zeros(int(self.slots.max()) + 1 if slots.size else 0, np.int64)
        self.start[self.slots] = np.cumsum(lengths) - lengths

    def pads(self) -> dict[str, int]:
        return self._pads

    def dtypes(self, key: str) -> list[np.dtype]:
        return [p.values[key].dtype for p in self.parts]

    def outside(self, ex: np.ndarray, st: np.ndarray, ln: np.ndarray) -> np.ndarray:
        bad = np.ones(ex.size, bool)  # an input routes a piece only if its example holds it
        bad[self.slots[self.slots < ex.size]] = False
        return bad

    def read_into(self, key: str, want: np.ndarray, dst: np.ndarray, ex: np.ndarray,
                  st: np.ndarray, ln: np.ndarray, which: np.ndarray) -> None:
        values = [p.values[key] for p in self.parts]
        kind = np.result_type(*values) if values else want.dtype
        joined = np.concatenate([v.astype(np.int64 if kind.kind == "f" else kind, copy=False)
                                 for v in values] + [np.zeros(0, want.dtype)])
        want[ragged_arange(dst, ln)] = joined[ragged_arange(self.start[which], ln)]


@dataclasses.dataclass
class ShardCheck:
    """What checking one shard found."""

    violations: list[str]
    pieces: tuple[np.ndarray, np.ndarray, np.ndarray] | None  # (example, start, length)
    used_hist: np.ndarray | None
    nseg_hist: np.ndarray | None
    tokens: int = 0
    loss_tokens: int = 0
    covered: bool = False  # its pieces went to the run's `Coverage`
    slack: int = 0  # tokens the segment alignment adds (`packer.stats.alignment_slack`)
    found: int = 0  # violations, listed or not
    received: int = 0  # pieces the inputs sent it (the distributed verify)


def used_slots(batch: dict[str, np.ndarray], config: PackConfig
               ) -> tuple[np.ndarray, ...]:
    """(row, slot, example, start, length, offset) of a batch's used slots, row-major."""
    k = config.keys()
    seg_len = batch[k.segment_lengths].astype(np.int64)
    rows, slots = np.nonzero(seg_len > 0)
    return (rows, slots, batch[k.source_index][rows, slots].astype(np.int64),
            batch[k.source_start][rows, slots].astype(np.int64), seg_len[rows, slots],
            batch[k.segment_offsets][rows, slots].astype(np.int64))


def check_tokens(batch, config, source: Source, shard, out: Collector,
                 wants: dict[str, np.ndarray] | None = None,
                 verbatim: Sequence[str] | None = None):
    """Every position of the rows, for the token feature and each extra column the shard
    holds as read (`verbatim`, default all): segment values == source values, padding == the
    pad. The rows the writer should have written are rebuilt from the segment metadata and
    compared whole (and kept in `wants`, `[R, L]` each, every source key, when given).
    Returns (example, start, length) of the used slots and the tokens checked."""
    k = config.keys()
    rows, slots, ex, st, ln, at = used_slots(batch, config)
    which = np.arange(rows.size)
    bad = source.outside(ex, st, ln)
    if bad.any():
        i = int(np.argmax(bad))
        out.add(f"{shard} row {rows[i]} slot {slots[i]}: source example {ex[i]} [{st[i]}, "
                f"{st[i] + ln[i]}) is not among the inputs' examples as they read now (the "
                f"run packed {source.num_examples})")
        keep = ~bad
        rows, slots, ex, st, ln, at, which = (x[keep] for x in
                                              (rows, slots, ex, st, ln, at, which))
    L = config.seq_len
    for key, pad in source.pads().items():
        # Compared in the rows' dtype when every source value fits it (no value can wrap into
        # it unseen), else widened; a column the encoding does not store as read is only
        # rebuilt (for `check_derived`).
        stored = key == k.values or verbatim is None or key in verbatim
        got = batch[key].reshape(-1) if stored else np.zeros(0, np.int64)
        fits = all(np.can_cast(dtype, got.dtype) for dtype in source.dtypes(key))
        wide = got.dtype if fits else np.uint64 if got.dtype == np.uint64 else np.int64
        want = np.full(batch[k.values].size, pad, wide)
        source.read_into(key, want, rows * L + at, ex, st, ln, which)
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


def check_derived(batch, wants: dict[str, np.ndarray], manifest: Manifest, shard: str,
                  out: Collector) -> None:
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


def decode_shard(output_dir: str, name: str, num_rows: int, manifest: Manifest
                 ) -> dict[str, np.ndarray]:
    """A shard's rows with a mixture's sources made corpus examples; {} if it cannot be read
    (its check says why)."""
    try:
        batch = read_shard(output_dir, name, num_rows, restore=False, manifest=manifest)
    except (InputError, OSError):
        return {}
    if batch and manifest.mixture:
        try:
            corpus_sources(batch, manifest.mixture, manifest.pack_config().keys())
        except (IndexError, KeyError, ValueError):
            return {}
    return batch


def check_shard(output_dir: str, name: str, num_rows: int, digest: tuple[int, str],
                manifest: Manifest, source: Source, limit: int) -> ShardCheck:
    """One shard: its digest, decoding, the row contract, every value against `source`."""
    config, out = manifest.pack_config(), Collector(limit)
    with ThreadPoolExecutor(1) as hasher:  # sha256 (no GIL) while the shard is decoded
        found = hasher.submit(OutputDir(output_dir).digest, name)
        try:
            batch, error = read_shard(output_dir, name, num_rows, restore=False,
                                      manifest=manifest), None
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
    if error is not None or not batch:
        return _unchecked(out)
    encoding, layout = of_manifest(manifest)
    missing = [key for key in encoding.decoded_keys(layout) if key not in batch]
    if missing:
        out.add(f"{name}: the rows lack {missing}, which the manifest says every row holds")
        return _unchecked(out)
    for problem in corpus_sources(batch, manifest.mixture, config.keys()):
        out.add(f"{name}: {problem}")  # a mixture's (dataset, index) as corpus examples
    # Segment ids / positions only where stored (else they are made from what is checked);
    # padding with the tokens, position by position (`check_tokens`).
    try:
        validate(batch, config, derived=config.keys().segment_ids in batch, padding=False)
    except ValueError as e:
        out.add(f"{name}: {e}")
    wants: dict[str, np.ndarray] = {}
    try:  # still compare tokens and count pieces where the segment metadata allows it
        ex, st, ln, n = check_tokens(batch, config, source, name, out, wants,
                                     encoding.verbatim(layout))
        check_derived(batch, wants, manifest, name, out)
        loss = loss_tokens(batch, manifest)
    except (IndexError, KeyError, ValueError):
        return _unchecked(out)
    seg = _counted(batch[config.keys().segment_lengths], config.seq_len)
    used, nseg = length_histograms(seg, config.seq_len)
    return ShardCheck(out.items, (narrow(ex), narrow(st), narrow(ln)), used, nseg, n, loss,
                      slack=alignment_slack(seg, config.alignment), found=out.found)


def _counted(seg: np.ndarray, seq_len: int) -> np.ndarray:
    """Segment lengths as the stats count them: a row that breaks the contract (a length
    below 0, or past the row: a violation already) cut to [0, seq_len] tokens."""
    seg = np.asarray(seg, np.int64)
    if seg.size and (seg.min() < 0 or seg.sum(axis=-1).max() > seq_len):
        ends = np.minimum(np.cumsum(np.maximum(seg, 0), axis=-1), seq_len)
        seg = np.diff(ends, axis=-1, prepend=0)
    return seg


def _unchecked(out: Collector) -> ShardCheck:
    return ShardCheck(out.items, None, None, None, found=out.found)


def narrow(x: np.ndarray) -> np.ndarray:
    """`x` as int32 where its values fit (pieces sent between processes: half the bytes)."""
    return x.astype(np.int32) if not x.size or (x.min() >= 0 and x.max() < 2**31) else x


@dataclasses.dataclass
class Totals:
    """The sums over every shard's check that the manifest's stats and shapes are held to."""

    used: np.ndarray  # rows by used slots (i64[L + 1])
    nseg: np.ndarray  # rows by segments (i64[S + 1])
    slack: int = 0
    tokens: int = 0
    loss: int = 0
    covered: bool = False  # some shard gave its pieces (else coverage was not checked)
    received: int = 0  # pieces the shards got from the inputs (the distributed verify)

    @classmethod
    def zeros(cls, config: PackConfig) -> Totals:
        return cls(np.zeros(config.seq_len + 1, np.int64),
                   np.zeros(config.max_segments + 1, np.int64))

    def add(self, check: ShardCheck) -> None:
        if check.used_hist is not None and check.nseg_hist is not None:
            self.used = self.used + check.used_hist
            self.nseg = self.nseg + check.nseg_hist
        self.slack += check.slack
        self.tokens += check.tokens
        self.loss += check.loss_tokens
        self.covered |= check.pieces is not None or check.covered
        self.received += check.received

    def merge(self, other: Totals) -> Totals:
        return Totals(self.used + other.used, self.nseg + other.nseg, self.slack + other.slack,
                      self.tokens + other.tokens, self.loss + other.loss,
                      self.covered or other.covered, self.received + other.received)


def packed_firsts(manifest: Manifest) -> np.ndarray:
    """i64[n + 1]: each input's first example as the run numbered them, then their number."""
    counts = [f["num_examples"] for f in manifest.inputs["files"]]
    return np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))


class Coverages:
    """`packer.validate.Coverage` per input, examples numbered as the run packed them (`firsts`,
    `packed_firsts`) over the lengths (and takes) each input gives now: whatever an input
    became, the others' examples keep their numbers."""

    def __init__(self, lengths: list[np.ndarray], times: list[np.ndarray],
                 firsts: np.ndarray):
        self.firsts = firsts
        self.parts = [Coverage(x, t, int(f)) for x, t, f in zip(lengths, times, firsts)]

    def add(self, ex: np.ndarray, st: np.ndarray, ln: np.ndarray) -> None:
        """Pieces whose example each input holds now (`Source.outside` said so)."""
        owner = np.searchsorted(self.firsts, ex, side="right") - 1
        for i in np.unique(owner).tolist():
            mine = owner == i
            self.parts[i].add(ex[mine], st[mine], ln[mine])

    @property
    def longest(self) -> int:
        return max((c.longest for c in self.parts), default=0)

    def check(self, config: PackConfig) -> tuple[list[str], dict[str, int]]:
        """`Coverage.check` over every input, in input order."""
        return merge_findings([c.findings(config) for c in self.parts])


def merge_findings(parts: Sequence[tuple[dict, dict, dict]]) -> tuple[list[str], dict[str, int]]:
    """`Coverage.findings` of consecutive parts of a corpus (in order) as one corpus's
    `Coverage.check`: its problems (the first 3 of each kind) and counters."""
    found: dict[str, list[str]] = {"tiling": [], "kept": []}
    counts: dict[str, int] = {"tiling": 0, "kept": 0}
    want: dict[str, int] = {}
    for part_found, part_counts, part_want in parts:
        for kind in found:
            found[kind] += part_found[kind][: 3 - len(found[kind])]
            counts[kind] += part_counts[kind]
        for key, value in part_want.items():
            want[key] = want.get(key, 0) + value
    return coverage_problems(found, counts), want


def check_counters(problems: list[str], want: dict[str, int], counters: Counters,
                   out: Collector) -> None:
    """Coverage's problems (`packer.validate.Coverage`), then the manifest's counters against
    the ones the pieces give (`want`)."""
    for problem in problems:
        out.add(problem)
    have = counters.to_dict()
    for key, value in want.items():
        if have.get(key) != value:
            out.add(f"manifest counter {key}={have.get(key)} but the rows give {value}")


def check_totals(totals: Totals, longest: int, manifest: Manifest, out: Collector,
                 output_dir: str) -> None:
    """The manifest's stats (and shapes, where the pieces were counted) against the rows."""
    config = manifest.pack_config()
    recorded = manifest.stats or {}
    got = stats_from_histograms(totals.used, totals.nseg, config.seq_len,
                                slack=totals.slack).to_dict()
    # a manifest written before the bound counted the alignment holds the tokens' bound
    plain = lower_bound(got["real_tokens"], got["num_segments"], config.seq_len,
                        config.max_segments)
    for key in ("num_rows", "num_segments", "real_tokens", "lower_bound_rows",
                "segments_per_row", "row_fill_histogram"):
        if key == "lower_bound_rows" and recorded[key] == plain:
            continue
        if got[key] != recorded[key]:
            out.add(f"manifest stats {key}={recorded[key]} but the rows give {got[key]}")
    if manifest.shapes is not None and totals.covered:
        _check_shapes(manifest, totals, longest, out, OutputDir(output_dir))


def _check_shapes(manifest: Manifest, totals: Totals, longest: int, out: Collector,
                  where: OutputDir) -> None:
    """The manifest's `shapes` against the rows, then the encoding's side files (Megatron-
    Bridge's metadata) against the manifest."""
    shapes = manifest.shapes or {}
    filled, segs = np.flatnonzero(totals.used), np.flatnonzero(totals.nseg)
    got = {"max_row_segments": int(segs[-1]) if segs.size else 0, "longest_segment": longest,
           "shortest_row": int(filled[0]) if filled.size else 0, "loss_tokens": totals.loss}
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
