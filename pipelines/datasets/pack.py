"""`PackIterDataset`: a checkpointable Grain `IterDataset` over seqpack's streaming packer.

Reads the parent in windows of `window` examples, plans each window with best fit decreasing
into rows carried over between windows (`packer.StreamPlanner`; several features:
`MultiStreamPlanner`), and yields contract rows (`[L]` / `[S]` arrays per packed feature, see
docs/contract.md) as they become final.

Checkpoint state is small: the planner's state (ids and lengths of the open rows' pieces, no
tokens: compressed, a few bytes a piece), counters, and the parent's state at the window
holding the oldest open example: restoring re-reads the parent from there, re-plans the window
being emitted and skips the rows already yielded, exactly as an uninterrupted iterator. Over a
parent that names its examples (a `Mixture`; `elastic.ElasticExamples`, which
`make_training_pipeline` packs) the state names the examples held by reference and the pieces
in flight instead: restoring fetches them, never replays, so edited weights repeat and lose
nothing (`elastic.restore`), and a state of another host or worker count restores as this
consumer's share of what the old layout left (`elastic.merge`). Over a mixture rows carry
`segment_dataset_id` and leave in an order that keeps the shares.

Example::

    ds = SequentialIterDataset(ArraySource.from_ragged(values, offsets))
    ds = PackIterDataset(ds, PackConfig(2048, max_segments=64, overflow="truncate"))
    row = next(iter(ds))   # tokens, tokens_segment_ids, ..., segment_source_index
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from seqpack import packer
from seqpack.packer.inputs import check_pad, row_dtype
from seqpack.packer.online import decode_planner_state
from seqpack.pipelines.datasets.columns import (
    Columns,
    RunValues,
    check_lengths,
    check_negative,
    check_type,
)
from seqpack.pipelines.datasets.elastic import (
    ELASTIC,
    Refs,
    RefTable,
    decode_refs,
    deferred_flight,
    index_in,
    restore,
    share,
)
from seqpack.pipelines.datasets.layouts import (
    MultiLayout,
    SingleLayout,
    Window,
    gather,
    pack_configs,
    plan_cut,
)
from seqpack.pipelines.datasets.mixing import Mixture, MixtureIterator, balanced_order
from seqpack.pipelines.errors import InputError


class PackIterator(grain.DatasetIterator):
    """Iterator of `PackIterDataset`; `counters` reports what the overflow policy did."""

    def __init__(self, parent: grain.DatasetIterator, ds: PackIterDataset):
        super().__init__(parent)
        self._ds = ds
        self._start_state = parent.get_state()
        # A parent naming its examples: held as (dataset, index) references, never replayed.
        self._by_ref = hasattr(parent, "take_refs")
        self._mixed = isinstance(parent, MixtureIterator)
        self._fresh()

    def _fresh(self) -> None:
        ds = self._ds
        self._layout = ds.make_layout()
        # after the last planned window: encoded (state_codec) only for a checkpoint
        self._planner_state = self._layout.planner.snapshot()
        self._oldest: int | None = None  # oldest example id in an open row
        self._next_id = 0  # parent elements read so far = id of the next one
        self._bounds: deque[tuple[int, Any]] = deque()  # (first id, parent state) per window
        self._attempt: tuple[int, Any] | None = None
        # Tokens that open rows may still need: name -> window number -> values of that window.
        self._held: dict[str, dict[int, list]] = {n: {} for n in ds.names}
        self._exhausted = False
        self._finished = False
        self._snap: dict[str, Any] | None = None
        self._cols: list[tuple[str, np.ndarray]] = []
        self._num_rows = 0
        self._emitted = 0
        self._order: list[int] | None = None
        self._plan: Any = None  # the staged window's plan (a restore under edited weights)
        self._rows_emitted = 0
        self._values = ds.run_values()  # checks; the one dtype per name (restored)
        self._refs = RefTable(ds.window)
        self._cuts: list[int] = []  # ids read where a mixture's stage ended (`plan_cut`)

    # ---- reading ---------------------------------------------------------------------------

    def _read_window(self, keep: set[int] | None = None) -> tuple[list[int], dict[str, list]]:
        """Reads up to `window` elements. keep=None: all are new; else replay, hold only `keep`."""
        parent, ds = self._parent, self._ds
        first = self._next_id
        self._attempt = (first, parent.get_state())
        cols, ended = self._values.read(parent, ds.window, first)
        self._exhausted |= ended
        count = len(cols[ds.names[0]])
        self._next_id = first + count
        ids = list(range(first, first + count))
        if count:
            self._bounds.append(self._attempt)
            k = first // ds.window
            for n in ds.names:
                col = cols[n]
                if keep is not None:  # replay: hold only what open rows need
                    col = [v if first + i in keep else None for i, v in enumerate(col)]
                self._held[n][k] = col
            if self._by_ref:  # each example's size too: a restore checks it
                self._refs.put(k, *self._parent.take_refs(),
                               np.fromiter(map(len, cols[ds.names[0]]), np.int64, count))
        if self._by_ref:  # where a mixture's stages ended: planned in parts (`plan_cut`)
            self._cuts += [first + c for c in self._parent.take_cuts()]
        return ids, cols

    # ---- planning ---------------------------------------------------------------------------

    def _state_at(self, first: int) -> Any:
        for state in (state for f, state in self._bounds if f == first):
            return state
        assert self._attempt is not None and self._attempt[0] == first, (first, self._bounds)
        return self._attempt[1]

    def _advance(self) -> None:
        """Reads the next window (or none: the final flush) and stages its rows."""
        ids, cols = self._read_window() if not self._exhausted else ([], {})
        self._stage((ids, cols) if ids else None)

    def _stage(self, window: tuple[list[int], dict[str, list]] | None) -> None:
        """Plans `window` (None: the final flush) and stages its rows for emission."""
        ds, layout = self._ds, self._layout
        before = self._planner_state
        oldest_before = self._oldest
        if window is not None:
            ids, cols = window
            lengths = layout.window_lengths(cols)
            cuts, self._cuts = [c - ids[0] for c in self._cuts], []
            try:
                check_lengths(cols, ds.meta, ids[0])
                plan, parts = plan_cut(layout, ids, lengths, cuts)
            except InputError as e:  # by reference: name the dataset and its example
                raise (InputError(self._refs.rename(str(e), self._parent.names))
                       if self._by_ref else e) from None
            phase, window_first = "window", ids[0]
        else:
            plan, parts, cuts, self._cuts = layout.finish(), None, [], []
            phase, window_first = "finish", self._next_id
            self._finished = True
        self._snap = self._snapshot(phase, window_first, before, oldest_before)
        if window is not None and not self._by_ref:  # what a replay checks it re-read
            self._snap["sizes"] = restore.sizes_digest(lengths)
        if cuts:
            self._snap["cuts"] = [window_first + c for c in cuts]
        batch = layout.build(plan, self._held, ds.window, self._values.dtypes)
        check_negative(batch, self._held, self._ds.features, self._ds.window)
        if self._by_ref:
            self._refs.label(batch, datasets=self._mixed)
        self._planner_state = layout.planner.snapshot()
        self._oldest = layout.planner.oldest_open_id()
        oldest = self._next_id if self._oldest is None else self._oldest
        for held in self._held.values():
            for k in [k for k in held if (k + 1) * ds.window <= oldest]:
                del held[k]
        self._refs.drop_below(oldest)
        while self._bounds and self._bounds[0][0] + ds.window <= oldest:
            self._bounds.popleft()
        self._cols = list(batch.items())
        self._plan = plan
        self._num_rows = len(next(iter(batch.values()))) if batch else 0
        self._emitted = 0
        self._order = None
        if ds.shuffle_rows and self._num_rows > 1:
            rng = np.random.default_rng([ds.seed, self._next_id, int(phase == "finish")])
            self._order = rng.permutation(self._num_rows).tolist()
            if self._mixed:  # every run of rows near the mixture's shares
                self._order = balanced_order(self._parent.dataset_units(batch), self._order,
                                             parts)
        if self._by_ref:  # the pieces in flight while these rows leave (`elastic.merge`)
            self._snap["flight"] = deferred_flight(layout, plan, self._order,
                                                   self._planner_state)

    def _snapshot(self, phase: str, window_first: int, before: Any,
                  oldest_before: int | None) -> dict[str, Any]:
        """What a state taken while this window's rows leave records. Over a mixture: the
        mixture's positions after the window, and references to the window's examples and to
        those of rows still open before it (encoded on the first get_state). Else: the
        parent's state at the window holding the oldest open example, to replay from."""
        snap = {"phase": phase, "window_first": window_first, "planner": before,
                "dtypes": {n: dt.str for n, dt in self._values.dtypes.items()}}
        if self._by_ref:
            layout = self._layout
            snap.update(parent=self._parent.get_state(), next_id=self._next_id,
                        refs=self._refs.deferred(
                            lambda p: layout.open_ids(decode_planner_state(p)), window_first,
                            self._next_id))
            return snap
        replay_id = window_first if oldest_before is None else oldest_before
        replay_from = replay_id - replay_id % self._ds.window
        snap.update(parent=self._state_at(replay_from), replay_from=replay_from)
        return snap

    # ---- iteration and state ------------------------------------------------------------------

    def __next__(self) -> dict[str, np.ndarray]:
        while self._emitted >= self._num_rows:
            if self._finished:
                raise StopIteration
            self._advance()
        i = self._emitted if self._order is None else self._order[self._emitted]
        self._emitted += 1
        self._rows_emitted += 1
        return {k: c[i] for k, c in self._cols}

    @property
    def counters(self) -> dict[str, int]:
        """Planner counters (truncated/dropped/split/empty...) plus rows and examples read."""
        out = self._layout.counters()
        out["rows_emitted"] = self._rows_emitted
        out["examples_read"] = self._next_id
        if self._mixed:  # per dataset: tokens, loss tokens, examples, epochs drawn
            out["datasets"] = self._parent.counters
        return out

    def get_state(self) -> dict[str, Any]:
        if self._snap is None:
            return {"phase": "start", "parent": self._start_state, "emitted": 0,
                    "rows_emitted": 0}
        if callable(self._snap["planner"]):  # encoded once per window, on the first call
            self._snap["planner"] = self._snap["planner"]()
        if callable(self._snap.get("refs")):
            self._snap["refs"] = self._snap["refs"](self._snap["planner"])
        if callable(self._snap.get("flight")):
            self._snap["flight"] = self._snap["flight"]()
        return {**self._snap, "emitted": self._emitted,
                "rows_emitted": self._rows_emitted}

    def set_state(self, state: dict[str, Any]) -> None:
        if state["phase"] == ELASTIC:
            self._fresh()
            self._install(state)
            return
        self._parent.set_state(state["parent"])
        self._fresh()
        if state["phase"] == "start":
            self._start_state = state["parent"]
            return
        layout = self._layout
        self._values.dtypes.update({n: np.dtype(d) for n, d in state.get("dtypes", {}).items()})
        planner_state = decode_planner_state(state["planner"])
        layout.planner.set_state(planner_state)
        self._planner_state = layout.planner.snapshot()
        self._oldest = layout.planner.oldest_open_id()
        restore.check_kind(state, by_ref=self._by_ref)
        self._rows_emitted = int(state["rows_emitted"])
        if self._by_ref:
            if self._restore_refs(state):
                return  # re-planned under the edited weights: the new window's rows leave
        else:
            self._replay(state, layout.open_ids(planner_state))
            restore.check_replayed(state, self._snap)
        self._emitted = int(state["emitted"])

    # ---- restoring by reference (restore.py) ----------------------------------------------

    def _hold(self, ids: np.ndarray, refs: Refs, extents=None) -> restore.Held:
        """Holds the examples `refs` names under `ids` (a fresh iterator): `restore.fetch`."""
        held = restore.fetch(self._parent, ids, refs, names=self._ds.names,
                             window=self._ds.window, values=self._values, extents=extents)
        self._refs.put_ids(ids, *refs[:2], held.sizes)
        self._held = held.tokens
        return held

    def _restore_refs(self, state: dict[str, Any]) -> bool:
        """Fetches the referenced examples and re-plans the window that was leaving (nothing
        replayed: the parent goes on from its restored positions). Under a mixture's edited
        weights, also plans the pieces not yet emitted again (`_replan`): True when it did."""
        ds, parent = self._ds, self._parent
        held = self._hold(*decode_refs(state["refs"]), restore.extents_of(state))
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
        if not (self._mixed and parent.reweighted and isinstance(self._layout, SingleLayout)):
            return False
        self._held, self._refs.windows = kept  # the rows not emitted are planned again
        pieces = restore.unemitted(self._plan, self._order, self._num_rows,
                                   int(state["emitted"]))
        waiting = self._layout.planner.reopen(*pieces)
        self._read_and_stage(waiting, held)
        return True

    def _read_and_stage(self, waiting: np.ndarray, held: restore.Held) -> None:
        """Plans the `waiting` pieces (i64[P, 3]) again with the next draws: over a mixture
        its new stage counts them as drawn and windows are read until they fit the weights
        (restore.py); else with the next window."""
        ds, parent = self._ds, self._parent
        self._planner_state = self._layout.planner.snapshot()
        self._oldest = self._layout.planner.oldest_open_id()
        if not self._mixed:
            self._advance()
            return
        units = restore.waiting_units(parent, waiting, held)
        need = parent.hold_back(units, len(set(waiting[:, 0].tolist())))
        need = min(need, restore.MAX_SPREAD * sum(units))
        ids: list[int] = []
        cols: dict[str, list] = {n: [] for n in ds.names}
        while not self._exhausted and (not ids or parent.stage_units() < need):
            got, c = self._read_window()
            ids += got
            for n in ds.names:
                cols[n] += c[n]
        self._stage((ids, cols) if ids else None)

    def _install(self, state: dict[str, Any]) -> None:
        """A restore state of another layout (`elastic.merge`): this consumer's share of what
        the old layout left. Its streams go to the parent; its examples in flight are fetched
        and wait in the planner to be planned with the next draws."""
        ds, parent, layout = self._ds, self._parent, self._layout
        if not self._by_ref:
            raise InputError("restoring: a state of another layout needs a parent that names "
                             "its examples (a Mixture, make_training_pipeline's examples)")
        part = share(state, *index_in(state["over"], parent.layout()))
        self._values.dtypes.update({n: np.dtype(d) for n, d in state.get("dtypes", {}).items()})
        if self._mixed:
            parent.install(part.streams, part.mixer, part.counters.get("datasets"))
        else:
            parent.install(part.streams)
        if part.counters.get("planner"):
            layout.planner.counters = packer.Counters(**part.counters["planner"])
        self._rows_emitted = int(part.counters.get("rows_emitted", 0))
        flight = part.flight
        ids = np.arange(flight.num_examples, dtype=np.int64)
        held = self._hold(ids, flight.refs, flight.pieces)
        self._next_id = -(-ids.size // ds.window) * ds.window
        waiting = np.zeros((0, 3), np.int64)
        if len(flight.pieces):
            layout.reopen(flight.pieces)
            waiting = flight.pieces[:, :3]  # id, start, length (of the first feature)
        self._read_and_stage(waiting, held)
        self._emitted = 0

    def _replay(self, state: dict[str, Any], needed: set[int]) -> None:
        """Re-reads the parent from the window holding the oldest open example, holding only
        what open rows need, and re-plans the window that was leaving."""
        ds = self._ds
        self._next_id = int(state["replay_from"])
        window_first = int(state["window_first"])
        while self._next_id < window_first:
            ids, _ = self._read_window(keep=needed)
            if len(ids) < ds.window and self._next_id < window_first:
                raise InputError(
                    f"restoring: the parent ended at element {self._next_id} while replaying up "
                    f"to {window_first}; the parent must yield the same elements after set_state"
                )
        self._exhausted = state["phase"] == "finish"
        self._advance()

    def __str__(self) -> str:
        return "PackIterator"


class PackIterDataset(grain.IterDataset):
    """Packs variable-length examples into contract rows (see the module docstring).

    parent:  elements are dicts holding each packed feature as a 1-D int array.
    pack:    a `packer.PackConfig` (seq_len L, max_segments S, strategy "best_fit_decreasing"
             per window or "best_fit" in arrival order, overflow counted in the iterator's
             `counters`, segment_alignment, pad_id, feature); or one per packed feature, which
             differ only in seq_len and feature: a row then takes an example only if every
             feature fits, each feature gets its own segment metadata (`f_segment_ids`, ...)
             and slots are shared.
    columns: label / mask / per-token columns packed with a feature's segment layout, and the
             keys dropped on purpose (`Columns`, columns.py).
    window:  `Window`: window size, waiting for `window_rows`, row shuffling, open rows.
    seed:    seeds the row shuffle.
    dtype:   the token dtype of every row of the packed features; default: the first
             non-empty element's. One dtype per run: every element is checked against it, and
             an id it cannot hold (or a negative one) raises `InputError` naming the element
             instead of wrapping. Columns keep their own dtype (the first element's),
             range-checked the same way but free to be negative.

    `segment_source_index` holds each segment's example: its index in its source where the
    parent names its examples (a `Mixture`, `elastic.ElasticExamples`), else its position in
    the parent's stream (0, 1, ... per iterator; per worker under `mp_prefetch`).
    """

    def __init__(self, parent: grain.IterDataset,
                 pack: packer.PackConfig | Sequence[packer.PackConfig], *,
                 columns: Columns = Columns(), window: Window = Window(), seed: int = 0,
                 dtype: Any = None):
        if isinstance(parent, Mixture):  # it counts the packed feature (ValueError: another)
            parent = parent.for_feature(pack_configs(pack)[0].feature)
        super().__init__(parent)
        check_type("columns", columns, Columns, " (e.g. Columns(labels=['labels']))")
        check_type("window", window, Window, " (e.g. Window(window=1024))")
        self.configs = list(pack_configs(pack))
        self.features = tuple(c.feature for c in self.configs)
        self.columns = columns.of(self.features)
        self.meta = {c.name: c.feature for c in self.columns}  # column -> its host feature
        self.pads = {c.name: c.pad for c in self.columns}
        self.names = self.features + tuple(self.meta)
        self.drop_features = tuple(columns.drop)
        self.window, self.window_rows = window.window, window.window_rows
        self.shuffle_rows = window.shuffle_rows
        self.open_rows = window.max_open_rows(isinstance(parent, Mixture))
        self.seed = int(seed)
        self.dtypes: dict[str, np.dtype] = {}
        if dtype is not None:
            dt = row_dtype(dtype)
            check_pad(self.configs[0].pad_id, dt)
            self.dtypes = dict.fromkeys(self.features, dt)
        self.make_layout()  # validates the combination early

    def run_values(self) -> RunValues:
        return RunValues(features=self.features, names=self.names, drop=self.drop_features,
                         pad_id=self.configs[0].pad_id, pads=self.pads, given=self.dtypes)

    def make_layout(self) -> SingleLayout | MultiLayout:
        kw = dict(window=self.window, meta=self.meta, pads=self.pads, open_rows=self.open_rows)
        if len(self.features) == 1:
            return SingleLayout(self.configs[0], window_rows=self.window_rows, **kw)
        return MultiLayout(self.configs, **kw)

    def __iter__(self) -> PackIterator:
        return PackIterator(self._parent.__iter__(), self)

    def __str__(self) -> str:
        lengths = {c.feature: c.seq_len for c in self.configs}
        return f"PackIterDataset({lengths})"
