"""The online planners: streams of examples packed window by window with bounded memory.

- `stream`: `StreamPlanner` (one packed feature; the offline default per window, rows kept
  open across windows) and `RowPlan`; `pack_stream`: the whole online packer over token arrays.
- `multi_stream`: `MultiStreamPlanner` (several features sharing one segment layout).
- `grain_fit`: bins that pack exactly as Grain's first fit / best fit packers do (the drop-ins).
- `state_codec`: the planners' compact checkpoint state.
"""

from seqpack.packer.online.grain_fit import BatchSpec, FitBatch, element_dtypes
from seqpack.packer.online.multi_stream import MultiStreamPlanner
from seqpack.packer.online.pack_stream import pack_stream
from seqpack.packer.online.state_codec import decode_planner_state
from seqpack.packer.online.stream import RowPlan, StreamPlanner

__all__ = [
    "BatchSpec",
    "FitBatch",
    "MultiStreamPlanner",
    "RowPlan",
    "StreamPlanner",
    "decode_planner_state",
    "element_dtypes",
    "pack_stream",
]
