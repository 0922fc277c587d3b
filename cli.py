"""The `seqpack` command: pack a corpus offline, check its statistics, verify it, inspect rows.

    seqpack pack                                   # packs the built-in sample, prints its stats
    seqpack pack data/*.parquet -o packed/ --seq-len 2048 --column input_ids --overflow split
    seqpack stats packed/                          # the packed run's statistics
    seqpack stats data/*.parquet --column input_ids --plot stats.png   # dry run, per strategy
    seqpack verify packed/ data/*.parquet          # proves the rows lossless against the inputs
    seqpack inspect packed/ --row 0

Each command parses its options, calls one library function (`pipelines.offline.pack`,
`.verify`, `.report`) and prints. How a command ends (exit codes, the one `Error:` line with
the library's parameters as flags, signals) is `pipelines.console.Group`'s. Nothing here
imports jax; heavy modules are imported inside the commands so `seqpack --help` stays fast.
"""

from __future__ import annotations

if __name__ == "__main__":  # `python -m seqpack.cli`: the signal handlers before the imports
    from seqpack.pipelines.signals import run_cli

    run_cli()

import contextlib
import json
import os
import sys

import click

from seqpack.pipelines.console import Group, show_warnings
from seqpack.pipelines.options import PACK_OPTIONS, STATS_OPTIONS
from seqpack.pipelines.signals import handle_signals


def _usage(build, *args, **kwargs):
    """Builds an options object; its ValueError (a bad argument) becomes a usage error."""
    from seqpack.pipelines.errors import UsageError

    try:
        return build(*args, **kwargs)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _feature(feature: str | None, columns: tuple[str, ...], tokenizer: str | None) -> str:
    """The row key: --feature, else the first column's name where it names token ids."""
    if feature is not None:
        return feature
    name = columns[0]
    return name if tokenizer is None and name.isidentifier() else "tokens"


def _config(strategy, seq_len, max_segments, overflow, segment_alignment, pad_id, feature,
            context_parallel=None):
    from seqpack.packer import PackConfig

    return _usage(PackConfig, seq_len, max_segments=max_segments, strategy=strategy,
                  overflow=overflow or "error", segment_alignment=segment_alignment,
                  pad_id=pad_id, feature=feature, context_parallel=context_parallel)


def _refuse_overflow_for_concat_split(strategies, overflow) -> None:
    """concat_split alone cuts examples at row ends: an --overflow given for it is a mistake."""
    if set(strategies) == {"concat_split"} and overflow is not None:
        raise click.UsageError(f"--overflow {overflow} does not apply to --strategy "
                               "concat_split, which cuts examples at row ends itself; leave it "
                               "out")


def _expand(paths: tuple[str, ...], *, allow_duplicates: bool = False,
            output_ok: bool = False, input_format: str | None = None) -> list[str]:
    """INPUT arguments as input files (`formats.paths.expand_inputs`); with `output_ok` one
    seqpack output directory stays as it is (stats)."""
    from seqpack.pipelines.formats.paths import expand_inputs, is_output_dir

    if output_ok and len(paths) == 1 and is_output_dir(paths[0]):
        return list(paths)
    return expand_inputs(paths, allow_duplicates=allow_duplicates, input_format=input_format)


def _row_order(row_order, seed, data_parallel, batch_size, cost_model, d_model, mixed=False):
    """The RowOrder of the options: with --mix and --batch-size (b > 1), steps of b rows (one
    rank each unless --data-parallel) that hold the mixture's shares."""
    from seqpack.packer.order import CostModel, RowOrder

    if data_parallel is not None and row_order == "plan":
        raise click.UsageError("--data-parallel orders the rows itself; leave out --row-order "
                               "plan")
    cost = _usage(CostModel, kind=cost_model, d_model=d_model)
    if data_parallel is None and mixed and (batch_size or 1) > 1 and row_order == "shuffle":
        data_parallel = 1
    if data_parallel is None:
        return _usage(RowOrder, mode=row_order, seed=seed, cost=cost)
    return _usage(RowOrder, mode="balanced", seed=seed, data_parallel=data_parallel,
                  batch_size=batch_size or 1, cost=cost)


