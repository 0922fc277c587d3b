"""The runners of the offline job, and the local machinery that verify and stats share.

A runner maps `offline.core`'s steps onto an executor; nothing of the job's logic is here
twice. Arranged by role::

    local.py    the local runner (`pack_to_dir`): worker processes, a local token spill; its
                plan alone (`plan_job`: `seqpack pack --dry-run`)
    beam.py     the Beam job (`pack_beam`): the steps of `offline.steps` as a pipeline; its
                plan alone (`plan_beam`: a dry run)
    beam_verify.py  `verify_beam`: `offline.verify`'s distributed steps as a Beam job
    spark.py    the Spark job (`pack_spark`): the same steps as RDD stages, by block and shard;
                its plan alone (`plan_spark`: a dry run)
    spark_verify.py  `verify_spark`: verify's distributed steps as a Spark job
    read.py     pass 1 (`read_inputs`), shared by pack and verify: inputs scanned in parallel,
                tokens spilled; `scan_lengths`, the same scan without a spill (stats)
    spill.py    pass 1's token spill (`SpillWriter`, `SpillReader`, `ExampleStarts`)
    workers.py  the worker processes (`Workers`)

A new runner is one module here mapping `offline.steps`. Code outside the wing imports from
this package only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from seqpack.pipelines.offline.runners.local import pack_to_dir, plan_job, plan_map
from seqpack.pipelines.offline.runners.read import (
    Pass1,
    Progress,
    load_context,
    read_inputs,
    save_context,
    scan_lengths,
)
from seqpack.pipelines.offline.runners.spill import Run, SpillReader
from seqpack.pipelines.offline.runners.workers import Workers

if TYPE_CHECKING:
    from seqpack.pipelines.formats.manifest import Manifest
    from seqpack.pipelines.offline.job import PackJob

__all__ = [
    "Pass1", "Progress", "Run", "SpillReader", "Workers", "load_context", "pack_beam",
    "pack_spark", "pack_to_dir", "plan_beam", "plan_job", "plan_map", "plan_spark",
    "read_inputs", "save_context",
    "scan_lengths", "verify_beam", "verify_spark",
]


def pack_beam(job: PackJob, *, beam_options: Sequence[str] = (), quiet: bool = False
              ) -> Manifest:
    """`beam.pack_beam`: apache_beam is imported here, when a Beam job runs (MissingDependency
    without it), not with the package."""
    from seqpack.pipelines.offline.runners import beam

    return beam.pack_beam(job, beam_options=beam_options, quiet=quiet)


def pack_spark(job: PackJob, *, spark_options: Sequence[str] = (), quiet: bool = False,
               progress: Progress | None = None) -> Manifest:
    """`spark.pack_spark`: pyspark is imported here, when a Spark job runs (MissingDependency
    without it), not with the package."""
    from seqpack.pipelines.offline.runners import spark

    return spark.pack_spark(job, spark_options=spark_options, quiet=quiet, progress=progress)


def plan_beam(job: PackJob, step_rows: int | None, *, beam_options: Sequence[str] = (),
              quiet: bool = False) -> tuple[Any, dict, Any]:
    """`beam.plan_beam` (the plan of a dry run), apache_beam imported when it runs."""
    from seqpack.pipelines.offline.runners import beam

    return beam.plan_beam(job, step_rows, beam_options=beam_options, quiet=quiet)


def plan_spark(job: PackJob, step_rows: int | None, *, spark_options: Sequence[str] = (),
               quiet: bool = False, progress: Progress | None = None) -> tuple[Any, dict, Any]:
    """`spark.plan_spark` (the plan of a dry run), pyspark imported when it runs."""
    from seqpack.pipelines.offline.runners import spark

    return spark.plan_spark(job, step_rows, spark_options=spark_options, quiet=quiet,
                            progress=progress)


def verify_beam(output_dir: str, inputs: Sequence[str] | None = None, *,
                max_violations: int = 20, beam_options: Sequence[str] = (),
                workers: int | None = None, quiet: bool = False) -> Any:
    """`beam_verify.verify_beam` (a VerifyReport), apache_beam imported when it runs."""
    from seqpack.pipelines.offline.runners import beam_verify

    return beam_verify.verify_beam(output_dir, inputs, max_violations=max_violations,
                                   beam_options=beam_options, workers=workers, quiet=quiet)


def verify_spark(output_dir: str, inputs: Sequence[str] | None = None, *,
                 max_violations: int = 20, spark_options: Sequence[str] = (),
                 workers: int | None = None, quiet: bool = False) -> Any:
    """`spark_verify.verify_spark` (a VerifyReport), pyspark imported when it runs."""
    from seqpack.pipelines.offline.runners import spark_verify

    return spark_verify.verify_spark(output_dir, inputs, max_violations=max_violations,
                                     spark_options=spark_options, workers=workers, quiet=quiet)
