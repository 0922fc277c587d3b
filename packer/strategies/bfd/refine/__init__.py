"""The refine steps: what improves a plan the passes left above its target.

- `repair`: empties the least-filled rows into the room the others have left (`in_groups` runs
  it, and the merge, on strided groups of rows of a large plan);
- `merge`: gathers room spread over many rows (and free slots) where the repair can use it;
- `sieve`: plans the loose rows again in windows of a seeded shuffle, as a stream would;
- `swap`: on small plans, empties rows by swaps of up to two pieces for two.

They work on (sizes, row per piece, rows) alone and import no pass: the schedule
(`bfd.schedule.refine`) decides their order and hands the sieve its window planner.
"""

from seqpack.packer.strategies.bfd.refine.merge import merge_repair
from seqpack.packer.strategies.bfd.refine.repair import in_groups, repair
from seqpack.packer.strategies.bfd.refine.sieve import (
    Planner,
    keep_open,
    sieve,
    sieve_all,
    sieve_window,
)
from seqpack.packer.strategies.bfd.refine.swap import swap_search

__all__ = [
    "Planner",
    "in_groups",
    "keep_open",
    "merge_repair",
    "repair",
    "sieve",
    "sieve_all",
    "sieve_window",
    "swap_search",
]