def _given(name: str) -> bool:
    """Whether option `name` (its parameter name) was given, not left at its default."""
    from click.core import ParameterSource

    source = click.get_current_context().get_parameter_source(name)
    return source in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)


def _refuse_given(why: str, *, keep: tuple[str, ...] = (), among: tuple[str, ...] = (),
                  to: str = "a dry run on inputs") -> None:
    """UsageError naming the options given (not left at their defaults) outside `keep` (and,
    where `among` names some, among those): they apply `to` something else, `why` says."""
    params = click.get_current_context().command.params
    given = [p.opts[0] for p in params if p.name not in keep and (not among or p.name in among)
             and _given(p.name)]
    if given:
        raise click.UsageError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} "
                               f"to {to}; {why}: leave {'it' if len(given) == 1 else 'them'} out")


def _refuse_inapplicable(inputs, input_format, cost_model) -> None:
    """UsageError for an option given where it does nothing: --text-unit without a text input
    (by --input-format, else by the inputs' names), --d-model with --cost-model tokens."""
    from seqpack.pipelines.formats.detect import format_by_name

    if _given("text_unit"):
        formats = [input_format] if input_format else [format_by_name(p) for p in inputs]
        if formats and all(f is not None and f != "text" for f in formats):
            raise click.UsageError(f"--text-unit applies to text inputs; these are "
                                   f"{', '.join(sorted(set(map(str, formats))))}: leave it out")
    if _given("d_model") and cost_model == "tokens":
        raise click.UsageError("--d-model applies to --cost-model attention; leave it out")


def _read_options(input_format, columns, tokenizer, text_unit):
    from seqpack.pipelines.formats.inputs import ReadOptions

    return _usage(ReadOptions, input_format=input_format, column=columns[0],
                  extra_columns=tuple(columns[1:]), tokenizer=tokenizer, text_unit=text_unit)


def _mixture(inputs, mixes, weights, mix_unit, mix_tokens, max_repetition, seed, *,
             allow_duplicates, input_format):
    """The --mix options as an `offline.mixture.MixSpec` (None without --mix)."""
    from seqpack.pipelines.offline.mixture import DEFAULT_MAX_REPETITION, MixSpec

    if not mixes:
        given = [f for f, v in (("--weights", weights), ("--mix-unit", mix_unit),
                               ("--mix-tokens", mix_tokens),
                               ("--max-repetition", max_repetition)) if v is not None]
        if given:
            raise click.UsageError(f"{given[0]} needs --mix NAME=PATH datasets")
        return None
    if inputs:
        raise click.UsageError("give INPUT files or --mix datasets, not both")
    if max_repetition is not None and mix_tokens is None:
        raise click.UsageError("--max-repetition bounds the repetition --mix-tokens asks for; "
                               "without --mix-tokens nothing is repeated: leave it out")
    if weights is None:
        raise click.UsageError("--mix needs --weights, e.g. --weights chat=0.3,math=0.7")
    datasets = []
    for item in mixes:
        name, eq, path = item.partition("=")
        if not eq or not name.strip() or not path:
            raise click.UsageError(f"--mix {item!r} must be NAME=PATH, e.g. --mix chat=data/chat/")
        datasets.append((name.strip(), path))
    names = [n for n, _ in datasets]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice:
        raise click.UsageError(f"--mix {twice}=... is given twice; give each dataset once (a "
                               "directory or a quoted glob for many files)")
    # every file once over all datasets (a file in two is a duplicate), then each dataset's
    _expand(tuple(p for _, p in datasets), allow_duplicates=allow_duplicates,
            input_format=input_format)
    expanded = [_expand((p,), allow_duplicates=True, input_format=input_format)
                for _, p in datasets]
    return _usage(MixSpec, list(zip(names, expanded)), weights, mix_unit=mix_unit or "tokens",
                  mix_tokens=mix_tokens, seed=seed,
                  max_repetition=DEFAULT_MAX_REPETITION if max_repetition is None
                  else max_repetition)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="seqpack")
