"""The offline job: ArrayRecord shards + manifest, verify, report, the Beam job (no grain, no jax).

Arranged by role::

    job.py        PackJob (one run, described once), Existing, output_session (check, lock,
                  cleanup of an output, for both runners)
    read.py       pass 1, shared by pack and verify: inputs scanned in parallel, tokens spilled
    local.py      the local runner (`pack_to_dir`): pass 1, plan, pass 2
    beam.py       the Beam runner (`pack_beam`) and beam_steps.py, its steps as plain functions
    shards.py     shard encoding and writing (both runners)
    record.py     the run record: intent, inputs record, manifest results
    outdir.py     where a run writes (local or object storage): intent, completion records
    lock.py       one writer per output (flock locally, conditional writes on object storage)
    spill.py      pass 1's token spill;  workers.py  the worker processes
    verify.py     proves an output lossless;  report.py  what the CLI shows

`pack(job)` runs a job with either runner.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from seqpack.pipelines.offline.job import Existing, PackJob, default_workers
from seqpack.pipelines.offline.shards import WriteOptions

if TYPE_CHECKING:
    from seqpack.pipelines.formats.manifest import Manifest
    from seqpack.pipelines.offline.read import Progress

__all__ = ["Existing", "PackJob", "WriteOptions", "default_workers", "pack"]


def pack(job: PackJob, *, runner: str = "local", progress: Progress | None = None,
         beam_options: Sequence[str] = (), quiet: bool = False) -> Manifest:
    """Runs `job` with the local runner (`progress`: a progress bar) or as a Beam job
    (`beam_options`: "KEY=VALUE" pipeline options; `quiet`: Beam's logs to a temporary file);
    first checks that a shard of rows in each worker fits in memory. Returns the manifest."""
    from seqpack.pipelines.errors import UsageError

    if runner not in ("local", "beam"):
        raise UsageError(f"runner={runner!r} must be 'local' or 'beam'")
    if beam_options and runner != "beam":
        raise UsageError("--beam-option needs --runner beam")
    job.check_memory()
    if runner == "beam":
        from seqpack.pipelines.offline.beam import pack_beam  # MissingDependency without beam

        return pack_beam(job, beam_options=beam_options, quiet=quiet)
    from seqpack.pipelines.offline.local import pack_to_dir

    return pack_to_dir(job, progress=progress)
