"""What binds a plan, decided once; and the helpers the offline default's modules share.

A row has two limits, `capacity` tokens and `max_segments` slots, and which one binds decides
every step of the offline default: its deals, its passes and their order, its refine steps.
`Regime.of` answers that once from the pieces' sizes (largest first) and the schedule hands the
answer down; no step asks again. The thresholds are measured (docs/offline_default.md).

Worked example (capacity 10, max_segments 2; sizes 6 5 2 1 1)::

    tokens 15, pieces 5: token bound 2, slot bound 3, the tight bound 3 (6 and 5 cannot share)
    slot share 3 / 2 = 1.5 (>= 0.9: the slots bind for the whole corpus)
    two-dimensional: the 3 smallest pieces (1 1 2) fit a row, so a row can run out of slots
    big: one piece over L/2 (the 6), in a third of the bound's rows (>= 1/4: worst fit into
    the bound's rows runs last)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from seqpack.packer.bounds import (
    SLOTS_BIND_ALL,
    SLOTS_BIND_HALF,
    slot_share,
    slots_can_bind,
    sorted_lower_bound,
)

TWO_POOL_FIRST = 0.15  # from this slot share on the two-pool pass runs before plain BFD
BIG_ROWS = 0.25  # worst fit into the bound's rows where pieces over L/2 are in this share of them


@dataclasses.dataclass(frozen=True)
class Regime:
    """Which limit binds a plan of `pieces` pieces of `tokens` tokens in all (see `of`)."""

    capacity: int
    max_segments: int
    pieces: int
    tokens: int
    bound: int  # the tight lower bound on the rows (`bounds.sorted_lower_bound`)
    slot_share: float  # the slot bound over the token bound (`bounds.slot_share`)
    two_dimensional: bool  # a row can run out of slots before tokens (`bounds.slots_can_bind`)
    big_pieces: int  # pieces over capacity / 2: no two share a row

    @classmethod
    def of(cls, sizes_desc: np.ndarray, capacity: int, max_segments: int) -> Regime:
        """The regime of pieces with these sizes (i64[n], sorted largest first, n >= 1)."""
        asc = sizes_desc[::-1]
        n, tokens = int(sizes_desc.size), int(sizes_desc.sum())
        return cls(capacity, max_segments, n, tokens,
                   sorted_lower_bound(asc, capacity, max_segments),
                   slot_share(n, tokens, capacity, max_segments),
                   slots_can_bind(asc, capacity, max_segments),
                   big_pieces(sizes_desc, capacity))

    @property
    def slots_bind_all(self) -> bool:
        """The slots bind for the whole corpus (worst fit runs; only the repair refines)."""
        return self.slot_share >= SLOTS_BIND_ALL

    @property
    def slots_bind_half(self) -> bool:
        """Slots and tokens bind about alike (a stream's window is repaired)."""
        return self.slot_share >= SLOTS_BIND_HALF

    @property
    def two_pool_first(self) -> bool:
        """The two-pool pass runs before plain BFD."""
        return self.slot_share >= TWO_POOL_FIRST

    @property
    def big(self) -> bool:
        """Pieces over L/2 are in a quarter of the bound's rows where slots bind about alike:
        worst fit into the bound's rows runs as the last pass."""
        return self.slots_bind_half and self.big_pieces >= BIG_ROWS * self.bound

    @property
    def slot_bound(self) -> int:
        """ceil(n / S): the rows the slots alone need."""
        return -(-self.pieces // self.max_segments)

    @property
    def pieces_per_row(self) -> float:
        """The pieces a row takes: S, or L tokens at the mean piece where that is fewer."""
        return min(self.max_segments, self.capacity * self.pieces / max(1, self.tokens))

    @property
    def slots_over_tokens(self) -> bool:
        """The slots bind more than the tokens: n / S > T / L."""
        return self.pieces * self.capacity > self.tokens * self.max_segments


def gate(bound: int) -> int:
    """The most rows a pass may leave before the next one runs: the bound + 0.05%, at least
    + 1 (one row on a plan of fewer than 2,000)."""
    return bound + max(1, bound // 2000)


def repair_target(bound: int) -> int:
    """The rows the refine steps work down to: the bound + 0.1%, at least + 1."""
    return bound + max(1, bound // 1000)


def big_pieces(sizes_desc: np.ndarray, capacity: int) -> int:
    """How many of the pieces are over capacity / 2: no two of them share a row."""
    return int(np.count_nonzero(sizes_desc > capacity // 2))


def room_count(sizes: np.ndarray, rows: np.ndarray, num_rows: int, capacity: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """(room, pieces) per row of the plan, both i64[num_rows]."""
    room = capacity - np.bincount(rows, weights=sizes, minlength=num_rows).astype(np.int64)
    return room, np.bincount(rows, minlength=num_rows).astype(np.int64)


def by_row(rows: np.ndarray, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The plan's pieces per row as CSR: row r holds pieces[start[r] : start[r + 1]]."""
    pieces = np.argsort(rows, kind="stable")
    return pieces, np.searchsorted(rows[pieces], np.arange(num_rows + 1))