def seqpack() -> None:
    """Pack variable-length token sequences into fixed-size rows, offline, and check them.

    \b
    Exit codes: 0 ok; 1 verify found violations; 2 bad input, a bad option, a missing
    extra or a fault of the system (a full disk, a killed worker; one `Error:` line naming the
    file and the next step); 130 interrupted, 143 terminated by SIGTERM (an interrupted pack
    names its --resume command); 141 stdout's reader went away.
    """


def main(args: list[str] | None = None) -> None:
    """The `seqpack` console script: SIGINT and SIGTERM end a command with its one message."""
    handle_signals()
    show_warnings()
    seqpack.main(args=args, prog_name="seqpack")


@seqpack.command()
@click.argument("inputs", nargs=-1, type=click.Path())  # directories: expand_inputs
@PACK_OPTIONS
def pack(inputs, output_dir, strategy, seq_len, max_segments, overflow, segment_alignment,
         context_parallel, pad_id, feature, input_format, columns, tokenizer, text_unit,
         shard_rows, compression, resume, overwrite, fsync, row_order, seed, data_parallel,
         batch_size, cost_model, d_model, as_json, workers, block_size, runner, beam_options,
         spark_options, pads, roles, allow_duplicates, output_format, mixes, weights, mix_unit,
         mix_tokens, max_repetition, dry_run):
    """Pack INPUT files (JSONL, Parquet, ArrayRecord, text) into shards (--format).

    INPUT may be files, directories (every file of a known format, sorted; hidden files left
    out, any other file left out named on stderr) and local or URL globs (gs://, s3://, ...;
    URLs need seqpack[cloud]); quote globs.

    With no INPUT, packs the built-in sample corpus: the top-level .py files of this Python's
    standard library, byte-tokenized, one example per paragraph (no download).
    """
    from seqpack.pipelines.console import terminal_progress
    from seqpack.pipelines.formats.inputs import sample_files
    from seqpack.pipelines.offline import PackJob, WriteOptions
    from seqpack.pipelines.offline import pack as run
    from seqpack.pipelines.offline.report import format_pack, pack_dry_run

    sample = not inputs and not mixes
    mixture = _mixture(inputs, mixes, weights, mix_unit, mix_tokens, max_repetition, seed,
                       allow_duplicates=allow_duplicates, input_format=input_format)
    inputs = mixture.inputs if mixture else _expand(inputs, allow_duplicates=allow_duplicates,
                                                    input_format=input_format)
    _refuse_inapplicable(inputs, input_format, cost_model)
    _refuse_overflow_for_concat_split([strategy], overflow)
    if dry_run:
        _refuse_given("--dry-run writes nothing", to="a run that writes",
                      among=("resume", "overwrite", "fsync"))
    if sample:
        import tempfile

        inputs = sample_files()
        input_format, tokenizer, text_unit = "text", None, "paragraph"
        overflow = overflow or (None if strategy == "concat_split" else "split")
        output_dir = output_dir or ("" if dry_run else tempfile.mkdtemp(prefix="seqpack-sample-"))
    elif output_dir is None and not dry_run:
        raise click.UsageError("-o/--output is required when INPUT files are given")
    if resume and overwrite:
        raise click.UsageError("pass either --overwrite or --resume, not both")
    config = _config(strategy, seq_len, max_segments, overflow, segment_alignment, pad_id,
                     _feature(feature, columns, tokenizer), context_parallel)
    job = _usage(PackJob, inputs, output_dir or "", config,
                 read_options=_read_options(input_format, columns, tokenizer, text_unit),
                 write_options=_usage(WriteOptions, shard_rows=shard_rows,
                                      compression=compression, fsync=fsync,
                                      format=output_format),
                 block_size=block_size, workers=workers,
                 existing="resume" if resume else "overwrite" if overwrite else "refuse",
                 pads=pads, roles=roles,
                 order=_row_order(row_order, seed, data_parallel, batch_size, cost_model,
                                  d_model, mixed=mixture is not None), mixture=mixture)
    progress = terminal_progress() if runner != "beam" else None
    what = "the built-in sample (Python stdlib sources, bytes)" if sample else \
        f"{len(inputs)} input file(s)"
    step = data_parallel * (batch_size or 1) if data_parallel else batch_size
    if dry_run:
        with progress or contextlib.nullcontext():
            result = pack_dry_run(job, what=what, batch_size=step, progress=progress,
                                  runner=runner, beam_options=beam_options,
                                  spark_options=spark_options,
                                  quiet=not os.environ.get("SEQPACK_DEBUG"))
        click.echo(json.dumps({"dry_run": True, **result.to_dict()}, indent=2) if as_json
                   else result.table())
        return
    with progress or contextlib.nullcontext():
        manifest = run(job, runner=runner, progress=progress, beam_options=beam_options,
                       spark_options=spark_options, quiet=not os.environ.get("SEQPACK_DEBUG"))
    if as_json:
        click.echo(json.dumps({"output_dir": output_dir, "stats": manifest.stats}, indent=2))
        return
    click.echo(format_pack(manifest, output_dir, what=what, batch_size=step))


