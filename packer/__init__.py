"""seqpack's packer: plans packings on lengths alone and writes contract rows (pure numpy).

- `contract`: the packed-row contract (key names, dtypes, counters, derived arrays).
- `plan` / `plan_rows` (lengths only, per block past `DEFAULT_BLOCK_SIZE` examples) and the
  `strategies` (the offline default, best fit decreasing, in its own wing: `strategies.bfd`).
- `assemble`: the one row writer (`build_rows`, `write_feature`); `pack_ragged` / `pack`.
- `online`: `StreamPlanner` / `pack_stream`, `MultiStreamPlanner` for several features, Grain-exact
  bins (`online.grain_fit`).
- `order`: the one ordering stage (`RowOrder`: shuffle, plan or balanced steps), the rows' cost
  (`CostModel`) and the steps' balance (`step_balance`, `balance_slices`).
- `stats`, `validate`, `bounds.tight_lower_bound`.
- `context_parallel_order`: TransformerEngine's load-balanced layout of rows packed with
  `PackConfig(context_parallel=C)` (or its `layout="rotated"` variant), and each rank's
  attention work under it (`rank_work`).
"""

from seqpack.packer import contract
from seqpack.packer.assemble import assemble, build_rows, pack, pack_ragged
from seqpack.packer.bounds import tight_lower_bound
from seqpack.packer.config import Overflow, PackConfig, Strategy
from seqpack.packer.context_parallel import context_parallel_order, rank_work
from seqpack.packer.contract import Counters, FeatureKeys, segment_ids_and_positions
from seqpack.packer.inputs import InputError
from seqpack.packer.online import MultiStreamPlanner, RowPlan, StreamPlanner, pack_stream
from seqpack.packer.order import (
    BlockLayout,
    CostKind,
    CostModel,
    GlobalOrder,
    OrderMode,
    Permutation,
    RowOrder,
    balance_slices,
    block_layout,
    global_order,
    ordered,
    step_balance,
)
from seqpack.packer.plan import PackPlan, RowAssignment, plan, plan_rows
from seqpack.packer.stats import CostSummary, PackingStats, cost_summary, lower_bound, stats
from seqpack.packer.validate import validate

__all__ = [
    "BlockLayout",
    "CostKind",
    "CostModel",
    "CostSummary",
    "Counters",
    "FeatureKeys",
    "GlobalOrder",
    "InputError",
    "MultiStreamPlanner",
    "OrderMode",
    "Overflow",
    "PackConfig",
    "PackPlan",
    "PackingStats",
    "Permutation",
    "RowAssignment",
    "RowOrder",
    "RowPlan",
    "Strategy",
    "StreamPlanner",
    "assemble",
    "balance_slices",
    "block_layout",
    "build_rows",
    "context_parallel_order",
    "contract",
    "cost_summary",
    "global_order",
    "lower_bound",
    "ordered",
    "pack",
    "pack_ragged",
    "pack_stream",
    "plan",
    "plan_rows",
    "rank_work",
    "segment_ids_and_positions",
    "stats",
    "step_balance",
    "tight_lower_bound",
    "validate",
]
