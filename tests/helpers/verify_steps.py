"""The distributed verify's steps run one after another in this process, as a runner maps them
(`pipelines/offline/runners/beam.py`, `spark.py`)."""

from __future__ import annotations

from collections import defaultdict

from seqpack.pipelines.formats.inputs import ReadOptions
from seqpack.pipelines.offline import steps
from seqpack.pipelines.offline.checks import Totals
from seqpack.pipelines.offline.mixture import loss_columns_of
from seqpack.pipelines.offline.verify import (
    VerifyReport,
    check_routed,
    finish_verify,
    input_parts,
    mixture_times,
    plan_verify,
    shard_pieces,
)


def verify_by_steps(output_dir, inputs=None, max_violations: int = 20) -> VerifyReport:
    job, out = plan_verify(str(output_dir), inputs, max_violations)
    m = job.manifest
    options = ReadOptions(**m.inputs["read_options"])
    loss = loss_columns_of(m.mixture, m.columns)
    times = mixture_times([steps.scan_file(i, p, options, loss) for i, p in
                           enumerate(job.paths)], job) if m.mixture else (None, [])
    by_input = defaultdict(list)
    for shard in reversed(range(len(m.shards))):  # any order
        for index, table in shard_pieces(shard, job):
            by_input[index].append(table)
    checks, by_shard = [], defaultdict(list)
    for index in range(len(job.paths)):
        check, parts = input_parts(index, by_input[index], times[0], job)
        checks.append(check)
        for shard, part in parts:
            by_shard[shard].append(part)
    totals, shards = Totals.zeros(m.pack_config()), []
    for shard in range(len(m.shards)):
        check = check_routed(shard, by_shard[shard], job)
        totals.add(check)
        shards.append((shard, check.violations, check.found))
    return finish_verify(job, out, checks[::-1], shards[::-1], totals, times)
