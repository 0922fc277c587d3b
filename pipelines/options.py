"""The `seqpack` command's options, in their --help groups (click-option-group).

`PACK_OPTIONS` and `STATS_OPTIONS` decorate `seqpack pack` and `seqpack stats` (cli.py): the
options of each command in groups (inputs, packing, output, order and balance, run,
distributed), in the order --help shows them. Only the command line imports this module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import click
from click_option_group import optgroup

STRATEGIES = ["best_fit_decreasing", "best_fit", "first_fit", "concat_split"]
OVERFLOWS = ["error", "truncate", "split", "drop"]
FORMATS = ["jsonl", "parquet", "arrow", "arrayrecord", "npz", "npy", "megatron", "text",
           "bytes"]  # formats.detect.FORMATS
OUTPUT_FORMATS = ["arrayrecord", "parquet", "hf", "megatron", "index"]  # encodings.FORMATS
Spec = tuple[tuple[str, ...], dict]  # an option's declarations and attributes: `_opt`



def _opt(*decls: str, **attrs) -> Spec:
    """An option's declarations and attributes, for `_group`."""
    return decls, attrs


def _group(title: str, *specs: Spec, help: str | None = None) -> Callable[[Callable], Callable]:
    """One decorator for a group of options, under `title` in --help, in the order given."""

    def apply(f: Callable) -> Callable:
        for decls, attrs in reversed(specs):
            f = optgroup.option(*decls, **attrs)(f)
        return optgroup.group(title, help=help)(f)

    return apply


def _groups(*groups: Callable[[Callable], Callable]) -> Callable[[Callable], Callable]:
    """The option groups of one command, in --help in the order given."""
    return lambda f: functools.reduce(lambda g, group: group(g), reversed(groups), f)


_PAIRS = {int: ("INTEGER", "labels=-100"), str: ("ROLE", "labels=mask"),
          float: ("NUMBER", "chat=0.3,math=0.7")}


def _pairs(kind: type, *, sep: str | None = None) -> Callable:
    """An option's callback: its NAME=VALUE items (the option repeated, or `sep` between them
    in one value) as {name: value of `kind`}; None where the option is not given."""

    def parse(ctx: click.Context, param: click.Parameter, given: object) -> dict | None:
        if given is None:
            return None
        what, example = _PAIRS[kind]
        option, out = param.opts[0], {}
        for item in given.split(sep) if isinstance(given, str) else given:  # type: ignore
            name, eq, value = item.partition("=")
            name = name.strip()
            try:
                parsed = kind(value)
            except ValueError:
                eq = ""
            if not eq or not name or not value:
                raise click.UsageError(f"{option} {item!r} must be NAME={what}, e.g. {option} "
                                       f"{example}")
            if name in out:
                raise click.UsageError(f"{option} gives {name!r} twice")
            out[name] = parsed
        return out

    return parse


def _workers(text: str) -> Spec:
    return _opt("--workers", type=click.IntRange(min=1), help=f"{text}  [default: the CPU count]")


def _block_size(text: str) -> Spec:
    return _opt("--block-size", type=click.IntRange(min=1), help=f"{text}  [default: 4194304]")


_INPUT_FORMAT = _opt(
    "--input-format", type=click.Choice(FORMATS), default=None,
    help="Input file format (bytes: any file's raw bytes as ids 0..255); in a directory, also "
         "which of its files to read.  [default: from the name, else from the content; "
         "refused otherwise]")
_COLUMN = _opt(
    "--column", "--field", "columns", multiple=True, default=["tokens"], show_default=True,
    help="Parquet column / JSONL field / ArrayRecord array of token ids (of text, with "
         "--tokenizer). Repeat it for columns packed with the tokens under the same segments "
         "(any integers: labels, masks), e.g. --column input_ids --column labels.")
_TOKENIZER = _opt(
    "--tokenizer", type=click.Path(dir_okay=False), default=None,
    help="tokenizers tokenizer.json: tokenizes text files and the text --field of JSONL / "
         "--column of Parquet (default: text files as UTF-8 bytes). Its padding and truncation "
         "are switched off: rows are padded by packing, long examples follow --overflow. An "
         "error with token-id inputs.")
_TEXT_UNIT = _opt(
    "--text-unit", type=click.Choice(["file", "line", "paragraph"]), default="file",
    show_default=True,
    help="Text inputs: one example per file, non-blank line or paragraph (lines between blank "
         "lines; the built-in sample's unit).")
