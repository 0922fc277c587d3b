"""One packing run, described once: `PackJob`, and the output session both runners open.

    job = PackJob(["a.parquet", "b.parquet"], "packed/", PackConfig(2048, overflow="split"),
                  read_options=ReadOptions(column="input_ids"), existing="resume", workers=8)
    manifest = offline.pack(job)                       # the local runner (`runners.pack_to_dir`)
    manifest = offline.pack(job, runner="beam")        # the same bytes as a Beam job

A job holds what decides the output (inputs, config, how inputs are read and rows stored, the
plan's block size, extra columns' pads and roles, the rows' output order) and how the run
treats what is already there (`existing`: refuse a
non-empty output, resume an interrupted run, or overwrite); `workers` only decides how fast
(local worker processes, or the DirectRunner's `direct_num_workers`; None: every CPU). The
local runner, the Beam job, its steps and the CLI all take the job, not a bag of parameters.

`output_session(job)` is the one place an output is opened and closed, for both runners: it
refuses an unusable output before any input is read, creates the directory, holds the output's
lock (`lock.DirLock`: one writer per output) for the whole run, and on the way out removes the
lock, the local spill, a remote output's staging directory, and a directory it created that
stayed empty. A failing cleanup step never hides the error that ended the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence

from seqpack.packer import PackConfig
from seqpack.packer.order import RowOrder
from seqpack.packer.plan import DEFAULT_BLOCK_SIZE, check_block_size
from seqpack.pipelines import storage
from seqpack.pipelines.errors import UsageError
from seqpack.pipelines.formats.inputs import LossCount, ReadOptions
from seqpack.pipelines.offline.lock import DirLock
from seqpack.pipelines.offline.mixture import MixSpec, loss_count
from seqpack.pipelines.offline.outdir import OutputDir, check_dir
from seqpack.pipelines.offline.shards import WriteOptions

SPILL_DIR = "spill.tmp"  # the local runner's token spill, in the output's staging directory


class Existing(enum.Enum):
    """What a run does with an output that already holds something."""

    REFUSE = "refuse"  # a non-empty output is an error (the default)
    RESUME = "resume"  # finish an interrupted run (or repair a complete one)
    OVERWRITE = "overwrite"  # remove what seqpack wrote there, then pack


ROLES = ("labels", "mask", "values")


def default_role(name: str) -> str:
    """An extra column's role from its name: `labels` (`*labels`), `mask` (`*mask*`), or
    `values`."""
    low = name.lower()
    return "labels" if low.endswith("labels") else "mask" if "mask" in low else "values"


def default_pad(role: str) -> int:
    """An extra column's pad by its role: -100 for labels (a label of -100 takes no loss, as in
    PyTorch and Hugging Face: padding must not be trained on), else 0."""
    return -100 if role == "labels" else 0


def default_workers() -> int:
    """The CPUs this process may run on: the default `workers` of both runners."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


