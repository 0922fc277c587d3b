"""What the CLI shows: packing statistics (`output_stats` of a packed directory, `dry_run_stats`
of raw inputs: `Stats`), what a pack run prints (`format_pack`) and what it would
(`pack_dry_run`: its plan alone), plots, a row.

Stats table (one column per strategy in a dry run; with a batch size, steps = rows // batch
size: a last, short batch is not a step, as the training pipeline drops it)::

                          best_fit_decreasing
    rows                                5,695
    lower bound                         5,693
    rows over bound                     0.04%
    efficiency                         99.96%
    ...

`format_row` prints one packed row column-aligned (a line per array, a column per position),
the way the packer's docstrings do.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from seqpack.packer import PackConfig
from seqpack.packer.config import Overflow, Strategy
from seqpack.packer.contract import DATASET_ID, SOURCE_START
from seqpack.packer.mixing import row_units
from seqpack.packer.order import CostModel
from seqpack.packer.plan import MapBlocks, check_block_size, pieces, plan_rows_many
from seqpack.packer.stats import stats_of_pieces
from seqpack.pipelines import storage
from seqpack.pipelines.errors import require
from seqpack.pipelines.formats.inputs import ReadOptions
from seqpack.pipelines.formats.manifest import MANIFEST, Manifest, read_manifest
from seqpack.pipelines.offline import mixture, record
from seqpack.pipelines.offline.job import PackJob
from seqpack.pipelines.offline.record import (
    check_empty,
    check_overlength,
    first_overlength,
    length_histogram,
)
from seqpack.pipelines.offline.shards import read_shard

if TYPE_CHECKING:
    from seqpack.pipelines.offline.runners import Progress

STRATEGIES = tuple(s.value for s in Strategy)
_PARALLEL_PLAN = 1 << 18  # examples times strategies a dry run plans in worker processes from


def dry_run(lengths: np.ndarray, config: PackConfig, strategies: Sequence[str], *,
            block_size: int | None = None, cost: CostModel | None = None,
            map_blocks: MapBlocks | None = None) -> dict[str, dict]:
    """strategy -> `PackingStats.to_dict()` of planning `lengths` with config + that strategy
    (`plan_rows`, as `seqpack pack` plans: a few bytes per example), with the rows' costs
    under `cost` (default `CostModel()`). `map_blocks`: as `plan_rows`' (every strategy's
    blocks through it: `dry_run_inputs`)."""
    configs = [dataclasses.replace(config, strategy=name) for name in strategies]
    out = {}
    for name, cfg, a in zip(strategies, configs, plan_rows_many(
            lengths, configs, block_size=block_size, map_blocks=map_blocks)):
        length = np.concatenate([n for _, _, n in pieces(lengths, cfg, block_size=a.block_size)])
        out[name] = stats_of_pieces(a.row, length, a.num_rows, cfg.seq_len, cfg.max_segments,
                                    a.counters, cost=cost or CostModel(),
                                    alignment=cfg.alignment).to_dict()
    return out


def dry_run_inputs(paths: Sequence[str], options: ReadOptions, config: PackConfig,
                   strategies: Sequence[str], *, workers: int, block_size: int | None = None,
                   cost: CostModel | None = None) -> tuple[np.ndarray, dict[str, dict]]:
    """(the inputs' example lengths, `dry_run` of them), with `workers` processes: the inputs
    scanned in parallel (`runners.scan_lengths`; in this process where they are small), then
    every strategy's blocks planned side by side, as many at once as the memory available
    holds (`runners.plan_map`), where the plans hold at least `_PARALLEL_PLAN` examples in all
    (below that, starting the processes costs more than they save). The same figures for any
    number of workers."""
    from seqpack.pipelines.offline.runners import Workers, plan_map, scan_lengths

    pool = Workers(workers, retry="pass fewer workers= if memory is short")
    try:
        per_input = scan_lengths(paths, options, pool)
        check_empty([os.fspath(p) for p in paths], [x.size for x in per_input],
                    [int(x.sum()) for x in per_input])
        _check_overlength(paths, per_input, config, strategies)
        lengths = np.concatenate(per_input)
        del per_input
        big = lengths.size * len(strategies) >= _PARALLEL_PLAN
        per_strategy = dry_run(lengths, config, strategies, block_size=block_size, cost=cost,
                               map_blocks=plan_map(pool, check_block_size(block_size),
                                                   lengths.size) if big else None)
    except BaseException:
        pool.close(kill=True)
        raise
    pool.close()
    return lengths, per_strategy


def _check_overlength(paths: Sequence[str], per_input: Sequence[np.ndarray], config: PackConfig,
                      strategies: Sequence[str]) -> None:
    """The error `seqpack pack` gives (naming the file and the record) where overflow is
    "error" and a strategy other than concat_split would meet an over-length example
    (`per_input`: each input's example lengths)."""
    refusing = [name for name in strategies if Strategy(name) is not Strategy.CONCAT_SPLIT]
    if not refusing:
        return
    cfg = dataclasses.replace(config, strategy=refusing[0])
    check_overlength(paths, [first_overlength(lengths, cfg) for lengths in per_input], cfg)


@dataclasses.dataclass(frozen=True)
class Stats:
    """What `seqpack stats` shows: each strategy's `PackingStats.to_dict()`, the histogram of the
    example lengths, a title, the rows of a step the steps-per-epoch figure counts, and for a
    packed output the static shapes its manifest records (`Manifest.shapes`)."""

    per_strategy: dict[str, dict]
    length_histogram: dict
    title: str
    batch_size: int | None = None
    shapes: dict | None = None
    mixture: dict | None = None  # a mixed output's datasets and shares (`mixture.shares`)

    def summaries(self) -> dict[str, dict]:
        return {name: summary(s, self.batch_size) for name, s in self.per_strategy.items()}

    def to_dict(self) -> dict:
        shapes = {"shapes": self.shapes} if self.shapes else {}
        mixed = {"mixture": self.mixture} if self.mixture else {}
        return {"summary": self.summaries(), "stats": self.per_strategy,
                "example_length_histogram": self.length_histogram, **shapes, **mixed}

    def table(self) -> str:
        table = format_table(self.summaries(), self.title)
        if self.shapes:
            shown = ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in self.shapes.items())
            table += f"\nstatic shapes (what a trainer sizes by): {shown}"
        return table + (f"\n\n{mixture.table(self.mixture)}" if self.mixture else "")


def is_packed(path: str) -> bool:
    """A directory, or a URL prefix holding manifest.json (a packed output on object storage)."""
    if "://" not in path:
        return os.path.isdir(path)
    return storage.exists(storage.join(path, MANIFEST))


def output_stats(output_dir: str, *, batch_size: int | None = None) -> Stats:
    """The statistics a packed output's manifest records; steps of `batch_size` rows (default:
    a balanced output's step, D ranks x b rows; else no steps)."""
    manifest = read_manifest(output_dir)
    stats, lengths = manifest.stats, manifest.example_length_histogram
    assert stats is not None and lengths is not None  # read_manifest: a complete output's
    order = manifest.row_order or {}
    if order.get("mode") == "balanced" and batch_size is None:
        batch_size = int(order["data_parallel"]) * int(order["batch_size"])
    config = manifest.pack_config()
    return Stats({Strategy(config.strategy).value: stats}, lengths,
                 f"packed: {output_dir} (seq_len {config.seq_len}, max_segments "
                 f"{config.max_segments}, format {manifest.encoding or 'arrayrecord'})",
                 batch_size, manifest.shapes, _mixture(output_dir, manifest, batch_size))


def _mixture(output_dir: str, manifest: Manifest, batch_size: int | None) -> dict | None:
    """A mixed output's `mixture.shares`, from its rows' `[S]` metadata (one pass over the
    shards); None without a mixture."""
    if not manifest.mixture:
        return None
    keys, K = manifest.pack_config().keys(), len(manifest.mixture["datasets"])
    rows = (read_shard(output_dir, name, n, restore=False, manifest=manifest)
            for name, n in zip(manifest.shards, manifest.shard_num_rows or []))
    tokens = [row_units("tokens", r[DATASET_ID], r[keys.segment_lengths], r[SOURCE_START],
                        num_datasets=K) for r in rows]
    return mixture.shares(manifest.mixture, np.concatenate(tokens), batch_size)


def dry_run_stats(paths: Sequence[str], options: ReadOptions, config: PackConfig,
                  strategies: Sequence[str], *, workers: int, block_size: int | None = None,
                  cost: CostModel | None = None, batch_size: int | None = None) -> Stats:
    """`dry_run_inputs` as `Stats`: nothing is written; steps of `batch_size` rows (None: no
    steps)."""
    lengths, per_strategy = dry_run_inputs(paths, options, config, strategies, workers=workers,
                                           block_size=block_size, cost=cost)
    title = (f"dry run: {_named(paths)}, seq_len {config.seq_len}, max_segments "
             f"{config.max_segments}, overflow {Overflow(config.overflow).value}")
    if Strategy.CONCAT_SPLIT.value in strategies:
        title += " (concat_split cuts examples at row ends itself: overflow does not apply)"
    if any(not s["num_rows"] for n, s in per_strategy.items() if n != "concat_split"):
        title += "\nwarning: overflow drop drops every example (each is over seq_len)"
    return Stats(per_strategy, length_histogram(lengths), title, batch_size)


def _named(paths: Sequence[str]) -> str:
    """The inputs in a few words: the file, or how many and the first."""
    if len(paths) == 1:
        return paths[0]
    return f"{len(paths)} input files ({paths[0]}, ...)"


def format_pack(manifest: Manifest, output_dir: str, *, what: str,
                batch_size: int | None = None) -> str:
    """What `seqpack pack` prints: the run in a line (`what`: its inputs), the row keys and what
    each extra column was padded with, then the stats table of its strategy (with steps of
    `batch_size` rows where one is given)."""
    assert manifest.stats is not None  # a complete output's
    mixed = f"\n\n{mixture.table(manifest.mixture)}" if manifest.mixture else ""
    name = Strategy(manifest.pack_config().strategy).value
    return (_run_lines(manifest, output_dir, what=what, verb="packed") + "\n\n"
            + format_table({name: summary(manifest.stats, batch_size)}) + mixed)


def _run_lines(manifest: Manifest, output_dir: str, *, what: str, verb: str) -> str:
    """A run in two lines: its inputs, examples, rows and shards, then the rows' keys and each
    extra column's role and pad."""
    config = manifest.pack_config()
    keys = f"rows of {config.seq_len} tokens, key {config.feature!r}"
    if config.context_parallel is not None:
        keys += (f", for {config.context_parallel} context-parallel ranks (segments start and "
                 f"span multiples of {config.alignment} tokens; the rest is padding)")
    for c in manifest.columns or []:
        keys += f", column {c['name']!r} ({c.get('role', 'values')}, padded with {c['pad']})"
    taken = ((manifest.stats or {}).get("counters") or {}).get("num_examples")
    examples = f"{manifest.inputs['num_examples']:,} examples" + (
        f" ({taken:,} taken by the mixture)" if manifest.mixture and taken is not None else "")
    where = f" at {output_dir}" if output_dir else ""
    return (f"{verb} {what}: {examples} -> {manifest.num_rows:,} rows in "
            f"{len(manifest.shards)} shard(s){where}\n{keys}")


def pack_dry_run(job: PackJob, *, what: str, batch_size: int | None = None,
                 progress: Progress | None = None, runner: str = "local",
                 beam_options: Sequence[str] = (), spark_options: Sequence[str] = (),
                 quiet: bool = True) -> Stats:
    """What `pack(job)` would record, from its plan alone (every input read, nothing written;
    on the `runner` with its options, as `offline.pack` runs them): its stats with the output
    order's profile, the static shapes (less `loss_tokens`, counted from the rows' values),
    and a mixture's shares per step of `batch_size` rows (None: per row). `what`: the inputs
    in a few words, for the title."""
    from seqpack.pipelines.offline import check_runner, runners

    check_runner(runner, beam_options, spark_options)
    if runner == "beam":
        intent, results, figures = runners.plan_beam(
            job, batch_size, beam_options=beam_options, quiet=quiet)
    elif runner == "spark":
        intent, results, figures = runners.plan_spark(
            job, batch_size, spark_options=spark_options, quiet=quiet, progress=progress)
    else:
        intent, results, figures = runners.plan_job(job, batch_size, progress=progress)
    R = intent.num_rows
    stats = {**results["stats"], "along_output": record.along_output(figures.profile, R)}
    shares = None
    if intent.mixture and figures.tokens is not None:
        assert figures.steps is not None and figures.step_tokens is not None
        steps = np.zeros((R // (batch_size or 1), figures.tokens.size), np.int64)
        steps[figures.steps] = figures.step_tokens
        shares = mixture.step_shares(intent.mixture, steps, figures.tokens, batch_size)
    title = _run_lines(dataclasses.replace(intent, stats=stats), job.output, what=what,
                       verb="dry run (nothing written): would pack")
    return Stats({Strategy(job.config.strategy).value: stats}, results["example_length_histogram"],
                 title, batch_size, results["shapes"], shares)


def summary(s: dict, batch_size: int | None) -> dict:
    """The table's figures for one `PackingStats` dict."""
    spr = np.asarray(s["segments_per_row"])
    rows = s["num_rows"]
    c = s["counters"]
    return {
        "rows": rows,
        "lower_bound_rows": s["lower_bound_rows"],
        "rows_over_lower_bound": s["rows_over_lower_bound"],
        "efficiency": s["efficiency"],
        "padding_fraction": s["padding_fraction"],
        "segments_per_row_mean": float((spr * np.arange(spr.size)).sum() / rows) if rows else 0.0,
        "segments_per_row_max": int(np.flatnonzero(spr)[-1]) if spr.any() else 0,
        "row_fill_p10": s["row_fill_quantiles"]["p10"],
        "real_tokens": s["real_tokens"],
        "truncated_tokens": c["truncated_tokens"],
        "dropped_tokens": c["dropped_tokens"],
        "split_examples": c["split_examples"],
        "split_pieces": c["split_pieces"],
        "examples": c["num_examples"],
        "batch_size": batch_size,
        "steps_per_epoch": rows // batch_size if batch_size else None,
        "rows_left_per_epoch": rows % batch_size if batch_size else None,
        # attention over the segments against attention over whole rows (sum l^2 / L^2)
        "attention_fraction": s.get("attention_fraction"),
        "row_attention_p50": (s.get("row_attention_quantiles") or {}).get("p50"),
        "row_cost_max_over_mean": s.get("row_cost_max_over_mean"),
        "row_cost_p50": (s.get("row_cost_quantiles") or {}).get("p50"),
        "along_output": (s.get("along_output") or {}).get("segments_per_row"),
        "step_max_over_mean": _balance(s, "mean"),
        "step_max_over_mean_p99": _balance(s, "p99"),
        "step_random_max_over_mean": _balance(s, "mean", random=True),
        "step_random_max_over_mean_p99": _balance(s, "p99", random=True),
        "step_segments_spread": _spread(s, "output"),
        "step_random_segments_spread": _spread(s, "random_order"),
    }


def _spread(s: dict, which: str) -> float | None:
    """How much a balanced output's steps' mean segments per row spread (None elsewhere)."""
    got = (s.get("step_balance") or {}).get("segments_per_row_spread")
    return None if got is None else got[which]


def _balance(s: dict, figure: str, *, random: bool = False) -> float | None:
    """A figure of a balanced output's ``step_balance`` (None for other orders)."""
    got = s.get("step_balance")
    if got is None:
        return None
    return (got["random_order"] if random else got)[figure]


_ROWS = [
    ("examples", "examples", "{:,}"),
    ("rows", "rows", "{:,}"),
    ("lower bound", "lower_bound_rows", "{:,}"),
    ("rows over bound", "rows_over_lower_bound", "{:.2%}"),
    ("efficiency", "efficiency", "{:.2%}"),
    ("padding", "padding_fraction", "{:.2%}"),
    ("segments / row", "segments_per_row_mean", "{:.2f}"),
    ("max segments / row", "segments_per_row_max", "{:,}"),
    ("row fill p10", "row_fill_p10", "{:.2%}"),
    ("tokens in rows", "real_tokens", "{:,}"),
    ("truncated tokens", "truncated_tokens", "{:,}"),
    ("dropped tokens", "dropped_tokens", "{:,}"),
    ("split examples", "split_examples", "{:,}"),
    ("pieces of split examples", "split_pieces", "{:,}"),
    ("steps / epoch", "steps_per_epoch", "{:,}"),
    ("  rows left over (not a step)", "rows_left_per_epoch", "{:,}"),
    ("attention vs whole rows", "attention_fraction", "{:.2%}"),
    ("  per row, p50", "row_attention_p50", "{:.1%}"),  # binned by 0.1% of a full row
    ("row cost p50 (token-equivalents)", "row_cost_p50", "~{:,.0f}"),  # binned too
    ("row cost max / mean", "row_cost_max_over_mean", "{:.2f}"),
    ("step: ranks' max / mean", "step_max_over_mean", "{:.3f}"),
    ("  p99", "step_max_over_mean_p99", "{:.3f}"),
    ("  rows in random order", "step_random_max_over_mean", "{:.3f}"),
    ("  rows in random order, p99", "step_random_max_over_mean_p99", "{:.3f}"),
    ("steps' segments / row: spread", "step_segments_spread", "{:.3f}"),
    ("  in a random order", "step_random_segments_spread", "{:.3f}"),
    ("segments / row by tenth", "along_output", "{}"),
]


def _cell(fmt: str, value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return " ".join(f"{v:.1f}" for v in value)
    return fmt.format(value)


def format_table(summaries: dict[str, dict], title: str = "") -> str:
    """Plain aligned text: one column per entry of `summaries` (e.g. per strategy)."""
    names = list(summaries)
    rows = [r for r in _ROWS if any(summaries[n].get(r[1]) is not None for n in names)]
    cells = [[_cell(fmt, summaries[n].get(key)) for n in names] for _, key, fmt in rows]
    labels = [label for label, _, _ in rows]
    batch = {summaries[n]["batch_size"] for n in names}
    if "steps / epoch" in labels:
        at = labels.index("steps / epoch")
        labels[at] += f" (batch {batch.pop()})" if len(batch) == 1 else ""
    w0 = max(map(len, labels))
    widths = [max(len(n), *(len(row[i]) for row in cells)) for i, n in enumerate(names)]
    lines = [title] if title else []
    lines.append(" " * w0 + "".join(f"  {n:>{w}}" for n, w in zip(names, widths)))
    for label, row in zip(labels, cells):
        lines.append(f"{label:<{w0}}" + "".join(f"  {c:>{w}}" for c, w in zip(row, widths)))
    return "\n".join(lines)


def plot_stats(path: str, length_hist: dict, per_strategy: dict[str, dict], *,
               title: str = "") -> None:
    """Writes a PNG: example lengths, row fill, and segments per row histograms, under `title`
    (the data and the row length: `Stats.title`)."""
    require("matplotlib", "plotting").use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    edges = np.asarray(length_hist["edges"])
    axes[0].stairs(length_hist["counts"], edges, fill=True)
    axes[0].set(title="example lengths", xlabel="tokens", ylabel="examples")
    for name, s in per_strategy.items():
        fill = np.asarray(s["row_fill_histogram"])
        axes[1].stairs(fill, np.linspace(0, 1, fill.size + 1), label=name)
        spr = np.asarray(s["segments_per_row"])
        top = min(spr.size, int(np.flatnonzero(spr)[-1]) + 2 if spr.any() else 2)
        axes[2].stairs(spr[:top], np.arange(top + 1) - 0.5, label=name)
    axes[1].set(title="row fill", xlabel="used / seq_len", ylabel="rows", yscale="log")
    axes[2].set(title="segments per row", xlabel="segments", ylabel="rows")
    axes[1].legend(fontsize="small")
    if title:
        fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_row(row: dict[str, np.ndarray], config: PackConfig, *, start: int = 0,
               count: int | None = None, width: int = 16,
               columns: Sequence[str] = ()) -> str:
    """One packed row: the segment table, then positions [start, start + count) in blocks:
    tokens, each extra column (`columns`: labels, masks), segment ids, positions."""
    k = config.keys()
    lens = np.asarray(row[k.segment_lengths])
    used = int((lens > 0).sum())
    L = int(row[k.values].shape[0])
    lines = [f"{used} segments, {int(lens.sum())} of {L} tokens used", ""]
    seg_cols = [("slot", np.arange(lens.size)), (k.segment_lengths, lens),
                (k.segment_offsets, row[k.segment_offsets]),
                (k.source_index, row[k.source_index]),
                (k.source_start, row[k.source_start]),
                *((name, row[name]) for name in [DATASET_ID] if name in row)]
    lines += _block(seg_cols, 0, max(used, 1) if used < lens.size else lens.size, width)
    if used < lens.size:
        lines.append(f"(slots {used}..{lens.size - 1} unused: length 0, offset "
                     f"{int(row[k.segment_offsets][used])}, source -1)")
    lines.append("")
    end = L if count is None else min(L, start + count)
    tok_cols = [("position", np.arange(L)), (k.values, row[k.values]),
                *((name, row[name]) for name in columns),
                (k.segment_ids, row[k.segment_ids]), (k.positions, row[k.positions])]
    lines += _block(tok_cols, max(0, start), end, width)
    return "\n".join(lines).rstrip()


def _block(cols, lo: int, hi: int, width: int) -> list[str]:
    name_w = max(len(name) for name, _ in cols)
    lines = []
    for a in range(lo, hi, width):
        b = min(hi, a + width)
        vals = [[str(int(v)) for v in np.asarray(arr)[a:b]] for _, arr in cols]
        cw = max(len(x) for col in vals for x in col)
        for (name, _), col in zip(cols, vals):
            lines.append(f"{name:<{name_w}}  " + " ".join(f"{x:>{cw}}" for x in col))
        lines.append("")
    return lines
