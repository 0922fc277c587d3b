"""The one row writer: builds packed rows from a layout (row, slot, offset, length per piece).

Every packed row in seqpack comes from here: the offline writer, `pack_ragged` / `pack` /
`online.pack_stream`, `PackIterDataset` (one or several features, meta features) and the Grain
drop-ins.
A layout lists pieces in any order; `pieces[i]` holds the values of piece i (1-D, or N-D with
trailing dims). The flat `[R * L]` buffer is a sequence of runs: padding gap, piece, padding gap,
piece, ..., tail. Values are one `np.concatenate` of the pieces and padding slices; segment ids
one `np.repeat` of the runs' ids; positions a ramp minus each run's start, zeroed on padding. So
the cost is one pass over the tokens plus a few whole-array operations, whatever the number of
pieces.

Worked example (seq_len 6, max_segments 2, pad_id 0, first_fit)::

    examples:  [7 8 9]  [5 6]  [4]          plan: row 0 = e0, e1 (2 slots: full); row 1 = e2
    tokens               7 8 9 5 6 0  |  4 0 0 0 0 0
    tokens_segment_ids   1 1 1 2 2 0  |  1 0 0 0 0 0
    tokens_positions     0 1 2 0 1 0  |  0 0 0 0 0 0
    tokens_segment_lengths   3 2      |  1 0
    tokens_segment_offsets   0 3      |  0 1
    segment_source_index     0 1      |  2 -1
    segment_source_start     0 0      |  0 0

Unused slots hold the row's used length (the end of its last non-empty segment) as offset; a
piece of length 0 (the Grain drop-ins keep empty examples as slots) is such a slot too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from seqpack.packer.config import PackConfig
from seqpack.packer.contract import (
    SEGMENT_DTYPE,
    SOURCE_DTYPE,
    ids_and_positions_of_runs,
    keys,
    runs,
    segment_ids_and_positions,
)
from seqpack.packer.inputs import (
    check_offsets,
    check_pad,
    check_values,
    ragged_from_sequences,
)
from seqpack.packer.plan import PackPlan, plan

__all__ = [
    "Layout",
    "RowLayout",
    "assemble",
    "build_rows",
    "fill_rows",
    "pack",
    "pack_ragged",
    "segment_ids_and_positions",
    "source_arrays",
    "write_feature",
]


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """Where every piece goes: i64[P] arrays (any order) and the number of rows."""

    row: np.ndarray
    slot: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    num_rows: int


Layout = RowLayout | PackPlan  # a plan is a layout too (plus where each piece comes from)


@dataclasses.dataclass(frozen=True)
class _Placed:
    """A layout's pieces in buffer order: their runs, slots, and the permutation (or None)."""

    order: np.ndarray | None
    run_lens: np.ndarray
    slots: np.ndarray


def _place(layout: Layout, seq_len: int) -> _Placed:
    dst = layout.row * seq_len + layout.offset
    lens = np.asarray(layout.length, np.int64)
    slots = layout.slot
    order = None
    # (row, offset) order; an empty piece may sit at offset L, where the next row starts.
    key = layout.row * (seq_len + 1) + layout.offset
    if key.size > 1 and (key[1:] < key[:-1]).any():
        order = np.argsort(key, kind="stable")
        dst, lens, slots = dst[order], lens[order], slots[order]
    run_lens = runs(dst, lens, layout.num_rows * seq_len)
    assert not run_lens.size or run_lens.min() >= 0, "pieces overlap"
    return _Placed(order, run_lens, slots)


def _fill(pieces: Sequence[Any], placed: _Placed, num_rows: int, seq_len: int, *, dtype: Any,
          pad: Any) -> np.ndarray:
    check_pad(pad, dtype)
    trail = tuple(np.shape(pieces[0])[1:]) if len(pieces) else ()  # every piece has these
    if placed.order is not None:
        pieces = [pieces[i] for i in placed.order.tolist()]
    gaps = placed.run_lens[0::2]
    pad_block = np.full((max(seq_len, int(gaps.max())), *trail), pad, dtype=dtype)
    out: list[Any] = [pad_block] * placed.run_lens.size
    out[0::2] = [pad_block[:g] for g in gaps.tolist()]
    out[1::2] = pieces
    values = np.concatenate(out, axis=0).astype(dtype, copy=False)
    return values.reshape(num_rows, seq_len, *trail)


def fill_rows(pieces: Sequence[Any], layout: Layout, seq_len: int, *, dtype: Any,
              pad: Any = 0) -> np.ndarray:
    """`[R, L, ...]` values: each piece at its (row, offset), `pad` elsewhere (no metadata)."""
    return _fill(pieces, _place(layout, seq_len), layout.num_rows, seq_len, dtype=dtype, pad=pad)


