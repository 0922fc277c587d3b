"""How a `seqpack` command ends: an exit code and, for an error, one `Error:` line in the
command's own words.

    0 ok; 1 verify found violations; 2 bad input, a bad option, a missing extra or what the
    system refused (a full disk, a killed worker); 130 Ctrl-C, 143 SIGTERM (an interrupted or
    failed `pack` names the command that finishes it); 141 stdout's reader went away.

The library names its parameters as a Python caller passes them (`shard_rows=33`); `to_flags`
rewrites them into the flags a CLI user types (`--shard-rows 33`) by one table, `FLAGS`.
Anything that is not bad input is a bug and keeps its traceback (SEQPACK_DEBUG=1: bad input
too).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import sys
import time
from collections.abc import Iterable

import click

from seqpack.pipelines.signals import Terminated, exit_within, interrupt_in

# The library's parameters as its messages name them (`name=`, `name=value`, `name['key']=`)
# -> the commands' flags; an entry `name=value` is a flag of its own.
FLAGS = {
    "seq_len": "--seq-len", "max_segments": "--max-segments", "strategy": "--strategy",
    "overflow": "--overflow", "segment_alignment": "--segment-alignment", "pad_id": "--pad-id",
    "context_parallel": "--context-parallel",
    "feature": "--feature", "input_format": "--input-format", "column": "--column",
    "field": "--field", "extra_columns": "--column", "read_options.extra_columns": "--column",
    "tokenizer": "--tokenizer", "text_unit": "--text-unit", "shard_rows": "--shard-rows",
    "compression": "--compression", "workers": "--workers", "block_size": "--block-size",
    "pads": "--pad", "roles": "--role", "seed": "--seed", "data_parallel": "--data-parallel",
    "batch_size": "--batch-size", "d_model": "--d-model", "beam_options": "--beam-option",
    "max_violations": "--max-violations", "existing='resume'": "--resume",
    "existing='overwrite'": "--overwrite", "resume=True": "--resume",
    "overwrite=True": "--overwrite", "fsync=True": "--fsync",
    "allow_duplicates=True": "--allow-duplicates", "runner='beam'": "--runner beam",
    "format": "--format",
    "spark_options": "--spark-option", "runner='spark'": "--runner spark",
    "weights": "--weights", "mix_unit": "--mix-unit", "mix_tokens": "--mix-tokens",
    "max_repetition": "--max-repetition",
}
_STARTED = time.time()  # the CLI's start (this module is imported as it starts)
_QUOTED = r"'[^']*'"


def _either(names: Iterable[str]) -> str:
    """A regex alternative of `names`, the longest first."""
    return "|".join(map(re.escape, sorted(names, key=len, reverse=True)))


_MENTION = re.compile(
    rf"(?<![\w./=-])(?:(?P<exact>{_either(k for k in FLAGS if '=' in k)})(?![\w'])"
    rf"|(?P<name>{_either(k for k in FLAGS if '=' not in k)})(?:\[(?P<key>{_QUOTED})\])?="
    rf"(?P<value>{_QUOTED}(?:(?:, | or ){_QUOTED})*)?(?P<more>(?=[^\s,;:)\]]))?)")


def to_flags(message: str) -> str:
    """A library message in the commands' words: each parameter it names (`FLAGS`) as its
    flag, a quoted value unquoted where a shell needs no quotes. `shard_rows=33` -> `--shard-rows
    33`, `pads['labels']='x'` -> `--pad labels=x`, `overflow='split' or 'drop'` -> `--overflow
    split or drop`, `pass another feature=` -> `pass another --feature`, `existing='resume'` ->
    `--resume`."""

    def flag(m: re.Match) -> str:
        if m["exact"]:
            return FLAGS[m["exact"]]
        value = re.sub(_QUOTED, lambda q: _unquote(q[0]), m["value"] or "")
        if m["key"]:
            return f"{FLAGS[m['name']]} {_unquote(m['key'])}={value}"
        return FLAGS[m["name"]] + (f" {value}" if value or m["more"] is not None else "")

    return _MENTION.sub(flag, message)


def _unquote(quoted: str) -> str:
    text = quoted[1:-1]
    return text if text and shlex.quote(text) == text else quoted


class BadInput(click.ClickException):
    exit_code = 2


class Interrupted(click.ClickException):
    exit_code = 130


class _Warnings(logging.Formatter):
    """The library's warnings (the `seqpack` logger) as a command shows them: one line each,
    its parameters as flags."""

    def format(self, record: logging.LogRecord) -> str:
        return "warning: " + to_flags(record.getMessage())


def show_warnings() -> None:
    """The `seqpack` logger's warnings on stderr, in the command's words."""
    log = logging.getLogger("seqpack")
    if not any(isinstance(h.formatter, _Warnings) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_Warnings())
        log.addHandler(handler)
        log.propagate = False


def _bad_input(e: BaseException) -> bool:
    """The one place that decides: bad input or usage (exit 2), or a bug (a traceback)."""
    from seqpack.pipelines.errors import InputError, MissingDependency, UsageError

    return isinstance(e, (InputError, UsageError, MissingDependency, OSError))


def _resume_hint(ctx: click.Context, args: list[str]) -> str:
    """For a `pack` that stopped after it started writing: the command that finishes the run,
    or that its output is complete. `ctx`: the group's; `args`: the command line after
    `seqpack`."""
    if not args or args[0] != "pack" or "--dry-run" in args:  # a dry run writes nothing
        return ""
    from seqpack.pipelines.offline.outdir import run_state

    assert isinstance(ctx.command, click.Group)
    try:
        with ctx.command.commands["pack"].make_context("pack", list(args[1:]), parent=ctx,
                               resilient_parsing=True) as sub:
            out = sub.params.get("output_dir")
    except click.ClickException:
        return ""
    try:
        state = run_state(out) if out else ""
    except Exception:  # noqa: BLE001 - a hint must never hide the error it goes with
        return ""
    if state == "complete" and "--overwrite" in args and not _written_since_start(out):
        return (f"; the output at {out} is still the earlier run's (this one stopped before "
                "replacing it): run the same command again")
    if state != "interrupted":
        return {"complete": f"; the output at {out} is complete",
                "none": "; nothing was written yet: run the same command again"}.get(state, "")
    again = [a for a in args if a not in ("--resume", "--overwrite")]
    return f"; finish the run with: seqpack {shlex.join([*again, '--resume'])}"


def _written_since_start(out: str) -> bool:
    """Whether the manifest at `out` was written by this process (after it started); True
    where that cannot be told (an object store's output)."""
    try:
        written = os.path.getmtime(os.path.join(out, "manifest.json"))
        return written >= _STARTED
    except (OSError, ValueError):
        return True


class Group(click.Group):
    """Maps errors to exit codes: bad input, usage and missing extras print one `Error:` line
    (`to_flags` of the library's message) and exit with 2 (click's own usage errors too: no
    usage block); Ctrl-C exits with 130 and, for an interrupted `pack`, names the `--resume`
    command that finishes it; anything else is a bug and keeps its traceback.

    Set SEQPACK_DEBUG=1 to get the traceback of bad input too.
    """

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """click's main, but Ctrl-C at any instant (while the options are parsed too, where
        click would print `Aborted!` and exit 1, the code of a verify that failed) is one
        `Error:` line and exit 130."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, False, **extra)
        except (click.Abort, KeyboardInterrupt):
            click.echo("Error: interrupted", err=True)
            exit_within(130)
        except click.ClickException as e:
            e.show()
            if isinstance(e, Interrupted):
                exit_within(e.exit_code)
            sys.exit(e.exit_code)
        sys.exit(rv if isinstance(rv, int) else 0)

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.exceptions.NoArgsIsHelpError:
            raise
        except click.UsageError as e:  # the group's own options
            raise BadInput(e.format_message()) from None

    def invoke(self, ctx: click.Context):
        # The subcommand's arguments, taken before click consumes them (click 8.2 renamed
        # protected_args to _protected_args).
        protected = vars(ctx).get("_protected_args", vars(ctx).get("protected_args", []))
        args = [*protected, *ctx.args]
        from seqpack.pipelines.errors import RunFailed, one_line

        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as e:
            raise _interrupted(e, ctx, args) from None
        except click.exceptions.NoArgsIsHelpError:
            raise
        except click.UsageError as e:  # a subcommand's options and arguments
            raise BadInput(e.format_message()) from None
        except BrokenPipeError:  # stdout's reader went away (`seqpack ... | head`)
            _quiet_stdout()
            raise click.exceptions.Exit(141) from None
        except Exception as e:
            interrupt = interrupt_in(e)
            if interrupt is not None:  # an interrupt wrapped on its way (see _interrupt_in)
                raise _interrupted(interrupt, ctx, args) from None
            if isinstance(e, click.ClickException | click.exceptions.Exit | click.Abort) \
                    or os.environ.get("SEQPACK_DEBUG") or not _bad_input(e):
                raise
            hint = _resume_hint(ctx, args) if isinstance(e, RunFailed) else ""
            raise BadInput(to_flags(one_line(e)).removesuffix(".") + hint) from None


def _interrupted(e: KeyboardInterrupt, ctx: click.Context, args: list[str]) -> Interrupted:
    """The one line of an interrupt (130) or a SIGTERM (143), with the command that finishes
    an interrupted pack."""
    error = Interrupted(("terminated (SIGTERM)" if isinstance(e, Terminated) else
                         "interrupted") + _resume_hint(ctx, args))
    error.exit_code = 143 if isinstance(e, Terminated) else 130
    return error


def _quiet_stdout() -> None:
    """Points stdout at /dev/null, so the interpreter's final flush raises nothing."""
    with contextlib.suppress(OSError, ValueError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)


class RichProgress:
    """A transient rich progress bar on stderr, per phase of the run: "reading" (input bytes)
    then "writing" (tokens packed, rows written), each with its rate and time left."""

    def __init__(self):
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(
            TextColumn("{task.description}"), BarColumn(),
            TextColumn("{task.percentage:>3.0f}%"), TextColumn("{task.fields[detail]}"),
            TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("eta"),
            TimeRemainingColumn(), console=Console(stderr=True), transient=True,
        )
        self.task = self.bar.add_task("starting", total=None, detail="", rate="")
        self.unit = ""

    def __enter__(self):
        self.bar.start()
        return self

    def __exit__(self, *exc):
        self.bar.stop()

    def phase(self, name: str, total: int) -> None:
        self.unit = " MB" if name == "reading" else "M tokens"
        self.bar.reset(self.task, description=name, total=total, detail="", rate="")

    def advance(self, amount: int, rows: int = 0) -> None:
        self.bar.advance(self.task, amount)
        speed = self.bar.tasks[0].speed
        rate = f"{speed / 1e6:.1f}{self.unit}/s" if speed else ""
        self.bar.update(self.task, detail=f"{rows:,} rows" if rows else "", rate=rate)


def terminal_progress() -> RichProgress | None:
    """A progress bar when stderr is a terminal and rich is installed; None otherwise."""
    if not sys.stderr.isatty():
        return None
    try:
        return RichProgress()
    except ImportError:
        return None
