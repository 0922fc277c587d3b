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
The checks are `offline.checks`'; `verify` runs them on one machine over a spill of the inputs,
the distributed steps below (`runners.verify_beam`, `runners.verify_spark`) with each input
read by one worker and its values routed to the shards that hold them: the same report.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from seqpack.packer import Counters, PackConfig
from seqpack.packer.contract import ragged_arange, restore_derived
from seqpack.packer.validate import Coverage
from seqpack.pipelines import storage
from seqpack.pipelines.errors import InputError, RunFailed, one_line
from seqpack.pipelines.formats.encodings import of_manifest
from seqpack.pipelines.formats.inputs import (
    ReadOptions,
    combined_lengths_sha256,
    fingerprint,
    read_corpus,
)
from seqpack.pipelines.formats.manifest import Manifest, read_manifest
from seqpack.pipelines.offline.checks import (
    Collector,
    Coverages,
    InputCheck,
    RoutedPart,
    RoutedSource,
    ShardCheck,
    Totals,
    check_counters,
    check_shard,
    check_totals,
    decode_shard,
    merge_findings,
    packed_firsts,
    used_slots,
)
from seqpack.pipelines.offline.core import FileScan
from seqpack.pipelines.offline.mixture import example_times, loss_columns_of, takes
from seqpack.pipelines.offline.runners import (
    Run,
    SpillReader,
    Workers,
    load_context,
    read_inputs,
    save_context,
)


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