@dataclasses.dataclass(frozen=True)
class PackJob:
    """One packing run (see the module docstring)."""

    inputs: Sequence[str]  # files or URLs, in order (stored as a tuple of str)
    output: str  # a directory, or a gs:// / s3:// prefix
    config: PackConfig
    _: dataclasses.KW_ONLY
    read_options: ReadOptions = dataclasses.field(default_factory=ReadOptions)
    write_options: WriteOptions = dataclasses.field(default_factory=WriteOptions)
    block_size: int = DEFAULT_BLOCK_SIZE  # examples planned together (`packer.plan_rows`)
    existing: Existing | str = Existing.REFUSE
    workers: int | None = None  # None: every CPU (`default_workers`)
    # The pad of each extra column (`read_options.extra_columns`: labels, masks); by default
    # -100 for a column of role "labels", 0 for the others (`default_pad`).
    pads: Mapping[str, int] = dataclasses.field(default_factory=dict)
    # What each extra column means for a loss (recorded in the manifest, read by the training
    # pipeline's `loss_tokens`): "labels" (-100 takes no loss), "mask" (0 takes no loss) or
    # "values"; by default from the name (`*labels` -> labels, `*mask*` -> mask, else values).
    roles: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # The output order of the plan's rows (`packer.order`): a seeded shuffle by default, the
    # plan's order, or balanced data-parallel steps.
    order: RowOrder = dataclasses.field(default_factory=RowOrder)
    # A mixture of datasets (`offline.mixture`): `inputs` are its datasets' inputs, dataset
    # after dataset; None: every example of every input once.
    mixture: MixSpec | None = None

    def __post_init__(self) -> None:
        inputs = tuple(os.fspath(p) for p in self.inputs)
        if not inputs:
            raise UsageError("no input files given")
        object.__setattr__(self, "inputs", inputs)
        object.__setattr__(self, "output", os.fspath(self.output))
        try:
            object.__setattr__(self, "existing", Existing(self.existing))
            object.__setattr__(self, "block_size", check_block_size(self.block_size))
        except ValueError as e:
            raise UsageError(str(e)) from None
        w = self.workers
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise UsageError(f"workers={w!r} must be an int >= 1 (or None: every CPU)")
        self._check_columns()
        if not isinstance(self.order, RowOrder):
            raise UsageError(f"order={self.order!r} must be a packer.order.RowOrder")
        self._check_mixture()
        entries = [{"name": n, "pad": p, "role": self.roles[n]} for n, p in self.pads.items()]
        try:  # what the format cannot write (unpadded formats and segment_alignment=)
            self.write_options.encoding.check(self.write_options.layout(
                self.config, entries, mixed=self.mixture is not None))
        except ValueError as e:
            raise UsageError(str(e)) from None

    @property
    def plan_only(self) -> bool:
        """Rows by reference with no extra columns: a shard is its plan, so no input is read
        after its scan (no spill locally, no tokens routed on Beam or Spark)."""
        return self.write_options.encoding.by_reference and not self.read_options.extra_columns

    def _check_columns(self) -> None:
        extra = list(self.read_options.extra_columns)
        unknown = [n for n in self.pads if n not in extra]
        if unknown:
            raise UsageError(f"pads[{unknown[0]!r}]=...: {unknown[0]!r} is not an extra column "
                             f"(read_options.extra_columns={extra})")
        taken = [n for n in extra if n in self.config.keys().roles().values()]
        if taken:
            raise UsageError(f"read_options.extra_columns={extra}: the rows already have a key "
                             f"{taken[0]!r} (the token feature's, feature="
                             f"{self.config.feature!r}); pass another feature=")
        pads, roles = {}, {}
        for name in extra:
            roles[name] = self.roles.get(name, default_role(name))
            if roles[name] not in ROLES:
                raise UsageError(f"roles[{name!r}]={roles[name]!r}: the role must be one of "
                                 f"{ROLES}")
            pad = self.pads.get(name, default_pad(roles[name]))
            if isinstance(pad, bool) or not isinstance(pad, int):
                raise UsageError(f"pads[{name!r}]={pad!r} must be an integer")
            pads[name] = int(pad)
        for name in self.roles:
            if name not in extra:
                raise UsageError(f"roles[{name!r}]=...: {name!r} is not an extra column "
                                 f"(read_options.extra_columns={extra})")
        object.__setattr__(self, "pads", pads)
        object.__setattr__(self, "roles", roles)

    def _check_mixture(self) -> None:
        mix = self.mixture
        if mix is None:
            return
        if not isinstance(mix, MixSpec):
            raise UsageError(f"mixture={mix!r} must be an offline.mixture.MixSpec")
        if list(self.inputs) != mix.inputs:
            raise UsageError("inputs= must be the mixture's inputs, dataset after dataset "
                             "(mixture.inputs)")
        if mix.mix_unit == "loss_tokens" and not self.loss_columns:
            raise UsageError("mix_unit='loss_tokens' counts labels other than -100 or masks "
                             "other than 0: pack a labels or mask column (extra_columns=)")
        cut = self.config.overflow in ("truncate", "drop")  # the weights are of what rows keep
        object.__setattr__(self, "mixture", dataclasses.replace(
            mix, overflow=str(self.config.overflow) if cut else None,
            seq_len=self.config.seq_len if cut else None))

    @property
    def loss_columns(self) -> dict[str, str]:
        """The extra columns that decide the loss: name -> "labels" or "mask"."""
        return {n: r for n, r in self.roles.items() if r in ("labels", "mask")}

    @property
    def mix_loss_columns(self) -> LossCount | None:
        """What the scans of a mixture count as loss tokens, else None."""
        if self.mixture is None or not self.loss_columns:
            return None
        return loss_count(self.loss_columns, self.mixture)

    @property
    def resume(self) -> bool:
        return self.existing is Existing.RESUME

    @property
    def overwrite(self) -> bool:
        return self.existing is Existing.OVERWRITE

    @property
    def num_workers(self) -> int:
        return self.workers or default_workers()

    def check_memory(self) -> None:
        """UsageError unless one packed row, and one shard of rows in each worker, fit in the
        memory available now; checked before anything is read or written."""
        L, S = self.config.seq_len, self.config.max_segments
        # tokens (<= 8 bytes) + int32 segment ids and positions; per slot its offset, length
        # (int32) and source example and start (int64), and as much again while it is built
        row = L * 16 + S * 48
        available = available_memory()
        if available is None:
            return
        if row > available:
            raise UsageError(f"seq_len={L}, max_segments={S}: one packed row needs "
                             f"{row / 2**30:.1f} GiB, more than the {available / 2**30:.1f} GiB "
                             "of memory available; pick a smaller seq_len= or max_segments= "
                             "(a row never holds more segments than tokens)")
        shard_rows, workers = self.write_options.shard_rows, self.num_workers
        need = row * shard_rows * workers  # each worker assembles one shard at a time
        if need > available:
            fit = max(1, available // (row * workers))
            raise UsageError(f"shard_rows={shard_rows} x (seq_len={L}, max_segments={S}) x "
                             f"{workers} worker(s) "
                             f"needs {need / 2**30:.1f} GiB, more than the "
                             f"{available / 2**30:.1f} GiB of memory available; pass "
                             f"shard_rows={fit} or fewer (or fewer workers=)")


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux: MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


@contextlib.contextmanager
def output_session(job: PackJob) -> Iterator[OutputDir]:
    """The output, checked, created and locked for the run (see the module docstring)."""
    out = OutputDir(job.output)
    check_dir(out, overwrite=job.overwrite, resume=job.resume)
    storage.sweep_scratch()  # what killed runs on this host left in the temp directory
    created = out.makedirs()
    lock = DirLock(out)
    ok = False
    try:
        lock.acquire()
        yield out
        ok = True
    finally:
        steps = [out.close]
        if lock.held:  # the spill is this run's only while it holds the lock
            steps.insert(0, lambda: shutil.rmtree(os.path.join(out.staging(), SPILL_DIR),
                                                  ignore_errors=True))
            steps.insert(1, lock.release)
        if created:
            steps.append(lambda: _remove_if_empty(job.output))
        _run_cleanup(steps, raise_errors=ok)


def _run_cleanup(steps: list, *, raise_errors: bool) -> None:
    """Runs every step; the first OSError is raised only when nothing else ended the run."""
    first: OSError | None = None
    for step in steps:
        try:
            step()
        except OSError as e:
            first = first or e
    if first is not None and raise_errors:
        raise first


def _remove_if_empty(path: str) -> None:
    if os.path.isdir(path) and not os.listdir(path):
        os.rmdir(path)
