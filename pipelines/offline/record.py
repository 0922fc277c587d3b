"""The run record: what a run writes about itself (the intent, then the manifest's results).

Both runners build the record with these functions, so their manifests are byte-identical:

    inputs_record     how the inputs were read, each input's manifest entry, totals, token dtype
    run_intent        pack_intent.json: the manifest without its results (config, inputs,
                      writer options, stored keys, shard names, block size, extra columns)
    manifest_results  the results a complete manifest adds: stats, the example length histogram
    check_overlength  with overflow="error", the first over-length example named by its file

Where the record lives and how it is trusted (`--resume`, completion records) is
`offline.outdir`'s business; the manifest type and its checks are `formats.manifest`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping, Sequence

import numpy as np

from seqpack.packer import PackConfig
from seqpack.packer.config import Overflow, Strategy
from seqpack.packer.order import StepBalance
from seqpack.packer.stats import PackingStats
from seqpack.pipelines import storage
from seqpack.pipelines.errors import InputError
from seqpack.pipelines.formats.encodings import DEFAULT, RANDOM_ACCESS
from seqpack.pipelines.formats.inputs import (
    ReadOptions,
    check_text_beside_tokens,
    combined_lengths_sha256,
    first_id_above,
    tokenizer_fingerprint,
    unstamped,
)
from seqpack.pipelines.formats.manifest import Manifest, shard_names
from seqpack.pipelines.offline.job import PackJob
from seqpack.pipelines.offline.shards import row_dtype

log = logging.getLogger("seqpack")

_HIST_BINS = 50


def length_histogram(lengths: np.ndarray, top: int | None = None) -> dict:
    """Example lengths in 50 equal bins over [0, max(top, 1)] (top: the longest example, by
    default of `lengths`): {"edges": [51], "counts": [50]}. Counts of parts of a corpus
    binned with the corpus's `top` add up to the corpus's."""
    if top is None:
        top = int(lengths.max()) if lengths.size else 1
    counts, edges = np.histogram(lengths, bins=_HIST_BINS, range=(0, max(top, 1)))
    return {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts]}


def inputs_record(files: list[dict], dtype: np.dtype, options: ReadOptions) -> dict:
    """The manifest's ``inputs``: how they were read, each input's entry (fingerprint, counts,
    lengths digest), totals, the token dtype."""
    return {
        "read_options": dataclasses.asdict(options),
        "tokenizer": tokenizer_fingerprint(options.tokenizer),
        "files": files,
        "num_examples": sum(int(f["num_examples"]) for f in files),
        "num_tokens": sum(int(f["num_tokens"]) for f in files),
        "token_dtype": np.dtype(dtype).str,
        "lengths_sha256": combined_lengths_sha256(files),
    }


def run_intent(job: PackJob, inputs: dict, num_rows: int,
               columns: list[dict] | None = None, mixture: dict | None = None) -> Manifest:
    """What the run writes (``pack_intent.json``: the manifest without its results);
    `columns`: the extra columns' entries (`column_entries`); `mixture`: a mixture's record
    (`mixture.Selection.record`)."""
    options = job.write_options
    layout = options.layout(job.config, columns or (), mixed=mixture is not None)
    encoding = options.encoding
    inputs = with_stamps(inputs) if encoding.by_reference else without_stamps(inputs)
    return Manifest(
        config=job.config.to_dict(),
        inputs=json.loads(json.dumps(inputs)),
        writer_options=encoding.writer_options(layout),
        stored_keys=encoding.stored_keys(layout),
        shard_rows=options.shard_rows,
        num_rows=num_rows,
        shards=shard_names(num_rows, options.shard_rows, encoding.suffix),
        plan_block_size=job.block_size,
        row_order=job.order.to_dict(),
        columns=columns or None,
        encoding=None if options.format == DEFAULT else options.format,
        mixture=mixture,
    )


def without_stamps(inputs: dict) -> dict:
    """`inputs` without the stamps their scans noted (files' modification stamps, objects'
    versions): a manifest of stored rows depends on the inputs' content alone (a touched
    input resumes)."""
    return {**inputs, "files": [unstamped(f) for f in inputs["files"]]}


def with_stamps(inputs: dict) -> dict:
    """`inputs` with each local file's modification stamp as its scan read it (`mtime_ns`),
    which readers of rows stored by reference check with its size on every open
    (`encodings.check_stamp`; an object keeps its scan's `version`); InputError naming a file
    that changed since its scan, or an input that cannot be read at random
    (`encodings.RANDOM_ACCESS`)."""
    if inputs.get("tokenizer"):
        raise InputError("format='index' reads the inputs' token ids at random; text tokenized "
                         "while packing (tokenizer=) is not stored anywhere: pack it with "
                         "format='arrayrecord'")
    files = []
    for f in inputs["files"]:
        if f.get("format") not in RANDOM_ACCESS:
            raise InputError(f"{f['path']}: a {f.get('format')} input cannot be read at random; "
                             f"format='index' needs inputs in {list(RANDOM_ACCESS)}: pack it "
                             "with format='arrayrecord'")
        if storage.is_url(f["path"]):
            files.append(f)
            continue
        stamped = {**f, "mtime_ns": _stamp(f)}
        if "companion" in f:  # a Megatron .bin's .idx (or the other way round)
            stamped["companion"] = {**f["companion"], "mtime_ns": _stamp(f["companion"])}
        files.append(stamped)
    return {**inputs, "files": files}


def _stamp(entry: dict) -> int:
    """The input's modification stamp as scanned; InputError if its size or stamp is no longer
    the scan's."""
    st = os.stat(entry["path"])
    scanned = int(entry["mtime_ns"])
    if (st.st_size, st.st_mtime_ns) != (int(entry["size"]), scanned):
        raise InputError(f"{entry['path']}: changed while the job ran (read as {entry['size']} "
                         f"bytes stamped {scanned}, now {st.st_size} bytes stamped "
                         f"{st.st_mtime_ns}); rerun on inputs that stay put")
    return scanned


def check_inputs(files: Sequence[tuple[str, str, int]], job: PackJob) -> None:
    """InputError for text among token files (`inputs.check_text_beside_tokens`), and naming
    the first input and example holding a token id the output format cannot store
    (`Encoding.max_token_id`): before anything is written. `files`: each input's (path,
    format, largest id)."""
    check_text_beside_tokens([(path, fmt) for path, fmt, _ in files],
                             tokenized=bool(job.read_options.tokenizer))
    encoding = job.write_options.encoding
    limit = encoding.max_token_id
    if limit is not None and job.config.pad_id > limit:
        raise InputError(f"pad_id={job.config.pad_id} is more than the {encoding.name} format "
                         f"stores ({limit}): pass a smaller one")
    for path, fmt, top in files:
        if limit is not None and top > limit:
            example = first_id_above(path, fmt, job.read_options, limit)
            raise InputError(f"{path}: example {example} (counting from 0) holds token id "
                             f"{top}, more than the {encoding.name} format stores ({limit})")


def column_entries(job: PackJob, dtypes: Mapping[str, np.dtype]) -> list[dict]:
    """The manifest's ``columns``: each extra column's row key, source field / column, rows'
    dtype (the inputs', widened to hold its pad), pad and role, in `--column` order."""
    return [{"name": name, "source": name, "dtype": row_dtype(dtypes[name], pad).str, "pad": pad,
             "role": job.roles[name]} for name, pad in job.pads.items()]


def manifest_results(stats: PackingStats, length_hist: dict, along: dict | None = None,
                     balance: StepBalance | None = None, shapes: dict | None = None) -> dict:
    """The manifest's ``stats`` (with `along`: its ``along_output``; with `balance`, a balanced
    order's: its ``step_balance``), ``example_length_histogram`` and (given) ``shapes``."""
    s = stats.to_dict()
    if balance is not None:  # before along_output, which the Beam job adds last
        s["step_balance"] = balance.to_dict()
    if along is not None:
        s["along_output"] = along
    out = {"stats": s, "example_length_histogram": length_hist}
    if shapes is not None:
        out["shapes"] = shapes
    return json.loads(json.dumps(out))


@dataclasses.dataclass(frozen=True)
class ShardFacts:
    """What the manifest sums over shards: the order profile (`order_profile`) and the loss
    tokens (`encodings.loss_positions`) of a shard's rows; parts add up."""

    profile: np.ndarray  # i64[10, 2]
    loss_tokens: int = 0

    def __add__(self, other: ShardFacts) -> ShardFacts:
        return ShardFacts(self.profile + other.profile, self.loss_tokens + other.loss_tokens)


def min_row_next(row: np.ndarray, length: np.ndarray, num_rows: int) -> int | None:
    """The fewest (tokens - segments) of a row, from its pieces' rows and lengths (None
    without rows): the positions of the row that have a next token in their segment."""
    if not num_rows:
        return None
    per_row = np.zeros(num_rows, np.int64)
    step = 1 << 20  # a million pieces at a time: temporaries stay small
    for a in range(0, len(row), step):
        r, n = np.asarray(row[a : a + step]), np.asarray(length[a : a + step], np.int64)
        per_row += np.bincount(r, weights=n - (n > 0), minlength=num_rows).astype(np.int64)
    return int(per_row.min())


def plan_shapes(used_hist: np.ndarray, nseg_hist: np.ndarray, longest: Sequence[int],
                min_next: Sequence[int | None]) -> dict:
    """The manifest's ``shapes`` known from the plan (`loss_tokens` joins when the shards are
    written): the most segments in a row, the longest segment, the fewest tokens in a row,
    the fewest (tokens - segments) in a row."""
    used, nseg = np.flatnonzero(used_hist), np.flatnonzero(nseg_hist)
    return {"max_row_segments": int(nseg[-1]) if nseg.size else 0,
            "longest_segment": max(longest, default=0),
            "shortest_row": int(used[0]) if used.size else 0,
            "min_row_next_tokens": min((m for m in min_next if m is not None), default=0)}


PROFILE_PARTS = 10  # the output is profiled in tenths


def order_profile(row: np.ndarray, length: np.ndarray, num_rows: int) -> np.ndarray:
    """i64[10, 2]: per tenth of the output rows (row r in tenth r * 10 // R), its segments and
    tokens, from the pieces' output rows and lengths; parts of the output add up.
    Row composition along the output (`along_output` in the stats) shows that an order is
    flat: the planner's puts the longest examples first."""
    row = np.asarray(row, np.int64)
    out = np.zeros((PROFILE_PARTS, 2), np.int64)
    if not num_rows:
        return out
    part = row * PROFILE_PARTS // num_rows
    out[:, 0] = np.bincount(part, minlength=PROFILE_PARTS)
    out[:, 1] = np.bincount(part, weights=np.asarray(length, np.float64),
                            minlength=PROFILE_PARTS).astype(np.int64)
    return out


def profile_rows(num_rows: int) -> np.ndarray:
    """i64[10]: how many of `num_rows` output rows fall in each tenth."""
    return np.diff(-(-np.arange(PROFILE_PARTS + 1) * num_rows // PROFILE_PARTS))


def along_output(profile: np.ndarray, num_rows: int) -> dict:
    """The stats' ``along_output``: mean segments and tokens per row in each tenth of the rows."""
    rows = profile_rows(num_rows)
    safe = np.maximum(rows, 1)
    return {"rows": rows.tolist(),
            "segments_per_row": [round(float(x), 4) for x in profile[:, 0] / safe],
            "tokens_per_row": [round(float(x), 2) for x in profile[:, 1] / safe]}


def first_overlength(lengths: np.ndarray, config: PackConfig) -> tuple[int, int, int] | None:
    """(index, length) of one input's first example longer than seq_len, and how many are, when
    the overflow policy refuses them; None otherwise."""
    if config.overflow is not Overflow.ERROR or Strategy(config.strategy) is Strategy.CONCAT_SPLIT:
        return None
    over = np.flatnonzero(lengths > config.seq_len)
    return (int(over[0]), int(lengths[over[0]]), int(over.size)) if over.size else None


def check_overlength(paths: Sequence[str], found: Sequence[tuple[int, int, int] | None],
                     config: PackConfig) -> None:
    """InputError naming the file and record of the first over-length example, given each
    input's `first_overlength` (in input order)."""
    total = sum(hit[2] for hit in found if hit is not None)
    for path, hit in zip(paths, found):
        if hit is not None:
            raise InputError(
                f"{path}: example {hit[0]} (counting from 0) has {hit[1]} tokens, more than "
                f"seq_len {config.seq_len} ({total} over-length example(s) in the inputs); pass "
                "overflow='truncate', 'split' or 'drop' to keep them, or a larger seq_len=")


def check_empty(paths: Sequence[str], examples: Sequence[int], tokens: Sequence[int], *,
                warn: bool = True) -> None:
    """InputError when no input holds a token; a warning naming each input that holds none
    (`warn`)."""
    empty = [i for i, n in enumerate(tokens) if not int(n)]
    if len(empty) == len(paths):
        names = ", ".join(paths[i] for i in empty[:3]) + (f" and {len(empty) - 3} more"
                                                           if len(empty) > 3 else "")
        raise InputError(f"{names}: no tokens in any input ({sum(examples)} examples); "
                         "nothing to pack")
    for i in empty if warn else ():
        log.warning("%s: no tokens (%d examples): nothing of it is packed", paths[i],
                    examples[i])


def nothing_packed(dropped: int, seq_len: int) -> None:
    """InputError for a run whose every example `overflow="drop"` dropped: before anything
    is written (an output of no rows trains nothing)."""
    raise InputError(f"nothing to pack: overflow='drop' dropped all {dropped:,} example(s), "
                     f"each longer than seq_len={seq_len}; keep them with overflow='split' or "
                     "'truncate', or pack with longer rows")
