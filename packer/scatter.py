"""Writes packed rows from a layout (row, slot, offset, length per piece) with vectorized scatters.

Used by `PackIterDataset` for the multi-feature path and for per-token meta features; the
single-feature token rows come from `packer.build_rows`. A layout lists pieces in (row, slot)
order; `pieces[i]` holds the values of piece i (1-D, or N-D with trailing dims).

Worked example (L = 6, S = 3; two rows)::

    piece:    row slot offset length         values
    0         0   0    0      3              7 8 9
    1         0   1    4      2              5 6        (alignment 2 leaves a gap at 3)
    2         1   0    0      1              4
    values       7 8 9 0 5 6 | 4 0 0 0 0 0
    segment_ids  1 1 1 0 2 2 | 1 0 0 0 0 0
    positions    0 1 2 0 0 1 | 0 0 0 0 0 0
    lengths      3 2 0       | 1 0 0
    offsets      0 4 6       | 0 1 1            (unused slots: the row's used length)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where every piece goes; all arrays i64[P], sorted by (row, slot)."""

    row: np.ndarray
    slot: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    num_rows: int

    def destinations(self, seq_len: int) -> np.ndarray:
        """i64[sum(length)]: flat `[R * L]` position of every value, pieces back to back."""
        excl = np.cumsum(self.length) - self.length
        base = self.row * seq_len + self.offset - excl
        return np.repeat(base, self.length) + np.arange(int(self.length.sum()))


def fill_values(
    pieces: Sequence[Any],
    layout: Layout,
    seq_len: int,
    *,
    dtype: Any,
    pad: Any = 0,
    dest: np.ndarray | None = None,
) -> np.ndarray:
    """`[R, L, ...]` array holding each piece at its (row, offset), `pad` elsewhere."""
    trail: tuple[int, ...] = ()
    for p in pieces:
        if np.ndim(p) > 1:
            trail = tuple(np.shape(p)[1:])
            break
    out = np.full((layout.num_rows, seq_len, *trail), pad, dtype=dtype)
    if dest is None:
        dest = layout.destinations(seq_len)
    if dest.size:
        out.reshape(-1, *trail)[dest] = np.concatenate(pieces, axis=0)
    return out


def segment_arrays(
    layout: Layout, seq_len: int, max_segments: int, *, prefix: str, dest: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """The contract's `prefix_segment_ids/_positions` `[R, L]` and `_lengths/_offsets` `[R, S]`."""
    R, L, S = layout.num_rows, seq_len, max_segments
    if dest is None:
        dest = layout.destinations(L)
    lens = layout.length
    excl = np.cumsum(lens) - lens
    seg = np.zeros((R, L), np.int32)
    pos = np.zeros((R, L), np.int32)
    seg.reshape(-1)[dest] = np.repeat(layout.slot + 1, lens)
    pos.reshape(-1)[dest] = np.arange(dest.size) - np.repeat(excl, lens)
    used = np.zeros(R, np.int64)
    nz = lens > 0
    np.maximum.at(used, layout.row[nz], (layout.offset + lens)[nz])
    seg_lens = np.zeros((R, S), np.int32)
    seg_offs = np.repeat(used.astype(np.int32)[:, None], S, axis=1)
    seg_lens[layout.row, layout.slot] = lens
    seg_offs[layout.row, layout.slot] = np.where(nz, layout.offset, used[layout.row])
    return {
        f"{prefix}_segment_ids": seg,
        f"{prefix}_positions": pos,
        f"{prefix}_segment_lengths": seg_lens,
        f"{prefix}_segment_offsets": seg_offs,
    }


def source_arrays(
    layout: Layout, max_segments: int, example: np.ndarray, start: np.ndarray
) -> dict[str, np.ndarray]:
    """`segment_source_index` (-1 unused) and `segment_source_start` `[R, S]` i64."""
    R, S = layout.num_rows, max_segments
    index = np.full((R, S), -1, np.int64)
    starts = np.zeros((R, S), np.int64)
    index[layout.row, layout.slot] = example
    starts[layout.row, layout.slot] = start
    return {"segment_source_index": index, "segment_source_start": starts}
