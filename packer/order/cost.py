"""What a packed row costs to train on: per segment c(l) = l * (1 + l / k), summed over the row.

A transformer layer spends, per token, the dense work of its projections and MLP, and per
segment the attention between the segment's tokens (segment-aware attention never looks across
segments). With model width `d` (`d_model`), a 4d-wide MLP and causal attention, in FLOPs:

    dense:      QKV + output projections 4 d^2, MLP 8 d^2 multiply-adds per token
                -> 2 * 12 d^2 = 24 d^2 l                                  for l tokens
    attention:  Q K^T and A V, d multiply-adds per (query, key) pair, l^2 / 2 pairs (causal)
                -> 2 * 2 * d * l^2 / 2 = 2 d l^2
    total:      24 d^2 l + 2 d l^2  =  24 d^2 * l * (1 + l / (12 d))

so up to the constant 24 d^2 a segment costs c(l) = l * (1 + l / k) with k = 12 * d_model: a
token-count that grows with the segment's length, doubling at l = k (49,152 for d = 4096). A
gated MLP of width 8d/3 (SwiGLU) has the same 8 d^2; grouped-query attention makes the
projections a little cheaper (k a little smaller). veRL's 7B model, 24576 * l + l^2, is this
model with k = 24576 (attention counted non-causal): `CostModel(d_model=2048)`. With
`CostKind.TOKENS` a segment costs its length, c(l) = l.

Worked example (d_model 4096, so k = 49152)::

    row of one 8192-token segment:        8192 * (1 + 8192 / 49152)   = 9557.3
    row of 40 segments of 200 tokens:     40 * 200 * (1 + 200 / 49152) = 8032.6
    attention alone, sum of l^2:          67,108,864 against 1,600,000: 42 times more
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from seqpack.packer.config import enum_value


class CostKind(enum.StrEnum):
    """How a segment's length turns into work."""

    ATTENTION = "attention"  # c(l) = l * (1 + l / (12 * d_model)): dense layers + attention
    TOKENS = "tokens"  # c(l) = l


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Per-segment cost c(l); see the module docstring. `to_dict` goes into the manifest."""

    kind: CostKind | str = CostKind.ATTENTION
    d_model: int = 4096

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", enum_value(CostKind, "kind", self.kind))
        d = self.d_model
        if isinstance(d, bool) or not isinstance(d, int | np.integer) or d < 1:
            raise ValueError(f"d_model={d!r} must be an int >= 1 (the model's hidden width)")
        object.__setattr__(self, "d_model", int(d))

    @property
    def k(self) -> float:
        """The length at which a segment's attention costs as much as its dense layers."""
        return 12.0 * self.d_model

    def segment_costs(self, lengths: object) -> np.ndarray:
        """f64[n]: c(l) of each segment length."""
        arr = np.asarray(lengths, np.float64)
        if self.kind is CostKind.TOKENS:
            return arr.copy()
        return arr * (1.0 + arr / self.k)

    def row_costs(self, row: object, length: object, num_rows: int) -> np.ndarray:
        """f64[num_rows]: each row's cost, from its pieces given as (row index, length) arrays
        (any order; a plan's `row` / `length`)."""
        row = np.asarray(row, np.int64)
        if row.size and (row.min() < 0 or row.max() >= num_rows):
            raise ValueError(f"row indices must lie in [0, {num_rows}), got "
                             f"[{int(row.min())}, {int(row.max())}]")
        return np.bincount(row, weights=self.segment_costs(length), minlength=num_rows)

    def full_row_cost(self, seq_len: int) -> float:
        """The most a row of seq_len tokens can cost: one segment of seq_len (c is convex)."""
        return float(self.segment_costs([seq_len])[0])

    def to_dict(self) -> dict:
        return {"kind": str(self.kind), "d_model": self.d_model}

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        unknown = set(d) - {"kind", "d_model"}
        if unknown:
            raise ValueError(f"unknown cost model fields {sorted(unknown)}; expected kind, d_model")
        return cls(**d)
