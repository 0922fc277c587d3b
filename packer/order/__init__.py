"""The ordering stage: output order of packed rows, balanced steps, and the rows' cost.

- `row_order`: `RowOrder` (shuffle, plan or balanced data-parallel steps) and its two levels,
  `block_layout` per block of plan rows and `global_order` over the blocks' summaries.
- `cost`: `CostModel`, a row's work c(l) = l (1 + l / k) per segment (or its tokens).
- `balance`: `StepBalance` (the metric of balanced steps), `balance_slices`, `step_balance`.
- `permute`: `Permutation`, a seeded permutation evaluated per index (a Feistel network).
"""

from seqpack.packer.order.balance import StepBalance, balance_slices, step_balance
from seqpack.packer.order.cost import CostKind, CostModel
from seqpack.packer.order.permute import Permutation
from seqpack.packer.order.row_order import (
    BlockLayout,
    GlobalOrder,
    OrderMode,
    RowOrder,
    block_layout,
    global_order,
    ordered,
)

__all__ = [
    "BlockLayout",
    "CostKind",
    "CostModel",
    "GlobalOrder",
    "OrderMode",
    "Permutation",
    "RowOrder",
    "StepBalance",
    "balance_slices",
    "block_layout",
    "global_order",
    "ordered",
    "step_balance",
]