_SHAPE = (
    _opt("--seq-len", default=2048, show_default=True, type=click.IntRange(min=1),
         help="Tokens per packed row (L)."),
    _opt("--max-segments", default=64, show_default=True, type=click.IntRange(min=1),
         help="Most segments one row may hold (S)."),
    _opt("--overflow", type=click.Choice(OVERFLOWS), default=None,
         help="Examples longer than --seq-len (not with --strategy concat_split, which cuts "
              "examples at row ends itself).  [default: error; split for the built-in sample]"),
    _opt("--segment-alignment", default=1, show_default=True, type=click.IntRange(min=1),
         help="Segments start at multiples of this."),
    _opt("--context-parallel", type=click.IntRange(min=1), default=None, metavar="C",
         help="Rows split over C context-parallel ranks: every segment starts at a multiple "
              "of 2C and takes a multiple of 2C tokens (the rest padding), as "
              "TransformerEngine's load-balanced layout needs; recorded in the manifest."),
    _opt("--pad-id", default=0, show_default=True, type=click.IntRange(min=0),
         help="Token id written into padding."),
    _opt("--feature", default=None,
         help="Row key of the packed tokens (prefixes the segment keys).  [default: the first "
              "--column's name (tokens when it is tokenized text or not a name)]"),
)
_COST = (
    _opt("--cost-model", type=click.Choice(["attention", "tokens"]), default="attention",
         show_default=True,
         help="A row's work: per segment c(l) = l (1 + l / k) with k = 12 * --d-model (dense "
              "layers + causal attention), or its tokens."),
    _opt("--d-model", default=4096, show_default=True, type=click.IntRange(min=1),
         help="The model's width, for --cost-model attention."),
)

