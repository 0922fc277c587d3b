"""The two planning back ends of `PackIterDataset`: one packed feature, or several.

Both turn a window of held examples into contract rows and expose the same small interface:
`lengths(elements)`, `add(ids, lengths)`, `finish()`, `build(plan, held)`, state and counters.

- `SingleLayout`: `packer.StreamPlanner` (best fit decreasing over windows, overflow incl.
  split) and `packer.build_rows` for the token rows.
- `MultiLayout`: `packer.MultiStreamPlanner`; every feature gets its own segment metadata,
  the example's slot is shared.

`Window` holds the streaming packer's knobs; `pack_configs` checks one `PackConfig` per feature.

Columns (labels, masks, other per-token values; `columns.py`) ride on a host feature: same
length per example, the host's offsets, padded with their own pad, no metadata of their own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from seqpack import packer
from seqpack.packer import MultiStreamPlanner
from seqpack.packer.assemble import fill_rows, source_arrays, write_feature
from seqpack.packer.plan import order_pieces
from seqpack.pipelines.datasets.columns import check_int, check_type

MIXED_OPEN_ROWS = 2  # Window.open_rows over a mixture (benchmarks/README: Mixtures (online))


def plan_cut(layout: SingleLayout | MultiLayout, ids: list[int], lengths: Any,
             cuts: list[int]) -> tuple[Any, list[int]]:
    """(plan, rows per part) of a window cut before the positions `cuts` (a mixture's stage
    ends there: a dataset left, or a schedule's next stage began): each part but the last is
    planned with what the planner holds and emitted whole (flushed), so no row mixes two
    stages' draws."""
    plans, rows, at = [], [], 0
    for end in [*sorted(min(max(c, 0), len(ids)) for c in cuts), None]:
        part = slice(at, end)
        if end is None and at == len(ids) and plans:
            break  # nothing after the last cut
        plan = layout.add(ids[part], lengths[part], flush=end is not None)
        plans.append(plan)
        rows.append(plan.num_rows if isinstance(plan, packer.PackPlan) else len(plan))
        at = len(ids) if end is None else end
    return layout.join(plans), rows


def gather(held: dict[int, list], ids: list[int], window: int) -> list[Any]:
    """Values of example `ids` from `held` (window number -> that window's values)."""
    return [held[i // window][i % window] for i in ids]


class SingleLayout:
    """One packed feature via `packer.StreamPlanner`."""

    def __init__(self, config: packer.PackConfig, *, window: int, meta: dict[str, str],
                 pads: dict[str, int], window_rows: int = 128, open_rows: int | None = None):
        self.config = config
        self.feature = config.feature
        self.meta = list(meta)  # all hosted by `feature`
        self.pads = pads
        self.planner = packer.StreamPlanner(config, window=window, window_rows=window_rows,
                                            max_open_rows=open_rows)

    def window_lengths(self, cols: dict[str, list[Any]]) -> list[int]:
        return [len(v) for v in cols[self.feature]]

    def add(self, ids: list[int], lengths: list[int], flush: bool = False) -> packer.PackPlan:
        return self.planner.add_plan(ids, lengths, flush=flush)

    @staticmethod
    def join(plans: list[packer.PackPlan]) -> packer.PackPlan:
        """The plans' rows as one plan, in order."""
        if len(plans) == 1:
            return plans[0]
        first = np.cumsum([0, *(p.num_rows for p in plans[:-1])])
        cat = lambda f: np.concatenate([getattr(p, f) for p in plans])  # noqa: E731
        return packer.PackPlan(cat("example"), cat("start"), cat("length"),
                               np.concatenate([p.row + f for p, f in zip(plans, first)]),
                               cat("slot"), cat("offset"), sum(p.num_rows for p in plans),
                               sum((p.counters for p in plans[1:]), plans[0].counters))

    def finish(self) -> packer.PackPlan:
        return self.planner.finish_plan()

    def build(self, plan: packer.PackPlan, held: dict[str, dict[int, list]], window: int,
              dtypes: dict[str, np.dtype]) -> dict:
        """Contract rows `[R, L]` / `[R, S]` (+ meta `[R, L]`) for the plan's rows; `dtypes`
        holds the run's dtype of each name (values already cast to it)."""
        ex, st, ln = plan.example.tolist(), plan.start.tolist(), plan.length.tolist()
        tokens = gather(held[self.feature], ex, window)
        pieces = [v[s : s + m] for v, s, m in zip(tokens, st, ln, strict=True)]
        batch = packer.build_rows(pieces, plan, self.config,
                                  dtype=dtypes.get(self.feature, np.int32))
        for name in self.meta:
            col = gather(held[name], ex, window)
            mp = [v[s : s + m] for v, s, m in zip(col, st, ln, strict=True)]
            batch[name] = fill_rows(mp, plan, self.config.seq_len,
                                    dtype=dtypes.get(name, np.int32), pad=self.pads[name])
        return batch

    def open_ids(self, state: dict) -> set[int]:
        return {int(p[0]) for row in state["rows"] for p in row["pieces"]}

    @staticmethod
    def pieces(plan: packer.PackPlan) -> np.ndarray:
        """i64[P, 4]: (row, id, start, length) of every piece of the plan's rows."""
        return np.stack([plan.row, plan.example, plan.start, plan.length], 1).astype(np.int64)

    @staticmethod
    def open_pieces(state: dict) -> np.ndarray:
        """i64[P, 3]: (id, start, length) of the pieces a planner state holds open or waiting."""
        out = [p[:3] for row in state["rows"] for p in row["pieces"]]
        return np.asarray(out, np.int64).reshape(len(out), 3)

    def reopen(self, pieces: np.ndarray) -> None:
        """Pieces (i64[P, 3]: id, start, length) of rows planned elsewhere, as waiting to be
        planned with the next window (uncounted: their examples were counted when read)."""
        self.planner.reopen(pieces[:, 0], pieces[:, 1], pieces[:, 2])

    def counters(self) -> dict[str, int]:
        return self.planner.counters.to_dict()


class MultiLayout:
    """Several packed features via `MultiStreamPlanner`; `configs` holds one per feature (the same
    max_segments, alignment, overflow and pad_id)."""

    def __init__(self, configs: list[packer.PackConfig], *, window: int, meta: dict[str, str],
                 pads: dict[str, int], open_rows: int | None = None):
        cfg = configs[0]
        self.pads = pads
        self.configs = configs
        self.features = tuple(c.feature for c in configs)
        self.max_segments = cfg.max_segments
        self.meta = meta
        self.planner = MultiStreamPlanner(
            self.features, tuple(c.seq_len for c in configs), max_segments=cfg.max_segments,
            alignment=cfg.alignment, overflow=str(cfg.overflow), window=window,
            max_open_rows=open_rows,
        )

    def window_lengths(self, cols: dict[str, list[Any]]) -> np.ndarray:
        n = len(cols[self.features[0]])
        out = np.empty((n, len(self.features)), np.int64)
        for f, name in enumerate(self.features):
            out[:, f] = [len(v) for v in cols[name]]
        return out

    def add(self, ids: list[int], lengths: np.ndarray, flush: bool = False
            ) -> list[list[tuple]]:
        rows = self.planner.add(ids, lengths)
        return rows + self.planner.finish() if flush else rows

    @staticmethod
    def join(plans: list[list[list[tuple]]]) -> list[list[tuple]]:
        return [row for p in plans for row in p]

    def finish(self) -> list[list[tuple]]:
        return self.planner.finish()

    def build(self, rows: list[list[tuple]], held: dict[str, dict[int, list]], window: int,
              dtypes: dict[str, np.dtype]) -> dict:
        """Contract rows for every feature (own layout each) + shared source index/start."""
        counts = np.fromiter((len(r) for r in rows), np.int64, len(rows))
        R, S = len(rows), self.max_segments
        flat = [p for r in rows for p in r]  # (id, length per feature), in example order
        pieces = np.asarray(flat, np.int64).reshape(-1, 1 + len(self.features))
        row = np.repeat(np.arange(R, dtype=np.int64), counts)
        ids = pieces[:, 0]
        starts = np.zeros_like(ids)
        batch: dict[str, np.ndarray] = {}
        for f, cfg in enumerate(self.configs):
            # Each feature gets its own offsets; slots are the same (pieces in example order).
            plan = order_pieces(ids, starts, pieces[:, 1 + f], row, R, packer.Counters(), cfg)
            col = gather(held[cfg.feature], plan.example.tolist(), window)
            values = [v[:m] for v, m in zip(col, plan.length.tolist(), strict=True)]
            batch.update(write_feature(values, plan, cfg.seq_len, S, feature=cfg.feature,
                                       dtype=dtypes.get(cfg.feature, np.int32), pad=cfg.pad_id))
            for meta_name, host in self.meta.items():
                if host == cfg.feature:
                    col = gather(held[meta_name], plan.example.tolist(), window)
                    mv = [v[:m] for v, m in zip(col, plan.length.tolist(), strict=True)]
                    batch[meta_name] = fill_rows(mv, plan, cfg.seq_len,
                                                 dtype=dtypes.get(meta_name, np.int32),
                                                 pad=self.pads[meta_name])
        batch.update(source_arrays(plan, S, plan.example, plan.start))
        return batch

    def open_ids(self, state: dict) -> set[int]:
        return {int(p[0]) for row in state["rows"] for p in row["pieces"]}

    def pieces(self, rows: list[list[tuple]]) -> np.ndarray:
        """i64[P, 3 + F]: (row, id, start 0, length per feature) of every piece of `rows`."""
        F = len(self.features)
        flat = [(r, p[0], 0, *p[1:]) for r, row in enumerate(rows) for p in row]
        return np.asarray(flat, np.int64).reshape(len(flat), 3 + F)

    def open_pieces(self, state: dict) -> np.ndarray:
        """i64[P, 2 + F]: (id, start 0, length per feature) of the open rows' pieces."""
        F = len(self.features)
        out = [(p[0], 0, *p[1:1 + F]) for row in state["rows"] for p in row["pieces"]]
        return np.asarray(out, np.int64).reshape(len(out), 2 + F)

    def reopen(self, pieces: np.ndarray) -> None:
        """Whole examples (i64[P, 2 + F]: id, start 0, length per feature) of rows planned
        elsewhere, placed into open rows uncounted (their examples were counted when read)."""
        self.planner.reopen(pieces[:, 0].tolist(), pieces[:, 2:])

    def counters(self) -> dict[str, int]:
        return self.planner.counters.to_dict()


@dataclasses.dataclass(frozen=True)
class Window:
    """The streaming packer's knobs.

    window:       examples planned together; rows stay open across windows.
    window_rows:  where a row takes more than 1 / `window_rows` of a window's examples, windows
                  wait until they hold `window_rows` rows' worth of pieces
                  (`packer.StreamPlanner`; 0: plan every window). One packed feature only:
                  several are planned window by window.
    shuffle_rows: shuffle the rows each window emits (seeded by the dataset's seed and the
                  position), so rows leave in no particular order of length or segment count
                  (False: the planner's order, longest examples first per window).
    open_rows:    rows kept open across windows at the most, waiting for a better fit. None:
                  `window` rows, or MIXED_OPEN_ROWS over a `Mixture` (what open rows hold
                  changes from window to window and moves the rows that leave off the
                  weights: few of them keep every batch near the weights, at the same row
                  count; docs/mixing.md).
    """

    window: int = 1024
    window_rows: int = 128
    shuffle_rows: bool = True
    open_rows: int | None = None

    def __post_init__(self) -> None:
        check_int("window", self.window, low=1)
        check_int("window_rows", self.window_rows, low=0)
        check_type("shuffle_rows", self.shuffle_rows, bool)
        if self.open_rows is not None:
            check_int("open_rows", self.open_rows, low=0)

    def max_open_rows(self, mixed: bool) -> int | None:
        """The planner's `max_open_rows` (None: its default, the window)."""
        return MIXED_OPEN_ROWS if self.open_rows is None and mixed else self.open_rows


def pack_configs(pack: packer.PackConfig | Sequence[packer.PackConfig]
                 ) -> tuple[packer.PackConfig, ...]:
    """One `PackConfig` per packed feature; several must differ only in seq_len and feature
    (ValueError naming the field), with one feature each."""
    configs: tuple = ()
    if isinstance(pack, packer.PackConfig):
        configs = (pack,)
    elif isinstance(pack, Sequence) and not isinstance(pack, str):
        configs = tuple(pack)
    if not configs or not all(isinstance(c, packer.PackConfig) for c in configs):
        raise ValueError(f"pack={pack!r} must be a PackConfig, or a non-empty list of them "
                         "(one per packed feature)")
    first = configs[0].to_dict()
    seen: set[str] = set()
    for c in configs:
        if c.feature in seen:
            raise ValueError(f"pack: feature {c.feature!r} is given twice; one PackConfig per "
                             "packed feature")
        seen.add(c.feature)
        mine = c.to_dict()
        for field in [*first, *(f for f in mine if f not in first)]:
            value, want = mine.get(field), first.get(field)
            if field not in ("seq_len", "feature") and value != want:
                raise ValueError(
                    f"pack: {field}={value!r} for feature {c.feature!r} but "
                    f"{field}={want!r} for {configs[0].feature!r}; packed features "
                    "differ only in seq_len and feature")
    strategy = configs[0].strategy
    if len(configs) > 1 and strategy is not packer.Strategy.BEST_FIT_DECREASING:
        raise ValueError(f"strategy={strategy.value!r}: several features pack with "
                         "'best_fit_decreasing' only")
    return configs
