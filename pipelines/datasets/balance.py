"""Balanced host batches online: each of a batch's N equal slices (one per local device) carries
near-equal work, so the devices of a step finish together.

A row's work is its cost under a cost model (`packer.CostModel`: per segment
c(l) = l * (1 + l / k), or tokens), not its token count. `BalanceRanks(N)` is a map over
batches: it reorders a `[B, ...]` batch by `packer.balance_slices(costs, N)`, a
permutation whose consecutive slices of B / N rows have near-equal total cost. It is a pure
function of the batch, so exact resume is untouched (a restored pipeline reorders the same
batches the same way). Worked example (B = 4, N = 2, costs of rows 0..3 = 9, 8, 1, 2)::

    in order          slices [9, 8] [1, 2]    totals 17, 3    max/mean 1.70
    balanced          slices [9, 1] [8, 2]    totals 10, 10   max/mean 1.00
    (permutation [0, 2, 1, 3]: device i takes slice i)

Use it in `make_training_pipeline(..., balance=Balance(ranks=N))`, or after any packer's batches:
``PackIterDataset(...).batch(B).map(BalanceRanks(N))``. A batch whose size N does not divide
(the last one under drop_remainder=False) passes unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from seqpack.packer.contract import keys
from seqpack.packer.order import CostModel, balance_slices
from seqpack.pipelines.datasets.columns import check_int, check_type


def row_costs(cost_model: CostModel, segment_lengths: np.ndarray) -> np.ndarray:  # f64[B]
    """Each row's cost: the sum of its segments' costs (`segment_lengths`: i32[B, S]; unused
    slots have length 0 and cost 0)."""
    lengths = np.asarray(segment_lengths)
    return cost_model.segment_costs(lengths.reshape(-1)).reshape(lengths.shape).sum(-1)


@dataclasses.dataclass(frozen=True)
class BalanceRanks:
    """Reorders a batch so its `ranks` equal slices carry near-equal cost (module docstring)."""

    ranks: int
    feature: str = "tokens"
    cost_model: CostModel | None = None  # None: CostModel() (attention, d_model 4096)

    def __post_init__(self) -> None:
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int) or self.ranks < 1:
            raise ValueError(f"ranks={self.ranks!r} must be a positive int")
        if self.cost_model is None:
            object.__setattr__(self, "cost_model", CostModel())

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        assert self.cost_model is not None
        lengths = batch[keys(self.feature).segment_lengths]  # [B, S]
        if lengths.shape[0] % self.ranks:  # a last, short batch (drop_remainder=False)
            return batch
        perm = np.asarray(balance_slices(row_costs(self.cost_model, lengths), self.ranks))
        return {k: v[perm] for k, v in batch.items()}


@dataclasses.dataclass(frozen=True)
class Balance:
    """The balance of `make_training_pipeline`'s host batches.

    ranks: N local devices: every host batch is reordered by `BalanceRanks(N)` (N must divide
           the batch size); None: batches keep the packer's order.
    cost:  the cost model of that (`packer.CostModel`; None: CostModel()).
    steps: a packed source balanced offline (`seqpack pack --data-parallel`): None follows its
           manifest, False reads it as plain rows, True requires a balanced manifest.
    """

    ranks: int | None = None
    cost: CostModel | None = None
    steps: bool | None = None

    def __post_init__(self) -> None:
        if self.ranks is not None:
            check_int("ranks", self.ranks, low=1)
        if self.cost is not None:
            check_type("cost", self.cost, CostModel, " (packer.CostModel) or None")
        if self.steps is not None:
            check_type("steps", self.steps, bool, " or None")