def write_feature(pieces: Sequence[Any] | None, layout: Layout, seq_len: int,
                  max_segments: int, *, feature: str, dtype: Any, pad: Any = 0,
                  derived: bool = True, values: np.ndarray | None = None
                  ) -> dict[str, np.ndarray]:
    """One packed feature's contract arrays: values `[R, L, ...]`, segment ids and positions
    `[R, L]` (unless `derived=False`: storage rebuilds them) and lengths / offsets `[R, S]`.

    `values`: the `[R, L]` values already in place (each piece at its row and offset, `pad`
    elsewhere: `fill_rows`'s result), when the caller wrote them itself; `pieces` is then None."""
    k = keys(feature)
    R, L, S = layout.num_rows, seq_len, max_segments
    placed = _place(layout, L) if values is None or derived else None
    if values is None:
        assert pieces is not None and placed is not None
        values = _fill(pieces, placed, R, L, dtype=dtype, pad=pad)
    out = {k.values: values}
    if derived:
        assert placed is not None
        seg_ids, positions = ids_and_positions_of_runs(placed.run_lens, placed.slots, L)
        out[k.segment_ids] = seg_ids.reshape(R, L)
        out[k.positions] = positions.reshape(R, L)
    lens = np.asarray(layout.length, np.int64)
    nz = lens > 0
    used = np.zeros(R, np.int64)
    np.maximum.at(used, layout.row[nz], (layout.offset + lens)[nz])
    lengths = np.zeros((R, S), SEGMENT_DTYPE)
    offsets = np.repeat(used.astype(SEGMENT_DTYPE)[:, None], S, axis=1)
    lengths[layout.row, layout.slot] = lens
    offsets[layout.row, layout.slot] = np.where(nz, layout.offset, used[layout.row])
    out[k.segment_lengths] = lengths
    out[k.segment_offsets] = offsets
    return out


def source_arrays(layout: Layout, max_segments: int, example: np.ndarray,
                  start: np.ndarray) -> dict[str, np.ndarray]:
    """`segment_source_index` (-1 unused) and `segment_source_start` `[R, S]` i64."""
    k = keys()
    R, S = layout.num_rows, max_segments
    index = np.full((R, S), -1, SOURCE_DTYPE)
    starts = np.zeros((R, S), SOURCE_DTYPE)
    index[layout.row, layout.slot] = example
    starts[layout.row, layout.slot] = start
    return {k.source_index: index, k.source_start: starts}


def build_rows(pieces: Sequence[np.ndarray] | None, p: PackPlan, config: PackConfig, *,
               dtype: Any, derived: bool = True, values: np.ndarray | None = None,
               columns: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The batch dict (`[R, L]` / `[R, S]`) of plan `p`; `pieces[i]` holds its i-th piece (or
    `values` holds the `[R, L]` tokens already in place: see `write_feature`).

    `columns`: further columns packed under the same segment layout (labels, masks), each
    `[R, L]` with its values at the tokens' positions and its own pad elsewhere (`fill_rows`
    with the same plan); they join the batch under their names, after the contract's keys."""
    batch = write_feature(pieces, p, config.seq_len, config.max_segments, feature=config.feature,
                          dtype=np.int32 if dtype is None else dtype, pad=config.pad_id,
                          derived=derived, values=values)
    batch.update(source_arrays(p, config.max_segments, p.example, p.start))
    for name, column in (columns or {}).items():
        if name in batch or np.shape(column)[:2] != (p.num_rows, config.seq_len):
            raise ValueError(f"column {name!r}: shape {np.shape(column)} must be "
                             f"{(p.num_rows, config.seq_len)} and its name not a contract key")
        batch[name] = column
    return batch


def assemble(values: object, offsets: object, p: PackPlan, config: PackConfig) -> dict:
    """Builds the batch (`[R, L]` and `[R, S]` arrays) for plan `p` from flat values + offsets."""
    values = check_values(values)
    offsets = check_offsets(offsets, values.size)
    n = offsets.size - 1
    if p.num_pieces:
        if int(p.example.max()) >= n:
            raise ValueError(
                f"the plan refers to example {int(p.example.max())} but offsets describe {n} "
                "examples; plan and assemble with the same data"
            )
        too_long = p.start + p.length > np.diff(offsets)[p.example]
        if too_long.any():
            i = int(np.argmax(too_long))
            raise ValueError(
                f"the plan's piece of example {int(p.example[i])} ends past that example; "
                "plan and assemble with the same data"
            )
        check_fits(p, config)
    return _assemble_checked(values, offsets, p, config)


def check_fits(p: PackPlan, config: PackConfig) -> None:
    """ValueError unless plan `p` fits `config`'s rows: its slots within max_segments, its
    pieces within seq_len and on segment_alignment (a plan made under another config)."""
    if not p.num_pieces:
        return
    slot, end = int(p.slot.max()), int((p.offset + p.length).max())
    wrong = [f"slot {slot} >= max_segments={config.max_segments}"
             if slot >= config.max_segments else "",
             f"a piece ends at {end} > seq_len={config.seq_len}" if end > config.seq_len else "",
             f"an offset off segment_alignment={config.alignment}"
             if (p.offset % config.alignment).any() else ""]
    if any(wrong):
        raise ValueError(f"the plan does not fit the config: {'; '.join(w for w in wrong if w)}; "
                         "plan and assemble with the same config")


def _assemble_checked(values: np.ndarray, offsets: np.ndarray, p: PackPlan,
                      config: PackConfig) -> dict:
    """`assemble` on inputs already checked (and a plan made from them)."""
    src = offsets[p.example] + p.start
    pieces = [values[s : s + m] for s, m in zip(src.tolist(), p.length.tolist())]
    return build_rows(pieces, p, config, dtype=values.dtype)


def pack_ragged(values: object, offsets: object, config: PackConfig) -> dict:
    """Plans and assembles in one call: flat `values` + example `offsets` -> batch dict."""
    values = check_values(values)
    offsets = check_offsets(offsets, values.size)
    return _assemble_checked(values, offsets, plan(np.diff(offsets), config), config)


def pack(sequences: Sequence[object], config: PackConfig) -> dict:
    """Packs a list of 1-D integer arrays -> batch dict."""
    values, offsets = ragged_from_sequences(sequences)  # checked while concatenating
    return _assemble_checked(values, offsets, plan(np.diff(offsets), config), config)
