"""The offline job: ArrayRecord shards + manifest, verify, report, the runners (no grain, no jax).

Arranged by role::

    job.py        PackJob (one run, described once), Existing, output_session (check, lock,
                  cleanup of an output, for every runner)
    core.py       the job's steps, once for every runner: plan and summarize a block, finish
                  the plan (stats, order, pack_intent.json), place the pieces, plan and write a
                  shard, write the manifest
    steps.py      the same job as steps over inputs, blocks and shards for runners whose
                  workers share no disk: tokens routed from the inputs to their shards
    runners/      the local runner (worker processes, a local token spill: `pack_to_dir`), the
                  Beam job (`pack_beam`), the Spark job (`pack_spark`), and pass 1's machinery
                  that verify and stats share
    mixture.py    a mixture of datasets (`seqpack pack --mix`): which examples the job packs,
                  how often, and what rows, manifest, verify and stats make of it
    shards.py     shard encoding and writing (every runner)
    record.py     the run record: intent, inputs record, manifest results
    outdir.py     where a run writes (local or object storage): intent, completion records
    lock.py       one writer per output (flock locally, conditional writes on object storage)
    verify.py     proves an output lossless;  report.py  what the CLI shows

`pack(job)` runs a job with any runner.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from seqpack.pipelines.offline.job import Existing, PackJob, default_workers
from seqpack.pipelines.offline.shards import WriteOptions

if TYPE_CHECKING:
    from seqpack.pipelines.formats.manifest import Manifest
    from seqpack.pipelines.offline.runners import Progress

__all__ = ["Existing", "PackJob", "WriteOptions", "check_runner", "default_workers", "pack"]


def pack(job: PackJob, *, runner: str = "local", progress: Progress | None = None,
         beam_options: Sequence[str] = (), spark_options: Sequence[str] = (),
         quiet: bool = False) -> Manifest:
    """Runs `job` with the local runner (`progress`: a progress bar), as a Beam job
    (`beam_options`: "KEY=VALUE" pipeline options) or as a Spark job (`spark_options`:
    "master=URL" or "spark.NAME=VALUE"; `progress` too); `quiet`: Beam's or Spark's logs to a
    temporary file. First checks that a shard of rows in each worker fits in memory. Returns
    the manifest."""
    from seqpack.pipelines.offline import runners

    check_runner(runner, beam_options, spark_options)
    job.check_memory()
    if runner == "beam":
        return runners.pack_beam(job, beam_options=beam_options, quiet=quiet)
    if runner == "spark":
        return runners.pack_spark(job, spark_options=spark_options, quiet=quiet,
                                  progress=progress)
    return runners.pack_to_dir(job, progress=progress)


def check_runner(runner: str, beam_options: Sequence[str], spark_options: Sequence[str]) -> None:
    """UsageError for a runner `pack` does not know, or options given to another runner."""
    from seqpack.pipelines.errors import UsageError

    if runner not in ("local", "beam", "spark"):
        raise UsageError(f"runner={runner!r} must be 'local', 'beam' or 'spark'")
    if beam_options and runner != "beam":
        raise UsageError("beam_options= needs runner='beam'")
    if spark_options and runner != "spark":
        raise UsageError("spark_options= needs runner='spark'")
