"""`seqpack verify` as a Spark job: `offline.verify`'s distributed steps, by shard and by
input, as `runners.beam_verify` maps them, run as `runners.spark` runs the pack job."""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from seqpack.pipelines.errors import InputError
from seqpack.pipelines.formats.inputs import ReadOptions
from seqpack.pipelines.offline import steps
from seqpack.pipelines.offline.mixture import (
    hashed,
    is_hashed,
    loss_columns_of,
    plan_problems,
    spec_of,
)
from seqpack.pipelines.offline.runners.mixing import spark_plan
from seqpack.pipelines.offline.runners.spark import MAX_TASKS, by_key, pyspark, spark_job

_AGAIN = ("see the executors' logs (a task out of memory: give it more, e.g. spark.driver.memory= "
          "on a local master), then verify again")


def verify_spark(output_dir: str, inputs: Sequence[str] | None = None, *,
                 max_violations: int = 20, spark_options: Sequence[str] = (),
                 workers: int | None = None, quiet: bool = False) -> Any:
    """`offline.verify.verify` as a Spark job (its distributed steps, by shard and by input,
    as `runners.beam_verify.build_verify` maps them); returns the VerifyReport."""
    from seqpack.pipelines.offline import verify

    job, out = verify.plan_verify(output_dir, inputs, max_violations)
    m, shards, inputs_ = job.manifest, len(job.manifest.shards), len(job.paths)
    with spark_job(spark_options, workers, quiet, _AGAIN) as sc:
        times: tuple = (None, [])
        if m.mixture:
            options, loss = ReadOptions(**m.inputs["read_options"]), loss_columns_of(
                m.mixture, m.columns)
            scans = sc.parallelize(list(enumerate(job.paths)), max(1, min(inputs_, MAX_TASKS))
                                   ).map(lambda ip: steps.scan_file(ip[0], ip[1], options, loss))
            times = _hashed_times(scans, job) if is_hashed(m.mixture) else \
                verify.mixture_times(scans.collect(), job)
        every = (lambda n: sc.parallelize([(k, None) for k in range(n)],
                                          max(1, min(n, MAX_TASKS))))
        pieces = sc.parallelize(list(range(shards)), max(1, min(shards, MAX_TASKS))).flatMap(
            functools.partial(verify.shard_pieces, job=job))
        routed = by_key(pieces.union(every(inputs_)), inputs_, _input_parts,
                        sc.broadcast(times[0]), job).persist(pyspark.StorageLevel.DISK_ONLY)
        checks = routed.filter(lambda r: r[0] is None).map(operator.itemgetter(1)).collect()
        parts = routed.filter(lambda r: r[0] is not None).union(every(shards))
        zero: tuple[Any, list] = (verify.Totals.zeros(m.pack_config()), [])
        totals, found = by_key(parts, shards, _check_routed, job).aggregate(
            zero, _add_check, lambda a, b: (a[0].merge(b[0]), a[1] + b[1]))
        routed.unpersist()
    return verify.finish_verify(job, out, checks, found, totals, times)


def _hashed_times(scans: Any, job: Any) -> tuple[None, list[str]]:
    """A hashed mixture's (None: each input's takes come from the record, what differs from
    the record) with `runners.mixing`'s steps: no example meets in the driver."""
    scans = scans.map(lambda s: (s.index, s)).persist()
    bad = scans.filter(lambda s: s[1].error is not None).collect()
    if bad:
        raise InputError(min(bad)[1].error)  # the first input that cannot be read
    record = job.manifest.mixture
    counts = [n for _, n in sorted(scans.map(lambda s: (s[0], s[1].lengths.size)).collect())]
    spec = spec_of(record)
    mix = spark_plan(scans, spec, hashed.places_of(spec, counts))  # the inputs as read now
    scans.unpersist()
    return None, plan_problems(mix, record)


def _input_parts(index: int, tables: Iterable[Any], times: Any, job: Any) -> Iterator[tuple]:
    from seqpack.pipelines.offline.verify import input_records

    return input_records(index, tables, times.value, job)


def _check_routed(shard: int, parts: Iterable[Any], job: Any) -> list[tuple[int, Any]]:
    from seqpack.pipelines.offline.verify import check_routed

    return [(shard, check_routed(shard, parts, job))]


def _add_check(acc: tuple[Any, list], item: tuple[int, Any]) -> tuple[Any, list]:
    """Adds one shard's check to (the totals, the shards' violations where there are some)."""
    shard, check = item
    acc[0].add(check)
    if check.found:
        acc[1].append((shard, check.violations, check.found))
    return acc
