"""Online packing of examples with several features (e.g. inputs + targets), lengths only.

A row has one capacity per feature and takes an example only if every feature fits (and a
segment slot is free). Per window, examples are sorted by their normalized size
`sum_f size_f / capacity_f` (largest first) and each goes to the open row that it leaves with the
least normalized room; otherwise a new row opens. Rows are emitted as in `packer.StreamPlanner`:
when a feature is full or every slot is used, after `max_carry` windows, or the fullest first
when more than `max_open_rows` are open. The example's slot is the same in every feature.

Worked example (capacities inputs 8 / targets 4, max_segments 4, one window)::

    example:   e0 (5, 2)   e1 (3, 1)   e2 (2, 3)
    norm size: 1.125       0.625       1.0           order: e0, e2, e1
    e0 -> row 0 (room 3, 2); e2 does not fit row 0 (targets 3 > 2) -> row 1 (room 6, 1);
    e1 fits both; leaves row 0 with 0/8 + 1/4 = 0.25, row 1 with 3/8 + 0/4 = 0.375 -> row 0
    row 0: inputs full -> emitted [e0, e1]; row 1 carried over

Overflow: "error", "truncate" (each feature cut to its capacity) or "drop"; "split" needs a single
feature. Examples with no tokens are skipped and counted in `empty_examples`; an example with an
empty feature but tokens in another is dropped (no segment holds an empty feature), its tokens
counted in `dropped_examples` / `dropped_tokens`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from seqpack.packer.contract import Counters
from seqpack.packer.inputs import InputError, check_count
from seqpack.packer.online.state_codec import encode_planner_state
from seqpack.packer.plan import aligned


class MultiStreamPlanner:
    """Lengths-only online planner for several features; deterministic and restorable."""

    def __init__(
        self,
        features: tuple[str, ...],
        capacities: tuple[int, ...],
        *,
        max_segments: int,
        alignment: int = 1,
        overflow: str = "error",
        window: int = 1024,
        max_open_rows: int | None = None,
        max_carry: int = 8,
    ):
        if overflow not in ("error", "truncate", "drop"):
            raise ValueError(
                f"{overflow=} is not supported with several features; use 'error', 'truncate' "
                "or 'drop' ('split' needs a single feature)"
            )
        window = check_count("window", window, 1)
        self.features = features
        self.caps = np.asarray(capacities, np.int64)
        self.max_segments = max_segments
        self.alignment = alignment
        self.overflow = overflow
        self.max_open_rows = window if max_open_rows is None else \
            check_count("max_open_rows", max_open_rows, 0)
        self.max_carry = check_count("max_carry", max_carry, 0)
        self._rows: list[dict[str, Any]] = []  # open rows, oldest first
        self._windows = 0
        self.counters = Counters()

    def _aligned(self, lengths: np.ndarray) -> np.ndarray:
        return aligned(lengths, self.alignment)

    def add(self, ids: list[int], lengths: np.ndarray) -> list[list[tuple]]:
        """Plans one window; lengths is i64[n, F]. Returns the final rows (pieces per row)."""
        lengths = np.asarray(lengths, np.int64).reshape(len(ids), self.caps.size)
        c = {"num_examples": len(ids), "input_tokens": int(lengths.sum())}
        over = lengths > self.caps
        bad = over.any(axis=1)
        if bad.any():
            i = int(np.argmax(bad))
            f = int(np.argmax(over[i]))
            if self.overflow == "error":
                raise InputError(
                    f"example {ids[i]} has {self.features[f]} length {int(lengths[i, f])} > "
                    f"{int(self.caps[f])}; pass overflow='truncate' or 'drop', or raise the length"
                )
            if self.overflow == "truncate":
                c["truncated_examples"] = int(bad.sum())
                c["truncated_tokens"] = int((lengths - self.caps).clip(0).sum())
                lengths = np.minimum(lengths, self.caps)
            else:
                c["dropped_examples"] = int(bad.sum())
                c["dropped_tokens"] = int(lengths[bad].sum())
        keep = ~bad if self.overflow == "drop" else np.ones(len(ids), bool)
        empty = keep & (lengths == 0).any(axis=1)  # no segment can hold an empty feature
        partial = empty & (lengths > 0).any(axis=1)  # its other features' tokens are dropped
        c["empty_examples"] = int((empty & ~partial).sum())
        c["dropped_examples"] = c.get("dropped_examples", 0) + int(partial.sum())
        c["dropped_tokens"] = c.get("dropped_tokens", 0) + int(lengths[partial].sum())
        self.counters = self.counters + Counters(**c)
        keep &= ~empty
        sizes = self._aligned(lengths)
        norm = (sizes / self.caps).sum(axis=1)
        order = [i for i in np.argsort(-norm, kind="stable").tolist() if keep[i]]
        for i in order:
            self._place(int(ids[i]), lengths[i], sizes[i])
        self._windows += 1
        return self._emit(final_only=True)

    def reopen(self, ids: list[int], lengths: np.ndarray) -> None:
        """Places pieces planned elsewhere (i64[n, F] lengths, each within capacity) into the
        open rows, largest first, uncounted (a restore on another layout: their examples were
        counted where they were read); the next `add` emits the rows they fill."""
        lengths = np.asarray(lengths, np.int64).reshape(len(ids), self.caps.size)
        sizes = self._aligned(lengths)
        for i in np.argsort(-(sizes / self.caps).sum(axis=1), kind="stable").tolist():
            self._place(int(ids[i]), lengths[i], sizes[i])

    def _place(self, ident: int, length: np.ndarray, size: np.ndarray) -> None:
        rows = self._rows
        if rows:
            room = np.stack([r["room"] for r in rows])  # [R, F]
            count = np.fromiter((len(r["pieces"]) for r in rows), np.int64, len(rows))
            fits = (room >= size).all(axis=1) & (count < self.max_segments)
            if fits.any():
                left = ((room - size) / self.caps).sum(axis=1)
                left[~fits] = np.inf
                r = rows[int(np.argmin(left))]
                r["room"] = r["room"] - size
                r["pieces"].append((ident, *length.tolist()))
                return
        rows.append(
            {"born": self._windows, "room": self.caps - size,
             "pieces": [(ident, *length.tolist())]}
        )

    def finish(self) -> list[list[tuple]]:
        """Emits every open row (end of stream)."""
        return self._emit(final_only=False)

    def _emit(self, *, final_only: bool) -> list[list[tuple]]:
        rows = self._rows
        if not final_only:
            done = list(range(len(rows)))
        else:
            oldest = self._windows - self.max_carry
            done = [
                k for k, r in enumerate(rows)
                if len(r["pieces"]) >= self.max_segments or (r["room"] == 0).any()
                or r["born"] < oldest
            ]
            excess = len(rows) - len(done) - self.max_open_rows
            if excess > 0:
                taken = set(done)
                rest = [k for k in range(len(rows)) if k not in taken]
                rest.sort(key=lambda k: (float((rows[k]["room"] / self.caps).sum()), k))
                done = sorted(done + rest[:excess])
        taken = set(done)
        out = [sorted(rows[k]["pieces"]) for k in done]
        self._rows = [r for k, r in enumerate(rows) if k not in taken]
        return out

    def oldest_open_id(self) -> int | None:
        ids = [p[0] for r in self._rows for p in r["pieces"]]
        return min(ids) if ids else None

    def open_ids(self) -> set[int]:
        return {p[0] for r in self._rows for p in r["pieces"]}

    def get_state(self) -> dict[str, Any]:
        return {
            "windows": self._windows,
            "rows": [{"born": r["born"], "pieces": [list(p) for p in r["pieces"]]}
                     for r in self._rows],
            "counters": self.counters.to_dict(),
        }

    def snapshot(self) -> Callable[[], dict[str, Any]]:
        """The state as it is now, encoded (`state_codec`) when called (as
        `StreamPlanner.snapshot`)."""
        state = self.get_state()
        return lambda: encode_planner_state(state)

    def set_state(self, state: dict[str, Any]) -> None:
        self._windows = int(state["windows"])
        self.counters = Counters(**{k: int(v) for k, v in state["counters"].items()})
        self._rows = []
        for r in state["rows"]:
            pieces = [tuple(int(x) for x in p) for p in r["pieces"]]
            used = self._aligned(np.asarray([p[1:] for p in pieces], np.int64)).sum(axis=0)
            self._rows.append({"born": int(r["born"]), "room": self.caps - used,
                               "pieces": pieces})
