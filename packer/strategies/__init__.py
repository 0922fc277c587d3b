"""Packing strategies: each assigns pieces (by aligned size alone) to rows.

Every strategy has the same signature::

    assign(sizes, capacity, max_segments) -> (rows, num_rows)

`sizes` are the pieces' sizes already rounded up to the segment alignment (a piece of 5 tokens with
alignment 4 occupies 8), `capacity` is seq_len, and `rows[i]` is the row piece i goes to. A row's
sizes never sum past `capacity` and no row holds more than `max_segments` pieces. `concat_split`
cuts examples itself and so has its own entry point. The offline default, best fit decreasing,
is a wing of its own (`bfd/`); the others are one module each.
"""

from seqpack.packer.strategies.best_fit import BestFitBins, assign_best_fit
from seqpack.packer.strategies.bfd import assign_best_fit_decreasing, keep_open
from seqpack.packer.strategies.concat_split import concat_split_pieces
from seqpack.packer.strategies.first_fit import assign_first_fit

__all__ = [
    "BestFitBins",
    "assign_best_fit",
    "assign_best_fit_decreasing",
    "assign_first_fit",
    "concat_split_pieces",
    "keep_open",
]
