"""`--format hf`: TRL's padding-free rows, as `trl.pack_dataset` writes them and its collator
reads them, in Parquet that HF `datasets` loads.

A row holds its segments back to back with no padding: `input_ids`, `seq_lengths` (one length
per segment, from which `DataCollatorForLanguageModeling(padding_free=True)` builds
`position_ids` and the flash-attention boundaries), `position_ids` (the same positions, for
trainers that read them), and `labels` when the run packed labels or masks: the labels column
(else the tokens) with -100 where a labels column holds -100 or a mask column 0, the loss
`seqpack` counts (the collator itself sets -100 at each segment's first position). Mask and
value columns are kept under their names, and each segment's source (`segment_source_index`,
`segment_source_start`) rides along for `seqpack verify` (`SFTTrainer` drops columns its model
does not take). Worked example (seq_len 8, one labels column)::

    input_ids      [7, 8, 9, 5, 6]
    labels         [-100, 8, 9, -100, 6]
    seq_lengths    [3, 2]
    position_ids   [0, 1, 2, 0, 1]

Followed: trl 1.16.0, `trl/trainer/sft_trainer.py` (`DataCollatorForLanguageModeling.torch_call`,
`get_position_ids_from_packed_seq_lengths`) and `trl/data_utils.py` (`pack_dataset`), read at
huggingface/trl f2cd57710ae345ea6428ae95363267fcf38a3dc8. Rows are unpadded, so segments must
touch: `segment_alignment` 1 and no `context_parallel`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from seqpack.packer.contract import DATASET_ID, IGNORE_INDEX, SOURCE_INDEX, SOURCE_START
from seqpack.pipelines.errors import InputError
from seqpack.pipelines.formats.encodings import arrow
from seqpack.pipelines.formats.encodings.base import (
    Layout,
    allowed_positions,
    check_names,
    next_token_mask,
    with_segment_ids,
)

INPUT_IDS, LABELS, SEQ_LENGTHS, POSITION_IDS = "input_ids", "labels", "seq_lengths", "position_ids"
_OWN = (INPUT_IDS, LABELS, SEQ_LENGTHS, POSITION_IDS, SOURCE_INDEX, SOURCE_START, DATASET_ID)


def check_unpadded(fmt: str, layout: Layout) -> None:
    config = layout.config
    if config.alignment != 1:
        why = (f"segment_alignment={config.segment_alignment}" if config.segment_alignment != 1
               else f"context_parallel={config.context_parallel} (segments start at multiples "
                    f"of {config.alignment})")
        raise ValueError(f"format={fmt!r} writes unpadded rows, so segments touch: {why} "
                         "needs format='arrayrecord' or 'parquet'")


def ragged_rows(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(offsets i64[R + 1], slots) of the used slots of `[R, S]` segment lengths, row by row."""
    used = lengths > 0
    counts = used.sum(axis=1, dtype=np.int64)
    return np.concatenate(([0], np.cumsum(counts))), used


