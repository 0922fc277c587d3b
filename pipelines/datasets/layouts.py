"""The two planning back ends of `PackIterDataset`: one packed feature, or several.

Both turn a window of held examples into contract rows and expose the same small interface:
`lengths(elements)`, `add(ids, lengths)`, `finish()`, `build(plan, held)`, state and counters.

- `SingleLayout`: `packer.StreamPlanner` (best fit decreasing over windows, overflow incl.
  split) and `packer.build_rows` for the token rows.
- `MultiLayout`: `packer.MultiStreamPlanner`; every feature gets its own segment metadata,
  the example's slot is shared.

Columns (labels, masks, other per-token values; `columns.py`) ride on a host feature: same
length per example, the host's offsets, padded with their own pad, no metadata of their own.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from seqpack import packer
from seqpack.packer import MultiStreamPlanner
from seqpack.packer.assemble import fill_rows, source_arrays, write_feature
from seqpack.packer.plan import order_pieces


def gather(held: dict[int, list], ids: list[int], window: int) -> list[Any]:
    """Values of example `ids` from `held` (window number -> that window's values)."""
    return [held[i // window][i % window] for i in ids]


class SingleLayout:
    """One packed feature via `packer.StreamPlanner`."""

    def __init__(self, config: packer.PackConfig, *, window: int, meta: dict[str, str],
                 pads: dict[str, int], window_rows: int = 128):
        self.config = config
        self.feature = config.feature
        self.meta = list(meta)  # all hosted by `feature`
        self.pads = pads
        self.planner = packer.StreamPlanner(config, window=window, window_rows=window_rows)

    def window_lengths(self, cols: dict[str, list[Any]]) -> list[int]:
        return [len(v) for v in cols[self.feature]]

    def add(self, ids: list[int], lengths: list[int]) -> packer.PackPlan:
        return self.planner.add_plan(ids, lengths)

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

    def counters(self) -> dict[str, int]:
        return self.planner.counters.to_dict()


class MultiLayout:
    """Several packed features via `MultiStreamPlanner`; `configs` holds one per feature (the same
    max_segments, alignment, overflow and pad_id)."""

    def __init__(self, configs: list[packer.PackConfig], *, window: int, meta: dict[str, str],
                 pads: dict[str, int]):
        cfg = configs[0]
        self.pads = pads
        self.configs = configs
        self.features = tuple(c.feature for c in configs)
        self.max_segments = cfg.max_segments
        self.meta = meta
        self.planner = MultiStreamPlanner(
            self.features, tuple(c.seq_len for c in configs), max_segments=cfg.max_segments,
            alignment=cfg.alignment, overflow=str(cfg.overflow), window=window,
        )

    def window_lengths(self, cols: dict[str, list[Any]]) -> np.ndarray:
        n = len(cols[self.features[0]])
        out = np.empty((n, len(self.features)), np.int64)
        for f, name in enumerate(self.features):
            out[:, f] = [len(v) for v in cols[name]]
        return out

    def add(self, ids: list[int], lengths: np.ndarray) -> list[list[tuple]]:
        return self.planner.add(ids, lengths)

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

    def counters(self) -> dict[str, int]:
        return self.planner.counters.to_dict()
