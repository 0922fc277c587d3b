"""Steps that improve a plan the passes have made: `improve` runs them on the offline default's
plan while it is above its target.

- `repair`: empties the least-filled rows into the room the others have left;
- `merge`: gathers room spread over many rows (and free slots) where the repair can use it;
- `sieve`: plans the loose rows again in windows of a seeded shuffle;
- `swap`: on small plans, empties rows by swaps of up to two pieces for two.

They work on (sizes, row per piece, rows) alone and import none of the passes: the passes
(`strategies.best_fit_decreasing`) and `StreamPlanner` call them, and hand the sieve its
window planner.
"""
