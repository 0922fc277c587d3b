"""`--format megatron`: Megatron-Bridge's packed SFT Parquet (`*.idx.parquet`) and its metadata.

Followed exactly, at NVIDIA-NeMo/Megatron-Bridge 067f987df03b8355b03192d88d70f1709fedf51a:
`src/megatron/bridge/data/packing/parquet.py` (`write_packed_parquet`, the schema
`GPTSFTPackedParquetDataset` reads and `validate_row`'s invariants), `algorithms.py`
(`fill_packing_strategy`'s loss mask, `create_packing_strategy`'s metadata) and `offline.py`
(the metadata file, a JSON list of such dicts, that `pad_cu_seqlens` reads).

A row holds its segments back to back, unpadded::

    input_ids     list<int32>  the tokens
    seq_start_id  list<int32>  where each segment starts (0 first, increasing, < len(input_ids))
    loss_mask     list<int8>   1 where position p trains on token p + 1 of its segment: the
                               per-token mask (every labels column not -100, every mask column
                               not 0; all 1 without such columns) shifted one token left
                               within each segment, 0 on its last token (`x[1:] + [False]`)

plus `segment_source_index` / `segment_source_start` (list<int64>, one per segment) for `seqpack
verify` and the value columns under their names; the reader takes the three columns it needs.
Worked example (a segment [7, 8, 9] whose labels are [-100, 8, 9], then [5, 6])::

    input_ids     [7, 8, 9, 5, 6]
    seq_start_id  [0, 3]
    loss_mask     [1, 1, 0, 1, 0]      (7 -> 8 and 8 -> 9 train; 5 -> 6 trains)

Megatron-Bridge's `packed_sequence_size` counts positions after the shift (a segment of n
tokens gives n - 1): pass `--seq-len` as it, and a row of u tokens in k segments gives u - k
<= seq_len. ``<seq_len>_metadata.jsonl`` (its default name) holds `dataset_max_seqlen` (the
longest segment - 1), `max_samples_per_bin`, `min_packed_seqlen` (the fewest u - k of a row),
`packing_factor`, `packing_efficiency` and `pack_size`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from seqpack.packer.contract import DATASET_ID, SOURCE_INDEX, SOURCE_START
from seqpack.pipelines.errors import InputError
from seqpack.pipelines.formats.encodings import arrow
from seqpack.pipelines.formats.encodings.base import (
    Layout,
    allowed_positions,
    check_names,
    next_token_mask,
)
from seqpack.pipelines.formats.encodings.trl import (
    check_unpadded,
    ragged_rows,
    sources,
    write_unpadded,
)

INPUT_IDS, SEQ_START_ID, LOSS_MASK = "input_ids", "seq_start_id", "loss_mask"
_OWN = (INPUT_IDS, SEQ_START_ID, LOSS_MASK, SOURCE_INDEX, SOURCE_START, DATASET_ID)
_INT32 = np.iinfo(np.int32)
METADATA = re.compile(r"^\d+_metadata\.jsonl$")  # `metadata_name`'s


def metadata_name(seq_len: int) -> str:
    return f"{seq_len}_metadata.jsonl"


def starts_to_segments(so: np.ndarray, starts: np.ndarray, sizes: np.ndarray, S: int,
                       path: str, first: int) -> tuple[np.ndarray, np.ndarray]:
    """`[R, S]` lengths and offsets from each row's seq_start_id (ragged: `so`, `starts`) and
    token count (`sizes`); InputError naming the row where `validate_row` would fail."""
    counts = np.diff(so)
    row_of = np.repeat(np.arange(counts.size), counts)
    heads = np.zeros(starts.size, bool)
    heads[so[:-1][counts > 0]] = True
    bad = np.zeros(counts.size, bool)
    bad |= counts == 0
    np.logical_or.at(bad, row_of, heads & (starts != 0))
    np.logical_or.at(bad, row_of, starts >= sizes[row_of])
    back = np.zeros(starts.size, bool)
    back[1:] = ~heads[1:] & (starts[1:] < starts[:-1])
    np.logical_or.at(bad, row_of, back)
    if bad.any():
        i = int(np.argmax(bad))
        raise InputError(f"{path} row {first + i}: seq_start_id must start with 0 and increase "
                         f"below len(input_ids)={sizes[i]} (Megatron-Bridge's validate_row)")
    ends = np.empty_like(starts)
    ends[:-1] = starts[1:]
    last = so[1:] - 1
    ends[last] = sizes
    lengths = arrow.spread(so, (ends - starts).astype(np.int32), S, 0, path, SEQ_START_ID, first)
    offsets = arrow.spread(so, starts.astype(np.int32), S, 0, path, SEQ_START_ID, first)
    offsets[lengths == 0] = np.broadcast_to(sizes[:, None], offsets.shape)[lengths == 0]
    return lengths, offsets


class MegatronRows(arrow.ParquetEncoding):
    name, suffix, record_encoding = "megatron", ".idx.parquet", "megatron-bridge-packed-sft"
    max_token_id = int(_INT32.max)  # input_ids: list<int32>

    def check(self, layout: Layout) -> None:
        check_unpadded(self.name, layout)
        check_names(self.name, _OWN, Layout(layout.config, tuple(
            c for c in layout.columns if c.get("role") == "values")))

    def verbatim(self, layout: Layout) -> list[str]:
        return layout.names("values")

    def stored_keys(self, layout: Layout) -> list[str]:
        return [INPUT_IDS, SEQ_START_ID, LOSS_MASK, *layout.sources(), *self.verbatim(layout)]

    def decoded_keys(self, layout: Layout) -> list[str]:
        k = layout.config.keys()
        return [k.values, *k.per_slot, *layout.sources(), LOSS_MASK, *self.verbatim(layout)]

    def derived(self, batch: Mapping[str, np.ndarray], layout: Layout
                ) -> dict[str, np.ndarray]:
        seg = np.asarray(batch[layout.config.keys().segment_ids])
        return {LOSS_MASK: next_token_mask(seg, allowed_positions(batch, layout)).astype(np.int8)}

    def loss_mask(self, rows: Mapping[str, np.ndarray], layout: Layout) -> np.ndarray:
        return np.asarray(rows[LOSS_MASK]) != 0

    def write(self, path: str, batch: Mapping[str, np.ndarray], layout: Layout) -> None:
        k = layout.config.keys()
        keep = np.asarray(batch[k.segment_ids]) > 0
        tokens = np.asarray(batch[k.values])
        if tokens.size and tokens.dtype.itemsize >= 4 and int(tokens.max()) > _INT32.max:
            raise InputError(f"{path}: token id {int(tokens.max())} does not fit "
                             "Megatron-Bridge's input_ids (list<int32>)")
        _, used = ragged_rows(np.asarray(batch[k.segment_lengths]))
        columns = {INPUT_IDS: arrow.kept(tokens.astype(np.int32), keep),
                   SEQ_START_ID: arrow.kept(np.asarray(batch[k.segment_offsets], np.int32), used),
                   LOSS_MASK: arrow.kept(self.derived(batch, layout)[LOSS_MASK], keep)}
        write_unpadded(path, columns, batch, keep, used, self.verbatim(layout), layout)

    def decoder(self, layout: Layout) -> arrow.Decode:
        config = layout.config
        k, L, S = config.keys(), config.seq_len, config.max_segments

        def decode(table: Any, path: str, first: int) -> dict[str, np.ndarray]:
            offsets, tokens = arrow.ragged(table, INPUT_IDS, path, first)
            sizes = np.diff(offsets)
            so, starts = arrow.ragged(table, SEQ_START_ID, path, first)
            lengths, seg_offsets = starts_to_segments(so, starts.astype(np.int64), sizes, S,
                                                      path, first)
            out = {k.values: arrow.spread(offsets, tokens, L, config.pad_id, path, INPUT_IDS,
                                          first),
                   k.segment_lengths: lengths, k.segment_offsets: seg_offsets}
            out.update(sources(table, so, S, path, first, layout))
            columns = [(LOSS_MASK, 0)] + [(n, layout.pad(n)) for n in self.verbatim(layout)]
            out.update(arrow.aligned(table, columns, offsets, L, path, first, INPUT_IDS))
            return out

        return decode


    def side_files(self, facts: Mapping[str, Any], layout: Layout) -> dict[str, Any]:
        """Megatron-Bridge's metadata (`create_packing_strategy`'s dict, in a list)."""
        shapes, stats = facts["shapes"], facts["stats"]
        L, rows, segments = layout.config.seq_len, int(stats["num_rows"]), \
            int(stats["num_segments"])
        positions = int(stats["real_tokens"]) - segments
        return {metadata_name(L): [{
            "dataset_max_seqlen": max(int(shapes["longest_segment"]) - 1, 0),
            "max_samples_per_bin": int(shapes["max_row_segments"]),
            "packing_factor": round(segments / max(rows, 1), 2),
            "packing_efficiency": round(positions / max(rows, 1) / L * 100, 2),
            "pack_size": L,
            "min_packed_seqlen": int(shapes["min_row_next_tokens"]),
        }]}
