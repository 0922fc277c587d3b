"""The distributed verify's steps run one after another in this process, as a runner maps them
(`pipelines/offline/runners/beam_verify.py`, `spark_verify.py`)."""

from __future__ import annotations

from collections import defaultdict

from seqpack.pipelines.formats.inputs import ReadOptions
from seqpack.pipelines.offline import steps
from seqpack.pipelines.offline.checks import Totals
from seqpack.pipelines.offline.mixture import (
    hashed,
    is_hashed,
    loss_columns_of,
    plan_problems,
    spec_of,
)
from seqpack.pipelines.offline.runners import mixing
from seqpack.pipelines.offline.verify import (
    VerifyReport,
    check_routed,
    finish_verify,
    input_records,
    mixture_times,
    plan_verify,
    shard_pieces,
)


def _hashed_times(scans, job):
    """A hashed mixture's record checked as the runners check it (`runners.mixing`: tallies
    summed per dataset, crossings, members, plan, on the inputs as read now); each input's
    takes then from the record."""
    record = job.manifest.mixture
    spec = spec_of(record)
    where = hashed.places_of(spec, [s.lengths.size for s in sorted(scans, key=lambda s: s.index)])
    sums = {}
    for scan in scans:
        for d, t in mixing.tally(scan, spec, where):
            sums[d] = mixing.add([sums.get(d), t])
    crossed = mixing.crossings(sums.items(), spec)
    found = [m for scan in scans for m in mixing.members(scan, spec, where, crossed)]
    return None, plan_problems(mixing.plan(found, spec, crossed), record)


def verify_by_steps(output_dir, inputs=None, max_violations: int = 20, *,
                    runner_fault: str | None = None) -> VerifyReport:
    """`runner_fault`: "drop" or "repeat" the last record an input sends to a shard, as a
    faulty runner would."""
    job, out = plan_verify(str(output_dir), inputs, max_violations)
    m = job.manifest
    options = ReadOptions(**m.inputs["read_options"])
    loss = loss_columns_of(m.mixture, m.columns)
    scans = [steps.scan_file(i, p, options, loss) for i, p in enumerate(job.paths)]
    times = _hashed_times(scans, job) if is_hashed(m.mixture) else \
        mixture_times(scans, job) if m.mixture else (None, [])
    by_input = defaultdict(list)
    for shard in reversed(range(len(m.shards))):  # any order
        for index, table in shard_pieces(shard, job):
            by_input[index].append(table)
    checks, by_shard = [], defaultdict(list)
    for index in range(len(job.paths)):
        for shard, record in input_records(index, by_input[index], times[0], job):
            if shard is None:
                checks.append(record)
            else:
                by_shard[shard].append(record)
                last = shard
    if runner_fault == "drop":
        by_shard[last].pop()
    elif runner_fault == "repeat":
        by_shard[last].append(by_shard[last][-1])
    totals, shards = Totals.zeros(m.pack_config()), []
    for shard in range(len(m.shards)):
        check = check_routed(shard, [None, *by_shard[shard]], job)  # as the runners' placeholder
        totals.add(check)
        shards.append((shard, check.violations, check.found))
    return finish_verify(job, out, checks[::-1], shards[::-1], totals, times)
