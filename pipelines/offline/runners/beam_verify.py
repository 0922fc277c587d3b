"""`seqpack verify` as a Beam job: `offline.verify`'s distributed steps (by shard, then by
input, then by shard again) as one pipeline, run as `runners.beam` runs the pack job."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Sequence
from typing import Any

from seqpack.pipelines.errors import InputError, one_line
from seqpack.pipelines.formats.inputs import ReadOptions
from seqpack.pipelines.offline import steps
from seqpack.pipelines.offline.mixture import (
    hashed,
    is_hashed,
    loss_columns_of,
    plan_problems,
    spec_of,
)
from seqpack.pipelines.offline.outdir import OutputDir
from seqpack.pipelines.offline.runners.beam import (
    beam,
    job_report,
    pipeline_options,
    scan_input,
)
from seqpack.pipelines.offline.runners.mixing import beam_plan


def build_verify(p: Any, job: Any, out: Any, report: tuple[str, str]) -> None:
    """Adds `offline.verify`'s distributed steps for `job` (a `VerifyJob`) to pipeline `p`:
    shards to the inputs their pieces come from, inputs to the shards their values go to; the
    report (`out`: the violations found before) or the error that stops it goes to `report`
    (directory, name) as JSON."""
    from seqpack.pipelines.offline import verify

    m, n = job.manifest, len(job.manifest.shards)
    keyed = (lambda name, keys: p | name >> beam.Create([(k, None) for k in keys]))
    scans = (p | "ScanInputs" >> beam.Create(list(enumerate(job.paths)) if m.mixture else [])
             | "SpreadScans" >> beam.Reshuffle()
             | "Scan" >> beam.Map(scan_input, ReadOptions(**m.inputs["read_options"]),
                                  loss_columns_of(m.mixture, m.columns)))
    times = beam.pvalue.AsSingleton(_hashed_times(p, scans, job) if is_hashed(m.mixture) else
                                    scans | "GatherScans" >> beam.combiners.ToList()
                                    | "Takes" >> beam.Map(_times, job))
    pieces = (p | "Shards" >> beam.Create(list(range(n))) | "SpreadShards" >> beam.Reshuffle()
              | "ShardPieces" >> beam.FlatMap(verify.shard_pieces, job))
    routed = (
        (pieces, keyed("EveryInput", range(len(job.paths)))) | "AllInputs" >> beam.Flatten()
        | "GroupByInput" >> beam.GroupByKey()
        | "InputParts" >> beam.FlatMap(lambda kv, t: verify.input_records(
            kv[0], kv[1], t[0], job), times))
    parts = routed | "Parts" >> beam.Filter(lambda r: r[0] is not None)
    checked = (
        (parts, keyed("EveryShard", range(n))) | "AllShards" >> beam.Flatten()
        | "GroupByShard" >> beam.GroupByKey()
        | "CheckShards" >> beam.Map(_check_shard, job))
    zero = verify.Totals.zeros(m.pack_config())
    totals = (checked | "Totals" >> beam.Map(lambda c: _totals(c[1], zero)) | "SumTotals"
              >> beam.CombineGlobally(lambda ts: functools.reduce(verify.Totals.merge, ts, zero)))
    side = [beam.pvalue.AsSingleton(x) for x in (
        routed | "InputChecks" >> beam.Filter(lambda r: r[0] is None)
        | "Checks" >> beam.Map(lambda r: r[1]) | "GatherInputChecks" >> beam.combiners.ToList(),
        checked | "Found" >> beam.Map(lambda c: (c[0], c[1]) if isinstance(c[1], str) else
                                      (c[0], c[1].violations, c[1].found))
        | "GatherFound" >> beam.combiners.ToList(), totals)]
    _ = (p | "Once" >> beam.Create([None])
         | "FinishVerify" >> beam.Map(_finish_verify, job, out, report, times, *side))


def _hashed_times(p: Any, scans: Any, job: Any) -> Any:
    """A hashed mixture's (None: each input's takes come from the record, what differs from
    the record, the first input that cannot be read) with `runners.mixing`'s steps: no
    example meets in one place."""
    record = job.manifest.mixture
    spec = spec_of(record)
    where = beam.pvalue.AsSingleton(  # the inputs as read now, as the local verify reads them
        scans | "ScanCounts" >> beam.Map(lambda s: (s.index, s.lengths.size))
        | "GatherCounts" >> beam.combiners.ToList()
        | "Places" >> beam.Map(lambda c: hashed.places_of(spec, [n for _, n in sorted(c)])))
    mix = beam_plan(p, scans, spec, where)
    errors = beam.pvalue.AsList(scans | "Unread" >> beam.Filter(lambda s: s.error is not None))
    return (p | "Compare" >> beam.Create([None]) | "CompareRecord" >> beam.Map(
        lambda _, mx, bad: (None, plan_problems(mx, record), min(
            [(s.index, s.error) for s in bad])[1] if bad else None), mix, errors))


def _times(scans: list[steps.FileScan], job: Any) -> tuple[Any, list[str], str | None]:
    from seqpack.pipelines.offline.verify import mixture_times

    try:
        return (*mixture_times(scans, job), None)
    except InputError as e:
        return None, [], one_line(e)


def _check_shard(element: tuple[int, Iterable[Any]], job: Any) -> tuple[int, Any]:
    """(shard, its ShardCheck, or the InputError that stops the run: a shard the manifest
    vouches for that cannot be decoded)."""
    from seqpack.pipelines.offline.verify import check_routed

    shard, parts = element
    try:
        return shard, check_routed(shard, parts, job)
    except InputError as e:
        return shard, one_line(e)


def _totals(check: Any, zero: Any) -> Any:
    totals = dataclasses.replace(zero)
    if not isinstance(check, str):
        totals.add(check)
    return totals


def _finish_verify(_: None, job: Any, out: Any, report: tuple[str, str], times: tuple,
                   inputs: list, found: list, totals: Any) -> None:
    from seqpack.pipelines.offline.verify import finish_verify

    where = OutputDir(report[0])
    try:
        errors = sorted(f for f in found if len(f) == 2)  # shards that cannot be read
        if times[2] is not None or errors:
            raise InputError(times[2] or errors[0][1])
        done = finish_verify(job, out, inputs, found, totals, times[:2])
        where.write_json(report[1], {"report": done.to_dict()})
    except InputError as e:
        where.write_json(report[1], {"error": one_line(e)})


def verify_beam(output_dir: str, inputs: Sequence[str] | None = None, *,
                max_violations: int = 20, beam_options: Sequence[str] = (),
                workers: int | None = None, quiet: bool = False) -> Any:
    """`offline.verify.verify` as a Beam job (see `build_verify`); returns its VerifyReport.
    The report travels through a temporary file: local with the DirectRunner, else in
    OUTPUT_DIR (every worker of a cluster sees it), removed once read."""
    from seqpack.pipelines.offline.verify import VerifyReport, plan_verify

    job, out = plan_verify(output_dir, inputs, max_violations)
    result = job_report(pipeline_options(beam_options, workers), quiet, output_dir, "verify",
                        lambda p, report: build_verify(p, job, out, report))
    if "error" in result:
        raise InputError(result["error"])
    return VerifyReport(**result["report"])
