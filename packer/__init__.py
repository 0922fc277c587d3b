"""seqpack's packer: plans packings on lengths alone and writes contract rows (pure numpy).

- `contract`: the packed-row contract (key names, dtypes, counters, derived arrays).
- `plan` / `plan_rows` (lengths only, per block past `DEFAULT_BLOCK_SIZE` examples) and the
  strategies; `StreamPlanner` / `pack_stream` online;
  `MultiStreamPlanner` for several features; `grain_fit` for Grain-exact bins.
- `assemble`: the one row writer (`build_rows`, `write_feature`); `pack_ragged` / `pack`.
- `stats`, `validate`.
"""

from seqpack.packer import contract
from seqpack.packer.assemble import assemble, build_rows, pack, pack_ragged
from seqpack.packer.config import Overflow, PackConfig, Strategy
from seqpack.packer.contract import Counters, FeatureKeys, segment_ids_and_positions
from seqpack.packer.inputs import InputError
from seqpack.packer.multi_stream import MultiStreamPlanner
from seqpack.packer.plan import PackPlan, RowAssignment, plan, plan_rows
from seqpack.packer.stats import PackingStats, lower_bound, stats
from seqpack.packer.stream import RowPlan, StreamPlanner, pack_stream
from seqpack.packer.validate import validate

__all__ = [
    "Counters",
    "FeatureKeys",
    "InputError",
    "MultiStreamPlanner",
    "Overflow",
    "PackConfig",
    "PackPlan",
    "PackingStats",
    "RowAssignment",
    "RowPlan",
    "Strategy",
    "StreamPlanner",
    "assemble",
    "build_rows",
    "contract",
    "lower_bound",
    "pack",
    "pack_ragged",
    "pack_stream",
    "plan",
    "plan_rows",
    "segment_ids_and_positions",
    "stats",
    "validate",
]