class SpillSource:
    """The local verify's `checks.Source`: every input's values, spilled by pass 1 (`offsets`:
    i64[n + 1] of the examples as read now, `firsts` each input's first of them; `packed`:
    `checks.packed_firsts`, the numbering the rows use)."""

    def __init__(self, spills: dict[str, tuple[SpillReader, int]], offsets: np.ndarray,
                 firsts: np.ndarray, packed: np.ndarray):
        self.spills, self.offsets, self.firsts, self.packed = spills, offsets, firsts, packed
        self.num_examples = int(packed[-1])

    def _read_now(self, ex: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(each packed example's number as read now, whether its input still holds it)."""
        owner = np.searchsorted(self.packed, ex, side="right") - 1
        local = ex - self.packed[owner]
        return self.firsts[owner] + local, local < self.firsts[owner + 1] - self.firsts[owner]

    def pads(self) -> dict[str, int]:
        return {key: pad for key, (_, pad) in self.spills.items()}

    def dtypes(self, key: str) -> list[np.dtype]:
        return [np.dtype(run.dtype) for run in self.spills[key][0].runs]

    def outside(self, ex: np.ndarray, st: np.ndarray, ln: np.ndarray) -> np.ndarray:
        bad = (ex < 0) | (ex >= self.num_examples)
        good = np.flatnonzero(~bad)
        now, held = self._read_now(ex[good])
        bad[good[~held]] = True
        good, now = good[held], now[held]
        bad[good] |= st[good] + ln[good] > self.offsets[now + 1] - self.offsets[now]
        return bad

    def read_into(self, key: str, want: np.ndarray, dst: np.ndarray, ex: np.ndarray,
                  st: np.ndarray, ln: np.ndarray, which: np.ndarray) -> None:
        now, _ = self._read_now(ex)
        self.spills[key][0].read_into(want, dst, self.offsets[now] + st, ln)


@dataclasses.dataclass(frozen=True)
class _VerifyContext:
    """What every worker checking a shard needs, written once to the temporary directory."""

    output_dir: str
    config: PackConfig
    runs: list[Run]  # the inputs' tokens, spilled by pass 1
    columns: list[tuple[str, int, list[Run]]]  # extra columns: name, pad, spill
    manifest: Manifest  # the run's (its encoding, the keys every row holds)
    offsets_path: str  # i64[n + 1] example offsets (np.save; memory-mapped by the workers)
    firsts: np.ndarray  # i64[inputs + 1]: each input's first example as read now
    packed: np.ndarray  # the same as the run numbered them (`checks.packed_firsts`)


def _check_shard(context_path: str, name: str, num_rows: int, digest: tuple[int, str],
                 limit: int) -> ShardCheck:
    """One shard, in a worker (`checks.check_shard`, its values read from the spill)."""
    context = load_context(context_path)
    spills = {context.config.keys().values: (SpillReader(context.runs), context.config.pad_id)}
    spills.update((name, (SpillReader(runs), pad)) for name, pad, runs in context.columns)
    source = SpillSource(spills, np.load(context.offsets_path, mmap_mode="r"), context.firsts,
                         context.packed)
    return check_shard(context.output_dir, name, num_rows, digest, context.manifest, source,
                       limit)


def verify(output_dir: str, inputs: Sequence[str] | None = None, *, max_violations: int = 20,
           workers: int = 1) -> VerifyReport:
    """Checks a packed directory against its inputs (default: the paths in the manifest).

    `workers` processes read the inputs (pass 1 of `seqpack pack`, `runners.read_inputs`) and check
    the shards, one at a time each; the report does not depend on it."""
    manifest = read_manifest(output_dir, check_shards=False)  # damaged shards are violations
    config = manifest.pack_config()
    out = Collector(max_violations)
    paths = input_paths(manifest, inputs)
    options = ReadOptions(**manifest.inputs["read_options"])
    check_tokenizer(manifest, options, out)
    pool = Workers(workers)
    try:
        with storage.scratch("verify") as spill_dir:
            read = read_inputs(paths, options, spill_dir, pool, loss_columns=loss_columns_of(
                manifest.mixture, manifest.columns))
            scans, columns = read.scans, manifest.columns or []
            lengths = np.concatenate([s.lengths for s in scans])
            for i, (path, scan) in enumerate(zip(paths, scans)):
                check_input(i, path, scan.info, manifest, out)
            check_lengths([s.info for s in scans], manifest, out)
            times, problems = example_times(manifest.mixture, [s.lengths for s in scans],
                                            [s.loss_counts for s in scans],
                                            np.diff(packed_firsts(manifest)).tolist())
            for problem in problems:
                out.add(problem)
            offsets = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
            np.save(os.path.join(spill_dir, "offsets.npy"), offsets)
            firsts = np.cumsum([0, *(s.lengths.size for s in scans)], dtype=np.int64)
            cover = Coverages([s.lengths for s in scans], np.split(times, firsts[1:-1]),
                              packed_firsts(manifest))
            del offsets, scans
            context = save_context(spill_dir, _VerifyContext(
                output_dir, config, read.runs,
                [(c["name"], c["pad"], read.column_runs[c["source"]]) for c in columns],
                manifest, os.path.join(spill_dir, "offsets.npy"), firsts, cover.firsts))
            totals = _check_shards(manifest, context, pool, out, cover)
    except BaseException:
        pool.close(kill=True)
        raise
    pool.close()
    if totals.covered:
        check_counters(*cover.check(config), Counters(**(manifest.stats or {})["counters"]), out)
    check_totals(totals, cover.longest, manifest, out, output_dir)
    return VerifyReport(not out.items, out.items, int(sum(manifest.shard_num_rows or [])),
                        int(lengths.size), totals.tokens,
                        int(times.sum()) - int(np.count_nonzero(times)), out.found)


def input_paths(manifest: Manifest, inputs: Sequence[str] | None) -> list[str]:
    """The inputs to verify against: `inputs`, or the manifest's paths; each must exist."""
    recorded = manifest.inputs["files"]
    paths = list(inputs) if inputs else [f["path"] for f in recorded]
    if len(paths) != len(recorded):
        raise InputError(f"{len(paths)} inputs given, the manifest lists {len(recorded)}: "
                         + ", ".join(f["path"] for f in recorded))
    for path in paths:
        if not storage.exists(path):
            raise InputError(f"{path}: no such {'object' if storage.is_url(path) else 'file'}")
    return paths


def check_tokenizer(manifest: Manifest, options: ReadOptions, out: Collector) -> None:
    """The tokenizer verify reads with (the manifest's read options) against the fingerprint
    the run recorded."""
    tokenizer = manifest.inputs.get("tokenizer")
    if tokenizer and options.tokenizer and os.path.isfile(options.tokenizer):
        if fingerprint(options.tokenizer)["sha256"] != tokenizer.get("sha256"):
            out.add(f"tokenizer {options.tokenizer} is not the one that packed the rows (its "
                    f"sha256 differs from that of {tokenizer['path']} when they were packed)")


def check_input(i: int, path: str, info: dict, manifest: Manifest, out: Collector) -> None:
    """Input `i`'s fingerprint (a Megatron .bin's .idx too) against the manifest's."""
    rec = manifest.inputs["files"][i]
    pair: dict = info.get("companion") or {}
    for got, was in ((info, rec), (pair, rec.get("companion") or {})):
        for key in ("size", "sha256") if got else ():
            if got[key] != was.get(key):
                out.add(f"input {i} ({path}): {key} {got[key]} of {got['path']} differs "
                        f"from the packed input's {was.get(key)} ({was.get('path')})")


def check_lengths(files: list[dict], manifest: Manifest, out: Collector) -> None:
    """Every input's example lengths (the digest of each, in input order) against the
    manifest's."""
    if combined_lengths_sha256(files) != manifest.inputs["lengths_sha256"]:
        out.add(f"the inputs' {sum(f['num_examples'] for f in files)} example lengths differ "
                f"from the packed inputs' {manifest.inputs['num_examples']}")


def _check_shards(manifest: Manifest, context_path: str, pool: Workers, out: Collector,
                  cover: Coverages) -> Totals:
    """Every shard checked by a worker; their violations collected in shard order, their
    pieces added to `cover` as they come (and dropped)."""
    digests = list(zip(manifest.shard_bytes or [], manifest.shard_sha256 or []))
    calls = [(context_path, name, rows, digest, out.limit) for name, rows, digest in
             zip(manifest.shards, manifest.shard_num_rows or [], digests, strict=True)]
    totals, violations = Totals.zeros(manifest.pack_config()), []
    for check in pool.map(_check_shard, calls, len(calls), what="checking shards"):
        totals.add(check)
        if check.pieces is not None:
            cover.add(*check.pieces)
        violations.append((check.violations, check.found))  # its pieces and histograms dropped
    for items, found in violations:
        out.merge(items, found)
    return totals


# -- the distributed verify: the steps the Beam and Spark runners map -------------------------
#
#   per shard   shard_pieces   its used slots, as (shard, slot number, example, start, length)
#                              grouped by the input that holds the example
#   per input   input_records  reads the input once: its fingerprint, each example's coverage
#                              by the pieces, and the pieces' values, grouped by shard
#   per shard   check_routed   `checks.check_shard` over the values routed to it
#   once        finish_verify  the violations in the local verify's order, the totals
#
# Nothing per example meets in one place (but a legacy mixture's takes, from every input's
# lengths); an input's worker holds that input, a shard's its rows and their values.


@dataclasses.dataclass(frozen=True)
class VerifyJob:
    """What every step of a distributed verify reads."""

    output_dir: str
    paths: list[str]
    manifest: Manifest
    limit: int  # violations listed, per step and in all

    @property
    def firsts(self) -> np.ndarray:
        """i64[n + 1]: each input's first example as the run numbered them, then their number."""
        return packed_firsts(self.manifest)

    def pads(self) -> dict[str, int]:
        """The keys the rows take from the inputs -> their pads."""
        config = self.manifest.pack_config()
        return {config.keys().values: config.pad_id} | {
            c["name"]: c["pad"] for c in self.manifest.columns or []}


def plan_verify(output_dir: str, inputs: Sequence[str] | None, max_violations: int
                ) -> tuple[VerifyJob, Collector]:
    """The job, and the violations found before any step runs (the tokenizer's)."""
    manifest = read_manifest(output_dir, check_shards=False)
    out = Collector(max_violations)
    check_tokenizer(manifest, ReadOptions(**manifest.inputs["read_options"]), out)
    return VerifyJob(output_dir, input_paths(manifest, inputs), manifest, max_violations), out


def shard_pieces(shard: int, job: VerifyJob) -> list[tuple[int, np.ndarray]]:
    """(input, [5, k]: shard, slot number, example, start, length; i32 where every value fits)
    of a shard's used slots whose example is an input's; none if the shard cannot be read
    (`check_routed` says why)."""
    manifest = job.manifest
    batch = decode_shard(job.output_dir, manifest.shards[shard],
                         (manifest.shard_num_rows or [])[shard], manifest)
    if not batch:
        return []
    _, _, ex, st, ln, _ = used_slots(batch, manifest.pack_config())
    firsts = job.firsts
    table = np.stack([np.full(ex.size, shard), np.arange(ex.size), ex, st, ln])
    table = table[:, (ex >= 0) & (ex < firsts[-1])]
    owner = np.searchsorted(firsts, table[2], side="right") - 1
    if table.size and int(table.max()) < 2**31 and int(table.min()) >= -2**31:
        table = table.astype(np.int32)  # half the bytes a runner moves and holds
    return [(int(i), table[:, owner == i]) for i in np.unique(owner).tolist()]


def input_records(index: int, pieces: Iterable[np.ndarray | None],
                  times: list[np.ndarray] | None, job: VerifyJob
                  ) -> Iterator[tuple[int | None, InputCheck | RoutedPart]]:
    """Input `index` read once, as records a runner moves one by one: (None, its check:
    fingerprint, each example covered by the `pieces` `shard_pieces` gave it (None ignored)
    `times[index]` times, None: as a hashed mixture's record says, else once), then (shard,
    RoutedPart) per shard its pieces go to, gathered as sent: no values of the whole input."""
    manifest, config, first = job.manifest, job.manifest.pack_config(), int(job.firsts[index])
    try:
        corpus = read_corpus([job.paths[index]], ReadOptions(**manifest.inputs["read_options"]))
    except (InputError, ValueError, OSError) as e:
        yield None, InputCheck(index, [], error=one_line(e))
        return
    out = Collector(job.limit)
    check_input(index, job.paths[index], corpus.files[0], manifest, out)
    lengths, offsets = corpus.lengths, corpus.offsets
    table = np.concatenate([np.zeros((5, 0), np.int32), *(x for x in pieces if x is not None)],
                           axis=1)
    local = table[2].astype(np.int64) - first
    inside = (local < lengths.size) & (table[3] >= 0)
    keep = np.flatnonzero(inside)
    keep = keep[table[3][keep].astype(np.int64) + table[4][keep] <= lengths[local[keep]]]
    del inside, local
    table = table[:, keep[np.argsort(table[0][keep], kind="stable")]]  # by shard
    shard, slot, ex, st, ln = table
    local = ex.astype(np.int64) - first
    taken = times[index] if times is not None else takes(
        manifest.mixture, np.diff(job.firsts).tolist(), index, lengths.size)
    cover = Coverage(lengths, np.broadcast_to(np.ones(1, np.int64), lengths.shape) if taken is
                     None else taken, first)
    for a in range(0, ex.size, 1 << 20):  # numpy's temporaries a million pieces at a time
        cover.add(ex[a:a + (1 << 20)], st[a:a + (1 << 20)], ln[a:a + (1 << 20)])
    yield None, InputCheck(index, out.items, out.found, corpus.files[0], cover.findings(config),
                           cover.longest, routed=int(shard.size), repeats=0 if taken is None else
                           int(taken.sum()) - int(np.count_nonzero(taken)))
    del cover
    sources = {config.keys().values: corpus.values} | {
        c["name"]: corpus.extra_values[c["source"]] for c in manifest.columns or []}
    cuts = np.flatnonzero(np.diff(shard)) + 1
    for i, j in zip([0, *cuts.tolist()], [*cuts.tolist(), shard.size]):
        if j > i:  # one shard's pieces: their values gathered, no index over the whole input
            at = ragged_arange(offsets[local[i:j]] + st[i:j], ln[i:j])
            yield int(shard[i]), RoutedPart(slot[i:j].astype(np.int64), ln[i:j].astype(np.int64),
                                            {key: v[at] for key, v in sources.items()})


def check_routed(shard: int, parts: Iterable[RoutedPart | None], job: VerifyJob) -> ShardCheck:
    """Shard `shard` checked against the values its inputs routed to it (None among `parts`:
    a runner's placeholder, ignored); its pieces counted (their coverage is the inputs')."""
    manifest = job.manifest
    digest = ((manifest.shard_bytes or [])[shard], (manifest.shard_sha256 or [])[shard])
    source = RoutedSource([x for x in parts if x is not None], job.pads(), int(job.firsts[-1]))
    received = int(source.slots.size)
    check = check_shard(job.output_dir, manifest.shards[shard],
                        (manifest.shard_num_rows or [])[shard], digest, manifest, source,
                        job.limit)
    check.covered, check.pieces, check.received = check.pieces is not None, None, received
    return check


def mixture_times(scans: Sequence[FileScan], job: VerifyJob
                  ) -> tuple[list[np.ndarray] | None, list[str]]:
    """A legacy mixture's takes of each input's examples and what differs from its record, from
    every input's scan gathered in one place (a hashed one's: `runners.mixing`); (None, [])."""
    if not job.manifest.mixture:
        return None, []
    scans = sorted(scans, key=lambda s: s.index)
    for scan in scans:
        if scan.error is not None:
            raise InputError(scan.error)
    times, problems = example_times(job.manifest.mixture, [s.lengths for s in scans],
                                    [s.loss_counts for s in scans])
    return np.split(times, np.cumsum([s.lengths.size for s in scans])[:-1]), problems


def finish_verify(job: VerifyJob, out: Collector, inputs: Sequence[InputCheck],
                  shards: Sequence[tuple[int, list[str], int]], totals: Totals,
                  times: tuple[np.ndarray | None, list[str]]) -> VerifyReport:
    """The report from every step's findings (`shards`: shard, violations, found), in the
    order the local verify gives them; an input that cannot be read raises its InputError."""
    inputs = sorted(inputs, key=lambda c: c.index)
    for check in inputs:
        if check.error is not None:
            raise InputError(check.error)
    if (routed := sum(c.routed for c in inputs)) != totals.received:  # a runner's fault
        raise RunFailed(0, f"the inputs sent {routed:,} pieces, the shards received "
                        f"{totals.received:,}: the runner lost or repeated records; verify again")
    for check in inputs:
        out.merge(check.violations, check.found)
    check_lengths([c.info or {} for c in inputs], job.manifest, out)
    for problem in times[1]:
        out.add(problem)
    for _, items, listed in sorted(shards, key=lambda s: s[0]):
        out.merge(items, listed)
    if totals.covered:
        check_counters(*merge_findings([c.coverage for c in inputs if c.coverage is not None]),
                       Counters(**(job.manifest.stats or {})["counters"]), out)
    check_totals(totals, max((c.longest for c in inputs), default=0), job.manifest, out,
                 job.output_dir)
    return VerifyReport(not out.items, out.items, int(sum(job.manifest.shard_num_rows or [])),
                        sum(int((c.info or {}).get("num_examples", 0)) for c in inputs),
                        totals.tokens, sum(c.repeats for c in inputs), out.found)