@seqpack.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path())
@STATS_OPTIONS
def stats(paths, strategies, seq_len, max_segments, overflow, segment_alignment,
          context_parallel, pad_id, feature,
          input_format, columns, tokenizer, text_unit, batch_size, as_json, plot,
          allow_duplicates, workers, block_size, cost_model, d_model):
    """Packing statistics of a packed directory, or a dry run on raw input files.

    For a directory written by `seqpack pack`, reads its manifest (packing options given are
    refused: the manifest says how it was packed). For raw inputs, plans the packing on the
    example lengths (nothing is written) with each strategy and the given options. One run's
    own figures before it runs (a mixture, --data-parallel): `seqpack pack ... --dry-run`.
    """
    from seqpack.pipelines.offline.report import (
        STRATEGIES,
        dry_run_stats,
        is_packed,
        output_stats,
        plot_stats,
    )

    if plot and os.path.splitext(plot)[1].lower() not in (".png", ".pdf", ".svg"):
        raise click.UsageError(f"--plot {plot}: name a .png, .pdf or .svg file")
    paths = _expand(paths, output_ok=True, allow_duplicates=allow_duplicates,
                    input_format=input_format)
    if len(paths) == 1 and is_packed(paths[0]):
        _refuse_given(f"{paths[0]} is a packed output (its manifest says how it was packed)",
                      keep=("paths", "batch_size", "as_json", "plot"))
        result = output_stats(paths[0], batch_size=batch_size)
    else:
        from seqpack.packer.order import CostModel
        from seqpack.pipelines.offline import default_workers

        _refuse_inapplicable(paths, input_format, cost_model)
        _refuse_overflow_for_concat_split(strategies, overflow)
        config = _config("best_fit_decreasing", seq_len, max_segments, overflow,
                         segment_alignment, pad_id, _feature(feature, columns, tokenizer),
                         context_parallel)
        result = dry_run_stats(
            paths, _read_options(input_format, columns, tokenizer, text_unit), config,
            strategies or STRATEGIES, workers=workers or default_workers(),
            block_size=block_size, cost=_usage(CostModel, kind=cost_model, d_model=d_model),
            batch_size=batch_size)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        click.echo(result.table())
    if plot:  # after the figures: a plot that fails loses nothing
        os.makedirs(os.path.dirname(os.path.abspath(plot)), exist_ok=True)
        plot_stats(plot, result.length_histogram, result.per_strategy, title=result.title)
        if not as_json:
            click.echo(f"\nplots written to {plot}")


@seqpack.command()
@click.argument("output_dir", type=click.Path())
@click.argument("inputs", nargs=-1, type=click.Path())
@click.option("--max-violations", default=20, show_default=True, type=click.IntRange(min=1),
              help="Stop listing after this many violations.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Processes that read the inputs and check shards (with --runner beam: the "
                   "DirectRunner's direct_num_workers).  [default: the CPU count]")
@click.option("--runner", type=click.Choice(["local", "beam", "spark"]), default="local",
              show_default=True,
              help="local: this machine (a spill of every input on its disk). beam, spark: as "
                   "an Apache Beam or Spark job, the same report (each worker holds one input "
                   "or one shard; needs seqpack[beam] or seqpack[spark]).")
@click.option("--beam-option", "beam_options", multiple=True, metavar="KEY=VALUE",
              help="A Beam pipeline option for --runner beam (repeatable), e.g. "
                   "runner=DataflowRunner.")
