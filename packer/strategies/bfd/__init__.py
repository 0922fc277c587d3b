"""Best fit decreasing, the offline default: near-optimal rows in tokens and segment slots.

A wing of its own: `schedule` says which step runs when (the deal, the passes, the refine
steps), `regime` decides once which limit binds and holds the helpers the modules share, and
beside them the steps: `deal` (into the tight bound's rows), `greedy` (plain BFD by runs, worst
fit), `two_pool` (slot-aware BFD, over `sorted_keys`), `fill` (row-by-row exact fills) and
`refine/` (repair, merge, sieve, swap). What each step is for and what it gained, measured:
docs/offline_default.md.

Public: `assign_best_fit_decreasing` (the strategy), `keep_open` (the rows a stream's window
keeps open, as the sieve keeps them), `gate` and `repair_target` (the plan's marks).
"""

from seqpack.packer.strategies.bfd.refine import keep_open
from seqpack.packer.strategies.bfd.regime import gate, repair_target
from seqpack.packer.strategies.bfd.schedule import assign_best_fit_decreasing

__all__ = ["assign_best_fit_decreasing", "gate", "keep_open", "repair_target"]
