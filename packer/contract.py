"""The packed-row contract every layer shares: key names, dtypes, counters, derived arrays.

For a packed feature `f` (default "tokens"), L = seq_len and S = max_segments, a row holds::

    key                    shape, dtype       meaning
    f                      [L] input dtype    the segments' tokens back to back, then pad_id
    f_segment_ids          [L] i32            1..n for the row's n segments, 0 on padding
    f_positions            [L] i32            position inside its segment; 0 on padding
    f_segment_lengths      [S] i32            length of segment j; 0 for unused slots
    f_segment_offsets      [S] i32            start of segment j; unused slots: the used length
    segment_source_index   [S] i64            input example of segment j; -1 unused
    segment_source_start   [S] i64            where in that example segment j starts
    segment_dataset_id     [S] i32            with a mixture: segment j's dataset; -1 unused

Worked example (seq_len 6, max_segments 2; `segment_ids_and_positions` rebuilds the `[L]` arrays
from the `[S]` ones, which is why storage keeps only the latter)::

    f_segment_lengths   3 2            f_segment_ids   1 1 1 2 2 0
    f_segment_offsets   0 3      ->    f_positions     0 1 2 0 1 0

docs/contract.md documents the contract for users; this module is its one home in code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from seqpack.packer.inputs import InputError

SEGMENT_DTYPE = np.dtype(np.int32)  # segment ids, positions, lengths and offsets
SOURCE_DTYPE = np.dtype(np.int64)  # segment_source_index / segment_source_start
SOURCE_INDEX = "segment_source_index"
SOURCE_START = "segment_source_start"
DATASET_ID = "segment_dataset_id"  # [S] i32, rows of a mixture only
IGNORE_INDEX = -100  # the label of a position that takes no loss (PyTorch, Hugging Face)
DATASET_DTYPE = np.dtype(np.int32)
_LENGTHS, _OFFSETS, _IDS, _POSITIONS = (
    "_segment_lengths", "_segment_offsets", "_segment_ids", "_positions")


@dataclasses.dataclass(frozen=True)
class FeatureKeys:
    """The contract's key names for one packed feature."""

    values: str  # [L] tokens
    segment_ids: str  # [L] i32
    positions: str  # [L] i32
    segment_lengths: str  # [S] i32
    segment_offsets: str  # [S] i32
    source_index: str = SOURCE_INDEX  # [S] i64, shared by every feature of a row
    source_start: str = SOURCE_START  # [S] i64

    @classmethod
    def of(cls, feature: str) -> FeatureKeys:
        return cls(feature, feature + _IDS, feature + _POSITIONS, feature + _LENGTHS,
                   feature + _OFFSETS)

    def roles(self) -> dict[str, str]:
        """role -> key name, e.g. {"values": "tokens", "segment_ids": "tokens_segment_ids"}."""
        return dataclasses.asdict(self)

    @property
    def per_token(self) -> tuple[str, str, str]:
        """The `[L]` keys."""
        return self.values, self.segment_ids, self.positions

    @property
    def per_slot(self) -> tuple[str, str]:
        """The feature's own `[S]` keys (the source keys are shared)."""
        return self.segment_lengths, self.segment_offsets

    @property
    def derived(self) -> tuple[str, str]:
        """The `[L]` keys determined by the `[S]` metadata (storage may leave them out)."""
        return self.segment_ids, self.positions


def keys(feature: str = "tokens") -> FeatureKeys:
    return FeatureKeys.of(feature)


def is_per_slot(name: str) -> bool:
    """Whether a row's key holds one value per segment slot (`[S]`: any feature's lengths or
    offsets, the source and dataset keys), not one per token, whatever the shapes."""
    return name in (SOURCE_INDEX, SOURCE_START, DATASET_ID) or name.endswith((_LENGTHS, _OFFSETS))


def packed_features(row: Mapping[str, object]) -> list[str]:
    """Packed features of a row or batch: `f` with `f`, its lengths and its offsets present."""
    out = []
    for k in row:
        if k.endswith(_LENGTHS):
            f = k[: -len(_LENGTHS)]
            if f in row and f + _OFFSETS in row:
                out.append(f)
    return out