@click.option("--spark-option", "spark_options", multiple=True, metavar="KEY=VALUE",
              help="For --runner spark (repeatable): master=URL or a Spark property.")
def verify(output_dir, inputs, max_violations, as_json, workers, runner, beam_options,
           spark_options):
    """Prove OUTPUT_DIR lossless against its INPUT files (default: the manifest's paths).

    Every input token must appear exactly once, in order within its segment, or be counted as
    truncated / dropped by the manifest; every row must satisfy the row contract. Exits with 1
    and lists the first violations otherwise.
    """
    from seqpack.pipelines.offline import default_workers

    # (a repeat is checked against the manifest's inputs, which may hold one)
    paths, quiet = _expand(inputs, allow_duplicates=True), not os.environ.get("SEQPACK_DEBUG")
    for given, flag in ((beam_options, "beam"), (spark_options, "spark")):
        if given and runner != flag:
            raise click.UsageError(f"--{flag}-option is for --runner {flag}")
    if runner == "local":
        from seqpack.pipelines.offline.verify import verify as run_verify

        report = run_verify(output_dir, paths, max_violations=max_violations,
                            workers=workers or default_workers())
    else:
        from seqpack.pipelines.offline import runners

        options = {"beam_options": beam_options} if runner == "beam" else \
            {"spark_options": spark_options}
        report = getattr(runners, f"verify_{runner}")(
            output_dir, paths, max_violations=max_violations, workers=workers, quiet=quiet,
            **options)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    elif report.ok:
        repeats = f" ({report.repeats:,} repeats of the mixture among them)" \
            if report.repeats else ""
        click.echo(f"OK: {report.num_rows:,} rows, {report.num_examples:,} examples, "
                   f"{report.tokens_checked:,} tokens checked against their sources{repeats}")
    else:
        listed = len(report.violations)
        click.echo(f"FAILED: {report.found} violation(s)" if report.found <= listed else
                   f"FAILED: {report.found} violation(s) found, the first {listed} listed "
                   "(--max-violations; a shard's check stops there, so there may be more)",
                   err=True)
        for v in report.violations:
            click.echo(f"  {v}")
    if not report.ok:
        sys.exit(1)


@seqpack.command()
@click.argument("output_dir", type=click.Path())
@click.option("--row", "row_index", required=True, type=int, help="Row number, from 0; "
              "negative counts from the end (-1: the last row).")
@click.option("--start", default=0, show_default=True, type=click.IntRange(min=0),
              help="First token position shown.")
@click.option("--count", default=None, type=click.IntRange(min=1),
              help="Token positions shown.  [default: to the end of the row]")
@click.option("--width", default=16, show_default=True, type=click.IntRange(min=1),
              help="Token positions per line.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the row's arrays as JSON (token arrays: --start, --count).")
def inspect(output_dir, row_index, start, count, width, as_json):
    """Show one packed row column-aligned: tokens, segment ids, positions, segment metadata."""
    from seqpack.packer.contract import DATASET_ID
    from seqpack.pipelines.offline.report import format_row
    from seqpack.pipelines.offline.verify import read_row

    row, manifest, shard, record = read_row(output_dir, row_index)
    config = manifest.pack_config()
    if start >= config.seq_len:
        raise click.UsageError(f"--start {start} is past the row's {config.seq_len} positions")
    if as_json:  # the [L] arrays cut to the positions asked for, as the table shows them
        L = config.seq_len
        end = L if count is None else min(L, start + count)
        click.echo(json.dumps({k: (v[start:end] if v.shape[0] == L else v).tolist()
                               for k, v in row.items()}))
        return
    index = row_index % manifest.num_rows  # -1: the last row (read_row checked the range)
    click.echo(f"row {index} of {manifest.num_rows:,} ({shard} record {record}): ", nl=False)
    # then the columns the shards hold (a mixture's dataset ids are in the slot table)
    contract = {*config.keys().roles().values(), DATASET_ID}
    click.echo(format_row(row, config, start=start, count=count, width=width,
                          columns=[k for k in row if k not in contract]))


if __name__ == "__main__":
    main()
