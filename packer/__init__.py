"""seqpack's packer: plans packings on lengths alone and assembles contract rows (pure numpy)."""

from seqpack.packer.assemble import (
    assemble,
    build_rows,
    pack,
    pack_ragged,
    segment_ids_and_positions,
    segment_metadata,
)
from seqpack.packer.config import Overflow, PackConfig, Strategy
from seqpack.packer.plan import Counters, PackPlan, plan
from seqpack.packer.stats import PackingStats, lower_bound, stats
from seqpack.packer.stream import RowPlan, StreamPlanner, pack_stream
from seqpack.packer.validate import validate

__all__ = [
    "Counters",
    "Overflow",
    "PackConfig",
    "PackPlan",
    "PackingStats",
    "RowPlan",
    "Strategy",
    "StreamPlanner",
    "assemble",
    "build_rows",
    "lower_bound",
    "pack",
    "pack_ragged",
    "pack_stream",
    "plan",
    "segment_ids_and_positions",
    "segment_metadata",
    "stats",
    "validate",
]