PACK_OPTIONS = _groups(
    _group("Inputs", _INPUT_FORMAT, _COLUMN, _TOKENIZER, _TEXT_UNIT, _opt(
        "--allow-duplicates", is_flag=True,
        help="Pack an input given twice (or through a link) twice, instead of refusing.")),
    _group("Mixture", _opt(
        "--mix", "mixes", multiple=True, metavar="NAME=PATH",
        help="A dataset of a mixture (repeatable; instead of INPUT): its name and its files (a "
             "file, a directory or a quoted glob). Rows carry segment_dataset_id. "
             "docs/offline.md#mixtures"), _opt(
        "--weights", default=None, metavar="NAME=W,...", callback=_pairs(float, sep=","),
        help="Each --mix dataset's weight, e.g. chat=0.3,math=0.7 (normalized)."), _opt(
        "--mix-unit", type=click.Choice(["tokens", "loss_tokens", "examples"]), default=None,
        help="What the weights share: tokens, loss tokens (labels other than -100 and masks "
             "other than 0 of the --column's) or examples.  [default: tokens]"), _opt(
        "--mix-tokens", type=click.IntRange(min=1), default=None, metavar="N",
        help="The mixture's size in --mix-unit units; datasets are repeated (whole epochs, then "
             "a seeded sample) to reach it.  [default: the largest mixture with no repetition]"),
        _opt("--max-repetition", type=click.FloatRange(min=1), default=None, metavar="R",
             help="With --mix-tokens: the most times a dataset may be repeated; past it the run "
                  "is refused.  [default: 4]")),
    _group("Packing", _opt("--strategy", type=click.Choice(STRATEGIES),
                           default="best_fit_decreasing", show_default=True), *_SHAPE, _opt(
        "--pad", "pads", multiple=True, metavar="NAME=VALUE", callback=_pairs(int),
        help="Padding of an extra --column (repeatable), e.g. mask=0.  [default: -100 for "
             "labels, 0 for the others]"), _opt(
        "--role", "roles", multiple=True, metavar="NAME=ROLE", callback=_pairs(str),
        help="What an extra --column means for the loss (repeatable): labels (-100 takes no "
             "loss), mask (0 takes no loss) or values; recorded in the manifest for the "
             "training pipeline.  [default: from the name: *labels, *mask*, else values]")),
    _group("Output", _opt(
        "-o", "--output", "output_dir", type=click.Path(file_okay=False), default=None,
        help="Output directory, or a gs:// / s3:// prefix (seqpack[cloud]).  [required with "
             "INPUT; default: a new temporary directory for the built-in sample]"), _opt(
        "--format", "output_format", type=click.Choice(OUTPUT_FORMATS), default="arrayrecord",
        show_default=True,
        help="Shard files: arrayrecord (SQP1 records; seqpack's Grain source), parquet (the row "
             "contract as columns: pyarrow, pandas, HF datasets, DuckDB, Spark), hf (TRL's "
             "padding-free rows: input_ids, labels, seq_lengths, position_ids), megatron "
             "(Megatron-Bridge's packed SFT *.idx.parquet + metadata) or index (rows by "
             "reference into the inputs, no second copy of the tokens: Parquet, Arrow or "
             "ArrayRecord inputs). docs/formats.md"), _opt(
        "--shard-rows", default=1024, show_default=True, type=click.IntRange(min=1),
        help="Packed rows per shard."), _opt(
        "--compression", type=click.Choice(["none", "snappy", "zstd"]), default="none",
        show_default=True, help="Shard compression (ArrayRecord chunks, Parquet pages)."), _opt(
        "--resume", is_flag=True, help="Finish an interrupted run into OUTPUT."), _opt(
        "--overwrite", is_flag=True, help="Replace an existing OUTPUT."), _opt(
        "--fsync", is_flag=True, help="fsync each shard before it is renamed complete."), _opt(
        "--json", "as_json", is_flag=True, help="Print the manifest's stats as JSON.")),
    _group("Order and balance", _opt(
        "--row-order", type=click.Choice(["shuffle", "plan"]), default="shuffle",
        show_default=True,
        help="Order of the rows: a seeded shuffle (every shard and range of rows holds the same "
             "mix of long and short examples), or the planner's (longest first)."), _opt(
        "--seed", default=0, show_default=True, type=click.IntRange(min=0),
        help="Seed of the row order."), _opt(
        "--data-parallel", type=click.IntRange(min=1), default=None, metavar="D",
        help="Balance steps for D data-parallel ranks: rank r of step s reads rows [(s*D + r)*b, "
             "(s*D + r + 1)*b) with b = --batch-size, and the D ranks of every step carry "
             "near-equal cost (--cost-model); steps in a seeded order."), _opt(
        "--batch-size", default=None, type=click.IntRange(min=1),
        help="Rows per rank per step with --data-parallel (default 1); with --mix, the rows "
             "of a step, each step holding the weights (balanced steps of one rank); "
             "otherwise the batch of the steps-per-epoch figure (none without it)."), *_COST),
    _group("Run", _workers("Processes that read inputs, plan blocks and write shards (with "
                           "--runner beam: the DirectRunner's direct_num_workers); the output "
                           "is the same for any number."),
           _block_size("Examples planned together; larger corpora are planned per block of "
                       "consecutive examples (bounded memory, a few rows more)."), _opt(
        "--dry-run", is_flag=True,
        help="Plan the run and print what it would pack (the stats, static shapes, the "
             "order's balance, a mixture's shares per step) without writing anything: every "
             "input is read and checked as by a run, in --workers processes or on --runner's "
             "workers.")),
    _group("Distributed", _opt(
        "--runner", type=click.Choice(["local", "beam", "spark"]), default="local",
        show_default=True,
        help="local: in this process. beam: as an Apache Beam job, same output (DirectRunner, "
             "one process per CPU, by default; needs seqpack[beam]). spark: as an Apache Spark "
             "job, same output (local[--workers] by default; needs seqpack[spark])."), _opt(
        "--beam-option", "beam_options", multiple=True, metavar="KEY=VALUE",
        help="A Beam pipeline option for --runner beam (repeatable), e.g. direct_num_workers=4 "
             "or runner=FlinkRunner."), _opt(
        "--spark-option", "spark_options", multiple=True, metavar="KEY=VALUE",
        help="For --runner spark (repeatable): master=URL (e.g. spark://host:7077) or a Spark "
             "property, e.g. spark.executor.memory=4g.")),
)

STATS_OPTIONS = _groups(
    _group("Inputs (a dry run)", _INPUT_FORMAT, _COLUMN, _TOKENIZER, _TEXT_UNIT, _opt(
        "--allow-duplicates", is_flag=True, help="Count an input given twice twice.")),
    _group("Packing (a dry run)", _opt(
        "--strategy", "strategies", type=click.Choice(STRATEGIES), multiple=True,
        help="Strategies to compare (repeatable).  [default: all four]"), *_SHAPE),
    _group("Report", _opt(
        "--batch-size", default=None, type=click.IntRange(min=1),
        help="Batch size for the steps-per-epoch figure.  [default: a balanced output's step, "
             "else none]"), _opt(
        "--json", "as_json", is_flag=True, help="Print JSON instead of a table."), _opt(
        "--plot", type=click.Path(dir_okay=False), default=None,
        help="Write histograms (example lengths, row fill, segments per row) to this PNG."),
        *_COST),
    _group("Run", _workers("Dry run: processes that read the inputs and plan (every "
                           "strategy's blocks side by side); the figures are the same for any "
                           "number."),
           _block_size("Dry run: examples planned together, as `seqpack pack --block-size`.")),
)
