"""`PackIterDataset`: a checkpointable Grain `IterDataset` over seqpack's streaming packer.

Reads the parent in windows of `window` examples, plans each window with best fit decreasing
into rows carried over between windows (`packer.StreamPlanner`; several features:
`MultiStreamPlanner`), and yields contract rows (`[L]` / `[S]` arrays per packed feature, see
docs/contract.md) as they become final.

Checkpoint state is small: the planner's state (ids and lengths of the open rows' pieces and
of those waiting for `window_rows` rows' worth, no tokens: compressed, a few bytes a piece),
counters, and the parent's state at the window holding the oldest open example: restoring
re-reads the parent from there, keeps the tokens open rows need, re-plans the window being
emitted and skips the rows already yielded, exactly as an uninterrupted iterator. Over a
parent that names its examples (a `Mixture`; `elastic.ElasticExamples`, which
`make_training_pipeline` packs) the state names the examples held as (dataset, index)
references and the parent's positions instead, and the pieces in flight (`flight`): restoring
fetches them, never replays, so edited weights repeat and lose nothing (the pieces not yet
emitted are planned again with the new stage's draws, which make up for them: restore.py),
and a state of another host or worker count restores as its share of what the old layout
left (`elastic.merge`). Over a mixture rows carry `segment_dataset_id` and leave in an order
that keeps the shares.

Example::

    ds = SequentialIterDataset(ArraySource.from_ragged(values, offsets))
    ds = PackIterDataset(ds, PackConfig(2048, max_segments=64, overflow="truncate"))
    row = next(iter(ds))   # tokens, tokens_segment_ids, ..., segment_source_index
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np

from seqpack import packer
from seqpack.packer.contract import check_not_packed
from seqpack.packer.inputs import check_pad, fit_dtype, row_dtype
from seqpack.packer.online import decode_planner_state
from seqpack.pipelines.datasets.columns import (
    Columns,
    as_values,
    check_declared,
    check_lengths,
    check_negative,
    check_type,
)
from seqpack.pipelines.datasets.elastic import (
    ELASTIC,
    RefTable,
    decode_refs,
    encode_table,
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
        # A parent that names its examples: they are held as (dataset, index) references and
        # states never replay; over a Mixture rows also carry their dataset and keep shares.
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
        # The one dtype per name for the whole run (restored from the state).
        self._dtypes: dict[str, np.dtype] = dict(ds.dtypes)
        self._refs = RefTable(ds.window)
        self._cuts: list[int] = []  # ids read where a mixture's stage ended (`plan_cut`)

    # ---- reading ---------------------------------------------------------------------------

    def _read_window(self, keep: set[int] | None = None) -> tuple[list[int], dict[str, list]]:
        """Reads up to `window` elements. keep=None: all are new; else replay, hold only `keep`."""
        parent, ds = self._parent, self._ds
        first = self._next_id
        self._attempt = (first, parent.get_state())
        cols: dict[str, list] = {n: [] for n in ds.names}
        if len(ds.names) == 1:
            vals = cols[ds.names[0]]
            append, key = vals.append, ds.names[0]
            try:
                if first == 0:
                    element = next(parent)
                    self._check_not_packed(element)
                    append(element[key])
                for _ in range(ds.window - (first == 0)):
                    append(next(parent)[key])
            except StopIteration:
                self._exhausted = True
            except (KeyError, TypeError, IndexError) as e:
                self._bad_element(first + len(vals), e)
            count = len(vals)
        else:
            count = 0
            try:
                for _ in range(ds.window):
                    element = next(parent)
                    if first + count == 0:
                        self._check_not_packed(element)
                    try:
                        for n in ds.names:
                            cols[n].append(element[n])
                    except (KeyError, TypeError, IndexError) as e:
                        self._bad_element(first + count, e)
                    count += 1
            except StopIteration:
                self._exhausted = True
        if count:
            self._bounds.append(self._attempt)
        self._next_id = first + count
        ids = list(range(first, first + count))
        for n in ds.names:
            col = cols[n]
            if not all(type(v) is np.ndarray and v.ndim == 1 for v in col):
                col[:] = [self._as_tokens(v, first + i, n) for i, v in enumerate(col)]
            elif count and not all(v.dtype.kind in "iub" for v in col):
                i = next(i for i, v in enumerate(col) if v.dtype.kind not in "iub")
                self._as_tokens(col[i], first + i, n)
        for n in ds.names:
            self._fit_column(cols[n], n, first)
        if count:
            k = first // ds.window
            for n in ds.names:
                col = cols[n]
                if keep is not None:  # replay: hold only what open rows need
                    col = [v if first + i in keep else None for i, v in enumerate(col)]
                self._held[n][k] = col
            if self._by_ref:
                self._refs.put(k, *self._parent.take_refs())
        if self._by_ref:  # where a mixture's stages ended: planned in parts (`plan_cut`)
            self._cuts += [first + c for c in self._parent.take_cuts()]
        return ids, cols

    def _check_not_packed(self, element: Any) -> None:
        ds = self._ds
        check_not_packed(element, ds.features, "element 0 of the parent")
        if isinstance(element, Mapping) and all(n in element for n in ds.names):
            check_declared(element, ds.names, ds.drop_features, "element 0 of the parent")

    def _bad_element(self, ident: int, e: Exception) -> None:
        raise InputError(f"element {ident} of the parent lacks one of the features "
                         f"{list(self._ds.names)} ({type(e).__name__}: {e}); elements must be "
                         "dicts of 1-D token arrays") from None

    def _as_tokens(self, v: Any, ident: int, name: str) -> np.ndarray:
        return as_values(v, f"element {ident}: {name!r}", token_ids=name in self._ds.features)

    def _fit_column(self, col: list, name: str, first: int) -> None:
        """Casts a window's values of `name` to the run's dtype (fixed by the first non-empty
        element unless given); InputError naming the element for a value it cannot hold."""
        dtype = self._dtypes.get(name)
        if dtype is None:
            nonempty = next((v for v in col if v.size), None)
            if nonempty is None:
                return
            dtype = self._dtypes[name] = nonempty.dtype
            if name in self._ds.features:
                check_pad(self._ds.configs[0].pad_id, dtype)
            else:
                check_pad(self._ds.pads[name], dtype, name=f"the pad of column {name!r}")
        token_ids = name in self._ds.features
        for i, v in enumerate(col):
            if v.dtype != dtype and v.size:
                col[i] = fit_dtype(v, dtype, f"element {first + i}: {name!r}",
                                          token_ids=token_ids, origin=self._ds.dtype_origin(name))

    # ---- planning ---------------------------------------------------------------------------

    def _state_at(self, first: int) -> Any:
        for state in (state for f, state in self._bounds if f == first):
            return state
        assert self._attempt is not None and self._attempt[0] == first, (first, self._bounds)
        return self._attempt[1]

    def _advance(self) -> None:
        """Reads the next window (or none: the final flush) and stages its rows."""
        window = None
        if not self._exhausted:
            ids, cols = self._read_window()
            if ids:
                window = (ids, cols)
        self._stage(window)

    def _stage(self, window: tuple[list[int], dict[str, list]] | None) -> None:
        """Plans `window` (None: the final flush) and stages its rows for emission."""
        ds, layout = self._ds, self._layout
        before = self._planner_state
        oldest_before = self._oldest
        if window is not None:
            ids, cols = window
            lengths = layout.window_lengths(cols)
            check_lengths(cols, ds.meta, ids[0])
            cuts, self._cuts = [c - ids[0] for c in self._cuts], []
            try:
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
        if cuts:
            self._snap["cuts"] = [window_first + c for c in cuts]
        batch = layout.build(plan, self._held, ds.window, self._dtypes)
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
        if self._by_ref:
            self._snap["flight"] = self._flight(plan, self._order)

    def _flight(self, plan: Any, order: list[int] | None) -> Any:
        """The pieces in flight once this window's rows start to leave, encoded when called:
        i64[P, 3 + F] (the row's turn to leave, or -1 open or waiting; id, start, length per
        feature), and the planner's counters after the window (`elastic.merge` reads them)."""
        layout, after = self._layout, self._planner_state
        counters = layout.counters()

        def encode() -> dict[str, Any]:
            staged = layout.pieces(plan)
            if order is not None and len(staged):
                turn = np.empty(len(order), np.int64)
                turn[np.asarray(order, np.int64)] = np.arange(len(order))
                staged[:, 0] = turn[staged[:, 0]]
            still = layout.open_pieces(decode_planner_state(after()))
            held = np.concatenate([np.full((len(still), 1), -1, np.int64), still], 1)
            return {"pieces": encode_table(np.concatenate([staged, held])),
                    "counters": counters}

        return encode

    def _snapshot(self, phase: str, window_first: int, before: Any,
                  oldest_before: int | None) -> dict[str, Any]:
        """What a state taken while this window's rows leave records. Over a mixture: the
        mixture's positions after the window, and references to the window's examples and to
        those of rows still open before it (encoded on the first get_state). Else: the
        parent's state at the window holding the oldest open example, to replay from."""
        snap = {"phase": phase, "window_first": window_first, "planner": before,
                "dtypes": {n: dt.str for n, dt in self._dtypes.items()}}
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
        self._dtypes.update({n: np.dtype(d) for n, d in state.get("dtypes", {}).items()})
        planner_state = decode_planner_state(state["planner"])
        layout.planner.set_state(planner_state)
        self._planner_state = layout.planner.snapshot()
        self._oldest = layout.planner.oldest_open_id()
        if ("refs" in state) != self._by_ref:
            by = lambda named: "names its examples (a Mixture, make_training_pipeline's " \
                "examples)" if named else "replays its parent"  # noqa: E731
            raise InputError(
                f"restoring: the state was saved by a packer that {by('refs' in state)}, but "
                f"this one {by(self._by_ref)}; restore into the same pipeline")
        self._rows_emitted = int(state["rows_emitted"])
        if self._by_ref:
            if self._restore_refs(state):
                return  # re-planned under the edited weights: the new window's rows leave
        else:
            self._replay(state, layout.open_ids(planner_state))
        self._emitted = int(state["emitted"])

    # ---- restoring by reference (restore.py) ----------------------------------------------

    def _hold(self, ids: np.ndarray, dataset: np.ndarray, index: np.ndarray) -> restore.Held:
        """Fetches the referenced examples and holds them under `ids`."""
        ds = self._ds
        self._refs.put_ids(ids, dataset, index)
        held = restore.fetch(self._parent, ids, dataset, index, names=ds.names,
                             window=ds.window, as_values=self._as_tokens, fit=self._fit_column)
        for n in ds.names:
            for k, values in held.tokens[n].items():
                have = self._held[n].get(k)
                self._held[n][k] = values if have is None else \
                    [v if v is not None else h for v, h in zip(values, have)]
        return held

    def _restore_refs(self, state: dict[str, Any]) -> bool:
        """Fetches the referenced examples and re-plans the window that was leaving (nothing
        replayed: the parent goes on from its restored positions). Under a mixture's edited
        weights, also plans the pieces not yet emitted again (`_replan`): True when it did."""
        ds, parent = self._ds, self._parent
        ids, dataset, index = decode_refs(state["refs"])
        held = self._hold(ids, dataset, index)
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
        ref_of = dict(zip(ids.tolist(), zip(dataset.tolist(), index.tolist())))
        self._read_and_stage(waiting, held.elements, ref_of)
        return True

    def _read_and_stage(self, waiting: np.ndarray, elements: dict[int, Any],
                        ref_of: dict[int, tuple[int, int]]) -> None:
        """Plans the `waiting` pieces (i64[P, 3]) again with the next draws: over a mixture
        its new stage counts them as drawn and windows are read until they fit the weights
        (restore.py); else with the next window."""
        ds, parent = self._ds, self._parent
        self._planner_state = self._layout.planner.snapshot()
        self._oldest = self._layout.planner.oldest_open_id()
        if not self._mixed:
            self._advance()
            return
        units = restore.waiting_units(parent, waiting, ref_of, elements)
        need = parent.hold_back(units, len(set(waiting[:, 0].tolist())))
        need = min(need, restore.MAX_SPREAD * sum(units))
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

    def _install(self, state: dict[str, Any]) -> None:
        """A restore state of another layout (`elastic.merge`): this consumer's share of what
        the old layout left. Its streams go to the parent; its examples in flight are fetched
        and wait in the planner to be planned with the next draws."""
        ds, parent, layout = self._ds, self._parent, self._layout
        if not self._by_ref:
            raise InputError("restoring: a state of another host or worker count restores "
                             "only a packer whose parent names its examples (a Mixture, or "
                             "make_training_pipeline's examples)")
        part = share(state, *index_in(state["over"], parent.layout()))
        self._dtypes.update({n: np.dtype(d) for n, d in state.get("dtypes", {}).items()})
        if self._mixed:
            parent.install(part.streams, part.mixer, part.counters.get("datasets"))
        else:
            parent.install(part.streams)
        if part.counters.get("planner"):
            layout.planner.counters = packer.Counters(**part.counters["planner"])
        self._rows_emitted = int(part.counters.get("rows_emitted", 0))
        flight = part.flight
        ids = np.arange(flight.num_examples, dtype=np.int64)
        held = self._hold(ids, flight.dataset.astype(np.int32), flight.index)
        self._next_id = -(-ids.size // ds.window) * ds.window
        waiting = np.zeros((0, 3), np.int64)
        if len(flight.pieces):
            layout.reopen(flight.pieces)
            waiting = flight.pieces[:, :3]  # id, start, length (of the first feature)
        ref_of = dict(zip(ids.tolist(), zip(flight.dataset.tolist(), flight.index.tolist())))
        self._read_and_stage(waiting, held.elements, ref_of)
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

    `segment_source_index` holds each segment's position in the parent's stream (0, 1, ... per
    iterator; per worker under `mp_prefetch`).
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
        if len(self.features) > 1:
            cfg = self.configs[0]
            if cfg.strategy is not packer.Strategy.BEST_FIT_DECREASING:
                raise ValueError(
                    f"strategy={cfg.strategy.value!r}: several features pack with "
                    "'best_fit_decreasing' only"
                )
        self.dtypes: dict[str, np.dtype] = {}
        if dtype is not None:
            dt = row_dtype(dtype)
            check_pad(self.configs[0].pad_id, dt)
            self.dtypes = dict.fromkeys(self.features, dt)
        self.make_layout()  # validates the combination early

    def dtype_origin(self, name: str) -> str:
        if name in self.dtypes:
            return " (dtype= of PackIterDataset)"
        return " (the first element's dtype; pass dtype= for a wider one)"

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