def check_not_packed(element: object, features: Sequence[str], where: str) -> None:
    """InputError when `element` (a dict) is already a packed row of one of `features`: it
    carries that feature's segment ids or positions. Packing a packed row again makes every row
    one segment and loses the segment boundaries."""
    if not isinstance(element, Mapping):
        return
    for f in features:
        k = keys(f)
        found = [name for name in (k.segment_ids, k.positions) if name in element]
        if found:
            raise InputError(
                f"{where} is already packed (it has {found[0]!r}); pack once: drop one of the "
                "two packers (a packed source goes to batching directly)"
            )


@dataclasses.dataclass(frozen=True)
class Counters:
    """What did not go into the rows unchanged. Every cut or dropped token is here."""

    num_examples: int = 0
    input_tokens: int = 0
    truncated_tokens: int = 0  # cut off over-length examples (overflow="truncate")
    truncated_examples: int = 0
    dropped_examples: int = 0  # over-length examples skipped (overflow="drop")
    dropped_tokens: int = 0
    split_examples: int = 0  # examples cut into several pieces (overflow="split", concat_split)
    split_pieces: int = 0  # pieces those examples became
    empty_examples: int = 0  # zero-length examples: never a segment

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def __add__(self, other: Counters) -> Counters:
        return Counters(**{k: v + getattr(other, k) for k, v in self.to_dict().items()})


def ragged_arange(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """i64[sum(lengths)]: concat(arange(s, s + n) for s, n in zip(starts, lengths)), vectorized."""
    lengths = np.asarray(lengths, np.int64)
    total = int(lengths.sum())
    if not total:
        return np.zeros(0, np.int64)
    excl = np.cumsum(lengths) - lengths
    return np.repeat(np.asarray(starts, np.int64) - excl, lengths) + np.arange(total)


def runs(dst: np.ndarray, lengths: np.ndarray, total: int) -> np.ndarray:
    """i64[2n + 1] run lengths of a flat buffer: gap, piece 0, gap, piece 1, ..., tail gap.

    `dst` / `lengths` are the pieces' flat starts and lengths, in increasing `dst` order.
    """
    n = lengths.size
    ends = dst + lengths
    out = np.empty(2 * n + 1, np.int64)
    out[0:-1:2] = dst - np.concatenate(([0], ends[:-1]))
    out[1::2] = lengths
    out[-1] = total - (int(ends[-1]) if n else 0)
    return out


def ids_and_positions_of_runs(run_lens: np.ndarray, slots: np.ndarray, seq_len: int):
    """Segment ids and positions (i32, flat) of `runs` whose pieces sit in `slots`."""
    run_ids = np.zeros(run_lens.size, np.int32)
    run_ids[1::2] = slots + 1
    seg_ids = np.repeat(run_ids, run_lens)
    # A padding run's "start" is pushed past its real start by at least its length, so its
    # positions come out negative and the clip at 0 zeroes them in one pass.
    run_starts = np.cumsum(run_lens) - run_lens
    run_starts[0::2] += max(seq_len, int(run_lens[0::2].max()))
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
    writer does) and readers call this to restore the contract's `[L]` arrays. Slots of length 0
    are ignored whatever their offset.
    """
    lengths = np.asarray(segment_lengths, np.int64)
    offsets = np.asarray(segment_offsets, np.int64)
    lead = lengths.shape[:-1]
    lengths = lengths.reshape(-1, lengths.shape[-1])
    offsets = offsets.reshape(lengths.shape)
    R = lengths.shape[0]
    rows, slots = np.nonzero(lengths > 0)  # row-major: slot order within each row
    lens = lengths[rows, slots]
    run_lens = runs(rows * seq_len + offsets[rows, slots], lens, R * seq_len)
    if lens.size and (run_lens.min() < 0 or (offsets[rows, slots] + lens > seq_len).any()) \
            or (lengths < 0).any():
        raise ValueError(
            "segment lengths/offsets negative, overlap, run backwards or past seq_len="
            f"{seq_len}: the row metadata is corrupt"
        )
    seg_ids, positions = ids_and_positions_of_runs(run_lens, slots, seq_len)
    shape = (*lead, seq_len)
    return seg_ids.reshape(shape), positions.reshape(shape)


def restore_derived(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Adds each packed feature's segment ids / positions where the row has none (in place).

    Storage (the offline writer) leaves them out: they are determined by the `[S]` metadata.
    """
    for f in packed_features(row):
        k = keys(f)
        if all(name in row for name in k.derived):
            continue
        ids, pos = segment_ids_and_positions(
            row[k.segment_lengths], row[k.segment_offsets], row[f].shape[-1])
        row.setdefault(k.segment_ids, ids)
        row.setdefault(k.positions, pos)
    return row
