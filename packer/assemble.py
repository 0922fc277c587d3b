"""Builds packed token rows from a plan: the batch dict of the packed-row contract.

Input is the Arrow / Parquet list layout: all tokens back to back in `values`, example i being
`values[offsets[i]:offsets[i + 1]]`. The rows are built as runs of padding and pieces, so the cost
is one pass over the tokens plus a few whole-array operations, whatever the number of pieces.

Worked example (seq_len 6, max_segments 2, pad_id 0, first_fit)::

    examples:  [7 8 9]  [5 6]  [4]          plan: row 0 = e0, e1 (2 slots: full); row 1 = e2
    tokens               7 8 9 5 6 0  |  4 0 0 0 0 0
    tokens_segment_ids   1 1 1 2 2 0  |  1 0 0 0 0 0
    tokens_positions     0 1 2 0 1 0  |  0 0 0 0 0 0
    tokens_segment_lengths   3 2      |  1 0
    tokens_segment_offsets   0 3      |  0 1
    segment_source_index     0 1      |  2 -1
    segment_source_start     0 0      |  0 0
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from seqpack.packer.config import PackConfig
from seqpack.packer.inputs import check_offsets, check_values, ragged_from_sequences
from seqpack.packer.plan import PackPlan, plan


def segment_metadata(p: PackPlan, config: PackConfig) -> dict[str, np.ndarray]:
    """The `[R, S]` per-segment arrays of the contract for plan `p`."""
    k = config.keys()
    R, S = p.num_rows, config.max_segments
    lengths = np.zeros((R, S), np.int32)
    src_index = np.full((R, S), -1, np.int64)
    src_start = np.zeros((R, S), np.int64)
    used = np.zeros(R, np.int64)
    if p.num_pieces:
        ends = p.offset + p.length
        last = np.append(p.row[1:] != p.row[:-1], True)
        used[p.row[last]] = ends[last]
    offsets = np.repeat(used.astype(np.int32)[:, None], S, axis=1)
    lengths[p.row, p.slot] = p.length
    offsets[p.row, p.slot] = p.offset
    src_index[p.row, p.slot] = p.example
    src_start[p.row, p.slot] = p.start
    return {
        k["segment_lengths"]: lengths,
        k["segment_offsets"]: offsets,
        k["source_index"]: src_index,
        k["source_start"]: src_start,
    }


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
    return _assemble_checked(values, offsets, p, config)


def _assemble_checked(values: np.ndarray, offsets: np.ndarray, p: PackPlan,
                      config: PackConfig) -> dict:
    """`assemble` on inputs already checked (and a plan made from them)."""
    src = offsets[p.example] + p.start
    pieces = [values[s : s + m] for s, m in zip(src.tolist(), p.length.tolist())]
    return build_rows(pieces, p, config, dtype=values.dtype)


def _ids_and_positions(run_lens: np.ndarray, slots: np.ndarray, seq_len: int):
    """Segment ids and positions of runs (gap, piece, gap, ..., piece, tail) by `np.repeat`."""
    run_ids = np.zeros(run_lens.size, np.int32)
    run_ids[1::2] = slots + 1
    seg_ids = np.repeat(run_ids, run_lens)
    # A padding run's "start" is pushed seq_len past its real start, so its positions come out
    # negative (a run is never longer than seq_len) and the clip at 0 zeroes them in one pass.
    run_starts = np.cumsum(run_lens) - run_lens
    run_starts[0::2] += seq_len
    positions = np.arange(int(run_lens.sum()), dtype=np.int32)
    positions -= np.repeat(run_starts.astype(np.int32), run_lens)
    np.maximum(positions, 0, out=positions)
    return seg_ids, positions


def segment_ids_and_positions(
    segment_lengths: np.ndarray,  # i32[..., S]
    segment_offsets: np.ndarray,  # i32[..., S]
    seq_len: int,
) -> tuple[np.ndarray, np.ndarray]:  # i32[..., L] twice
    """Rebuilds a row's (or batch's) segment ids and positions from its lengths and offsets.

    They are fully determined by the `[S]` metadata, so storage may leave them out (the offline
    writer does) and readers call this to restore the contract's `[L]` arrays.
    """
    lengths = np.asarray(segment_lengths, np.int64)
    offsets = np.asarray(segment_offsets, np.int64)
    lead = lengths.shape[:-1]
    lengths = lengths.reshape(-1, lengths.shape[-1])
    offsets = offsets.reshape(lengths.shape)
    R = lengths.shape[0]
    rows, slots = np.nonzero(lengths > 0)  # row-major: slot order within each row
    dst = rows * seq_len + offsets[rows, slots]
    lens = lengths[rows, slots]
    ends = dst + lens
    n = lens.size
    run_lens = np.empty(2 * n + 1, np.int64)
    run_lens[0:-1:2] = dst - np.concatenate(([0], ends[:-1]))
    run_lens[1::2] = lens
    run_lens[-1] = R * seq_len - (int(ends[-1]) if n else 0)
    if n and (run_lens.min() < 0 or (offsets[rows, slots] + lens > seq_len).any()):
        raise ValueError(
            "segment lengths/offsets overlap, run backwards or past seq_len="
            f"{seq_len}: the row metadata is corrupt"
        )
    seg_ids, positions = _ids_and_positions(run_lens, slots, seq_len)
    shape = (*lead, seq_len)
    return seg_ids.reshape(shape), positions.reshape(shape)


def build_rows(pieces: Sequence[np.ndarray], p: PackPlan, config: PackConfig, *, dtype,
               derived: bool = True) -> dict:
    """Writes the rows of plan `p`; `pieces[i]` holds the tokens of the plan's i-th piece.

    `derived=False` leaves out segment ids and positions (storage rebuilds them from the lengths
    and offsets with `segment_ids_and_positions`).

    The flat `[R * L]` buffers are runs: padding gap, piece, padding gap, piece, ..., tail. Tokens
    are one `np.concatenate` of the pieces and padding slices; segment ids one `np.repeat` of the
    runs' ids; positions a ramp minus each run's start, zeroed on padding.
    """
    k = config.keys()
    R, L = p.num_rows, config.seq_len
    if dtype is None:
        dtype = np.int32
    n = p.num_pieces
    dst = p.row * L + p.offset
    lens = p.length
    ends = dst + lens
    run_lens = np.empty(2 * n + 1, np.int64)
    run_lens[0:-1:2] = dst - np.concatenate(([0], ends[:-1]))
    run_lens[1::2] = lens
    run_lens[-1] = R * L - (int(ends[-1]) if n else 0)
    gaps = run_lens[0::2].tolist()
    pad = np.full(L, config.pad_id, dtype=dtype)
    runs: list[np.ndarray] = [pad] * (2 * n + 1)
    runs[0::2] = [pad[:g] for g in gaps]
    runs[1::2] = pieces
    tokens = np.concatenate(runs).astype(dtype, copy=False)
    batch = {k["values"]: tokens.reshape(R, L)}
    if derived:
        seg_ids, positions = _ids_and_positions(run_lens, p.slot, L)
        batch[k["segment_ids"]] = seg_ids.reshape(R, L)
        batch[k["positions"]] = positions.reshape(R, L)
    batch.update(segment_metadata(p, config))
    return batch


def pack_ragged(values: object, offsets: object, config: PackConfig) -> dict:
    """Plans and assembles in one call: flat `values` + example `offsets` -> batch dict."""
    values = check_values(values)
    offsets = check_offsets(offsets, values.size)
    return _assemble_checked(values, offsets, plan(np.diff(offsets), config), config)


def pack(sequences: Sequence[object], config: PackConfig) -> dict:
    """Packs a list of 1-D integer arrays -> batch dict."""
    values, offsets = ragged_from_sequences(sequences)  # checked while concatenating
    return _assemble_checked(values, offsets, plan(np.diff(offsets), config), config)
