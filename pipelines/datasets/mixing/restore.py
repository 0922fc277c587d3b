"""Restoring `PackIterDataset` over a `Mixture` from (dataset, index) references, and, under
edited weights, planning the pieces not yet emitted again with the new stage's draws.

`RestoreRefs` is a part of `PackIterator` (pack.py): the state names the examples the packer
held; they are fetched from the mixture, never replayed. Under edited weights the rows of the
window in flight that had not left and the open rows go back to the planner as waiting pieces;
the mixture's new stage counts them as drawn in it (`MixtureIterator.hold_back`), so the rule
draws what makes up for them, and windows are read until they fit the new weights (at most
`MAX_SPREAD` times their units) and planned with them as one window, whose rows leave in the
order that keeps the shares: the first batches hold the new weights too (docs/mixing.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from seqpack.pipelines.datasets.layouts import SingleLayout, gather
from seqpack.pipelines.datasets.mixing.refs import decode_refs

# A restore under edited weights reads at most this many times the units held back before
# planning them again with the new draws.
MAX_SPREAD = 8


class RestoreRefs:
    """`PackIterator`'s restore over a mixture (uses its attributes; see pack.py)."""

    _ds: Any
    _parent: Any
    _layout: Any
    _held: dict[str, dict[int, list]]
    _refs: Any
    _next_id: int
    _exhausted: bool
    _plan: Any
    _order: list[int] | None
    _num_rows: int
    _planner_state: Any
    _oldest: int | None
    _as_tokens: Any
    _fit_column: Any
    _stage: Any
    _read_window: Any
    _cuts: list[int]

    def _restore_refs(self, state: dict[str, Any]) -> bool:
        """Fetches the referenced examples from the mixture and re-plans the window that was
        leaving (nothing replayed: the mixture goes on from its restored positions). Under
        edited weights, also `_replan`: True when it did."""
        ds, parent = self._ds, self._parent
        ids, dataset, index = decode_refs(state["refs"])
        self._refs.put_ids(ids, dataset, index)
        elements = [parent.fetch(int(d), int(i)) for d, i in zip(dataset, index)]
        by_id = dict(zip(ids.tolist(), elements))
        for n in ds.names:
            col = [self._as_tokens(e[n], int(j), n) for j, e in zip(ids.tolist(), elements)]
            self._fit_column(col, n, 0)
            for j, v in zip(ids.tolist(), col):
                held = self._held[n].setdefault(j // ds.window, [None] * ds.window)
                held[j % ds.window] = v
        self._next_id = int(state["next_id"])
        window_first = int(state["window_first"])
        if state["phase"] == "finish":
            self._exhausted = True
            self._stage(None)
            return False
        window_ids = list(range(window_first, self._next_id))
        kept = {n: dict(h) for n, h in self._held.items()}, dict(self._refs.windows)
        self._cuts = [int(c) for c in state.get("cuts", [])]  # planned in parts again
        self._stage((window_ids, {n: gather(self._held[n], window_ids, ds.window)
                                  for n in ds.names}))
        if not (parent.reweighted and isinstance(self._layout, SingleLayout)):
            return False
        self._held, self._refs.windows = kept  # the rows not emitted are planned again
        self._replan(int(state["emitted"]), by_id,
                     ref_of=dict(zip(ids.tolist(), zip(dataset.tolist(), index.tolist()))))
        return True

    def _replan(self, emitted: int, elements: dict[int, Any],
                ref_of: dict[int, tuple[int, int]]) -> None:
        """Under edited weights: the pieces not yet emitted (the staged window's rows after
        the first `emitted`, and the open rows) are planned again with the new draws (see
        the module docstring)."""
        ds, parent, plan = self._ds, self._parent, self._plan
        rows = (list(range(self._num_rows)) if self._order is None else self._order)[emitted:]
        bounds = plan.row_slices()
        sel = np.concatenate([np.zeros(0, np.int64), *(np.arange(bounds[r], bounds[r + 1])
                                                       for r in rows)])
        waiting = self._layout.planner.reopen(plan.example[sel], plan.start[sel],
                                              plan.length[sel])
        self._planner_state = self._layout.planner.snapshot()
        self._oldest = self._layout.planner.oldest_open_id()
        units = [0] * len(parent.names)
        for i, length in zip(waiting[:, 0].tolist(), waiting[:, 2].tolist()):
            d, index = ref_of[i]
            u, tokens = parent.units(d, index, elements[i])
            units[d] += round(u * length / tokens) if tokens else u
        need = parent.hold_back(units, len(set(waiting[:, 0].tolist())))
        need = min(need, MAX_SPREAD * sum(units))
        ids: list[int] = []
        cols: dict[str, list] = {n: [] for n in ds.names}
        while not self._exhausted:
            got, c = self._read_window()
            ids += got
            for n in ds.names:
                cols[n] += c[n]
            if parent.stage_units() >= need:
                break
        self._stage((ids, cols) if ids else None)