def segments_of(lengths_flat: np.ndarray, offsets: np.ndarray, S: int, path: str,
                first: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    """`[R, S]` segment lengths and offsets of ragged per-row lengths laid back to back (unused
    slots: length 0, offset the row's used length)."""
    lengths = arrow.spread(offsets, lengths_flat.astype(np.int32), S, 0, path, name, first)
    ends = np.cumsum(lengths, axis=1, dtype=np.int64)
    return lengths, (ends - lengths).astype(np.int32)


def sources(table: Any, offsets: np.ndarray, S: int, path: str, first: int,
            layout: Layout) -> dict[str, np.ndarray]:
    """The `[R, S]` source keys (`Layout.sources`) of a table whose rows hold
    `np.diff(offsets)` segments."""
    out = {}
    for name in layout.sources():
        pad = 0 if name == SOURCE_START else -1
        got, values = arrow.ragged(table, name, path, first)
        if not np.array_equal(got, offsets):
            i = int(np.argmax(np.diff(got) != np.diff(offsets)))
            raise InputError(f"{path} row {first + i}: {name} does not hold one value per "
                             "segment")
        dtype = np.int32 if name == DATASET_ID else np.int64
        out[name] = arrow.spread(got, values.astype(dtype), S, pad, path, name, first)
    return out


def write_unpadded(path: str, columns: dict[str, Any], batch: Mapping[str, np.ndarray],
                   keep: np.ndarray, used: np.ndarray, verbatim: list[str],
                   layout: Layout) -> None:
    """Writes a shard of unpadded rows: the format's `columns`, then each segment's source
    (`used`: the used slots) and the `verbatim` columns at the tokens' positions (`keep`)."""
    for name in layout.sources():
        columns[name] = arrow.kept(np.asarray(batch[name]), used)
    columns.update((n, arrow.kept(np.asarray(batch[n]), keep)) for n in verbatim)
    arrow.write_parquet(path, columns, layout)


class TrlRows(arrow.ParquetEncoding):
    name, suffix, record_encoding = "hf", ".parquet", "trl-padding-free"

    def check(self, layout: Layout) -> None:
        check_unpadded(self.name, layout)
        check_names(self.name, _OWN, Layout(layout.config, tuple(
            c for c in layout.columns if c.get("role") != "labels")))

    def has_labels(self, layout: Layout) -> bool:
        return bool(layout.names("labels", "mask"))

    def verbatim(self, layout: Layout) -> list[str]:
        return layout.names("mask", "values")

    def stored_keys(self, layout: Layout) -> list[str]:
        labels = [LABELS] if self.has_labels(layout) else []
        return [INPUT_IDS, *labels, SEQ_LENGTHS, POSITION_IDS, *layout.sources(),
                *self.verbatim(layout)]

    def decoded_keys(self, layout: Layout) -> list[str]:
        k = layout.config.keys()
        labels = [LABELS] if self.has_labels(layout) else []
        return [k.values, *k.per_slot, *layout.sources(), *labels, POSITION_IDS,
                *self.verbatim(layout)]

    def derived(self, batch: Mapping[str, np.ndarray], layout: Layout
                ) -> dict[str, np.ndarray]:
        k = layout.config.keys()
        seg = np.asarray(batch[k.segment_ids])
        out = {POSITION_IDS: np.where(seg > 0, batch[k.positions], 0).astype(np.int32)}
        if self.has_labels(layout):
            names = layout.names("labels")
            base = np.asarray(batch[names[0] if names else k.values])
            dtype = np.result_type(base.dtype, np.int8)
            dtype = np.dtype(np.int64) if dtype.kind == "f" else dtype
            keep = (seg > 0) & allowed_positions(batch, layout)
            out[LABELS] = np.where(keep, base, IGNORE_INDEX).astype(dtype)
        return out

    def loss_mask(self, rows: Mapping[str, np.ndarray], layout: Layout) -> np.ndarray:
        seg = with_segment_ids(rows, layout.config)[layout.config.keys().segment_ids]
        allowed = rows[LABELS] != IGNORE_INDEX if self.has_labels(layout) else \
            np.ones(seg.shape, bool)
        return next_token_mask(seg, allowed)

    def write(self, path: str, batch: Mapping[str, np.ndarray], layout: Layout) -> None:
        k = layout.config.keys()
        keep = np.asarray(batch[k.segment_ids]) > 0
        lengths = np.asarray(batch[k.segment_lengths])
        _, used = ragged_rows(lengths)
        derived = self.derived(batch, layout)
        columns = {INPUT_IDS: arrow.kept(np.asarray(batch[k.values]), keep)}
        if LABELS in derived:
            columns[LABELS] = arrow.kept(derived[LABELS], keep)
        columns[SEQ_LENGTHS] = arrow.kept(lengths.astype(np.int32), used)
        columns[POSITION_IDS] = arrow.kept(derived[POSITION_IDS], keep)
        write_unpadded(path, columns, batch, keep, used, self.verbatim(layout), layout)

    def decoder(self, layout: Layout) -> arrow.Decode:
        config = layout.config
        k, L, S = config.keys(), config.seq_len, config.max_segments
        labels = self.has_labels(layout)

        def decode(table: Any, path: str, first: int) -> dict[str, np.ndarray]:
            offsets, tokens = arrow.ragged(table, INPUT_IDS, path, first)
            seg_offsets, flat = arrow.ragged(table, SEQ_LENGTHS, path, first)
            lengths, starts = segments_of(flat, seg_offsets, S, path, first, SEQ_LENGTHS)
            total = lengths.sum(axis=1, dtype=np.int64)
            if not np.array_equal(total, np.diff(offsets)):
                i = int(np.argmax(total != np.diff(offsets)))
                raise InputError(f"{path} row {first + i}: seq_lengths add up to {total[i]}, "
                                 f"input_ids holds {np.diff(offsets)[i]}")
            out = {k.values: arrow.spread(offsets, tokens, L, config.pad_id, path, INPUT_IDS,
                                          first),
                   k.segment_lengths: lengths, k.segment_offsets: starts}
            out.update(sources(table, seg_offsets, S, path, first, layout))
            columns = ([(LABELS, IGNORE_INDEX)] if labels else []) + [(POSITION_IDS, 0)]
            columns += [(n, layout.pad(n)) for n in self.verbatim(layout)]
            out.update(arrow.aligned(table, columns, offsets, L, path, first, INPUT_IDS))
            return out

        return decode

