"""Online packing with bounded memory: best fit decreasing over windows, carrying rows over.

Examples arrive one window at a time (default 1024). Each window is sorted by size, largest first,
and placed by best fit into the rows still open from earlier windows or into new rows. A row is
emitted once it is full (no room, or every segment slot used); under-filled rows are carried over
into the next window, where its pieces may close their gaps, instead of being emitted half empty.
Memory stays bounded: at most `max_open_rows` rows stay open (the fullest beyond that are emitted)
and no row stays open for more than `max_carry` windows, so every example leaves within
`max_carry + 1` windows of arriving.

Worked example (seq_len 8, max_segments 4, window 3, max_open_rows 1)::

    window 0:  lengths 5 2 6      sorted 6 5 2 -> row 0 = [6, 2] (full: emitted), row 1 = [5]
                                  row 1 is carried over (room 3)
    window 1:  lengths 3 4 1      sorted 4 3 1 -> row 1 += 3 (full: emitted), row 2 = [4, 1]
    finish:                       row 2 emitted

`StreamPlanner` plans lengths only (the Grain pipeline keeps the tokens); `pack_stream` is the
whole online packer over an iterable of token arrays.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterable, Iterator

import numpy as np

from seqpack.packer.assemble import build_rows
from seqpack.packer.config import PackConfig, Strategy
from seqpack.packer.inputs import InputError, check_lengths, check_pad, fit_dtype, row_dtype
from seqpack.packer.plan import Counters, PackPlan, apply_overflow, order_pieces
from seqpack.packer.strategies.best_fit import BestFitBins

STREAM_STRATEGIES = (Strategy.BEST_FIT_DECREASING, Strategy.BEST_FIT)


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """One emitted row: its pieces in slot order. All arrays are i64[k], k <= max_segments."""

    index: np.ndarray  # the caller's id of the example each piece comes from
    start: np.ndarray  # where in that example the piece starts
    length: np.ndarray  # tokens in the piece
    offset: np.ndarray  # start of the piece in the row


def rows_from_plan(p: PackPlan) -> list[RowPlan]:
    """Splits a plan into one `RowPlan` per row (views, no copies)."""
    bounds = p.row_slices().tolist()
    return [
        RowPlan(p.example[a:b], p.start[a:b], p.length[a:b], p.offset[a:b])
        for a, b in zip(bounds[:-1], bounds[1:])
    ]


class StreamPlanner:
    """Lengths-only online packer; see the module docstring. Deterministic for the same input."""

    def __init__(
        self,
        config: PackConfig,
        *,
        window: int = 1024,
        max_open_rows: int | None = None,
        max_carry: int = 8,
    ) -> None:
        if config.strategy not in STREAM_STRATEGIES:
            raise ValueError(
                f"strategy={str(config.strategy)!r} cannot stream; use one of "
                f"{[s.value for s in STREAM_STRATEGIES]} (concat_split: plan offline)"
            )
        if window < 1:
            raise ValueError(f"window={window} must be >= 1")
        if max_carry < 0:
            raise ValueError(f"max_carry={max_carry} must be >= 0")
        self.config = config
        self.window = window
        self.max_open_rows = window if max_open_rows is None else max_open_rows
        if self.max_open_rows < 0:
            raise ValueError(f"max_open_rows={self.max_open_rows} must be >= 0")
        self.max_carry = max_carry
        self._bins = BestFitBins(config.seq_len, config.max_segments)
        self._pieces: dict[int, list[tuple[int, int, int]]] = {}  # row -> (id, start, length)
        self._born: dict[int, int] = {}  # row -> window it opened in
        self._windows = 0
        self.counters = Counters()

    # -- planning ------------------------------------------------------------------------------
    def add(self, ids: object, lengths: object) -> list[RowPlan]:
        """Plans one window of examples; returns the rows that became final (oldest first)."""
        return rows_from_plan(self.add_plan(ids, lengths))

    def finish(self) -> list[RowPlan]:
        """Emits every open row (end of stream)."""
        return rows_from_plan(self.finish_plan())

    def add_plan(self, ids: object, lengths: object) -> PackPlan:
        """`add`, returning the final rows as one `PackPlan` (`example` holds the ids)."""
        ids = np.asarray(ids, np.int64)
        lengths = check_lengths(lengths)
        if ids.shape != lengths.shape:
            raise ValueError(f"ids {ids.shape} and lengths {lengths.shape} must have one shape")
        cfg = self.config
        example, start, length, counters = apply_overflow(lengths, cfg, ids=ids)
        self.counters = self.counters + counters
        a = cfg.segment_alignment
        sizes = -(-length // a) * a
        if cfg.strategy is Strategy.BEST_FIT_DECREASING:
            order = np.argsort(-sizes, kind="stable")
            example, start, length = example[order], start[order], length[order]
            sizes = sizes[order]
        rows = self._bins.place(sizes.tolist())
        pieces, born, w = self._pieces, self._born, self._windows
        for r, piece in zip(rows, zip(ids[example].tolist(), start.tolist(), length.tolist())):
            lst = pieces.get(r)
            if lst is None:
                pieces[r] = [piece]
                born[r] = w
            else:
                lst.append(piece)
        self._windows = w + 1
        return self._emit(final_only=True)

    def finish_plan(self) -> PackPlan:
        """`finish`, returning the rows as one `PackPlan`."""
        return self._emit(final_only=False)

    def _emit(self, *, final_only: bool) -> PackPlan:
        bins = self._bins
        if final_only:
            smax, oldest = self.config.max_segments, self._windows - self.max_carry
            room, count, born = bins.room, bins.count, self._born
            done = [
                r for r in self._pieces
                if room[r] < bins.min_room or count[r] >= smax or born[r] < oldest
            ]
            excess = len(self._pieces) - len(done) - self.max_open_rows
            if excess > 0:
                done_set = set(done)
                rest = [r for r in self._pieces if r not in done_set]
                rest.sort(key=lambda r: (room[r], r))
                done.extend(rest[:excess])
            done.sort()
        else:
            done = sorted(self._pieces)
        flat: list[tuple[int, int, int]] = []
        counts = []
        for r in done:
            lst = self._pieces.pop(r)
            del self._born[r]
            bins.forget(r)
            flat.extend(lst)
            counts.append(len(lst))
        arr = np.asarray(flat, np.int64).reshape(-1, 3)
        row = np.repeat(np.arange(len(done), dtype=np.int64), counts)
        return order_pieces(
            arr[:, 0], arr[:, 1], arr[:, 2], row, len(done), Counters(), self.config
        )

    # -- state ---------------------------------------------------------------------------------
    def oldest_open_id(self) -> int | None:
        """The smallest example id in any open row, or None when no row is open."""
        ids = [p[0] for lst in self._pieces.values() for p in lst]
        return min(ids) if ids else None

    @property
    def num_open_rows(self) -> int:
        return len(self._pieces)

    def get_state(self) -> dict:
        """JSON-serializable state: the open rows' pieces (ids, no tokens) and the counters."""
        return {
            "windows": self._windows,
            "rows": [
                {"born": self._born[r], "pieces": [list(p) for p in self._pieces[r]]}
                for r in sorted(self._pieces)
            ],
            "counters": self.counters.to_dict(),
        }

    def set_state(self, state: dict) -> None:
        """Restores a state from `get_state` (on a planner with the same config)."""
        a = self.config.segment_alignment
        self._bins = BestFitBins(self.config.seq_len, self.config.max_segments)
        self._pieces, self._born = {}, {}
        for row in state["rows"]:
            pieces = [(int(i), int(s), int(m)) for i, s, m in row["pieces"]]
            used = sum(-(-m // a) * a for _, _, m in pieces)
            r = self._bins.add_row(self.config.seq_len - used, len(pieces))
            self._pieces[r] = pieces
            self._born[r] = int(row["born"])
        self._windows = int(state["windows"])
        self.counters = Counters(**state["counters"])


def pack_stream(
    iterable: Iterable[object], config: PackConfig, *, window: int = 1024,
    dtype: object = None, **planner_kwargs
) -> Iterator[dict[str, np.ndarray]]:
    """Packs token arrays online; yields one row dict (`[L]` / `[S]` arrays) as rows become final.

    `segment_source_index` holds each example's position in `iterable`. Memory is bounded by
    the window and the open rows (see `StreamPlanner`).

    One token dtype for every row: `dtype`, else the first non-empty example's. Every example is
    checked against it: an id it cannot hold (or a negative one) raises `InputError` naming the
    example, never wraps.
    """
    planner = StreamPlanner(config, window=window, **planner_kwargs)
    held: dict[int, np.ndarray] = {}  # tokens of examples that may still be in open rows
    order: deque[int] = deque()
    ids: list[int] = []
    run_dtype = None if dtype is None else row_dtype(dtype)
    origin = ""
    if run_dtype is not None:
        check_pad(config.pad_id, run_dtype)
        origin = " (dtype= of pack_stream)"

    def emit(p: PackPlan) -> Iterator[dict[str, np.ndarray]]:
        if not p.num_rows:
            return
        pieces = [held[e][s : s + m] for e, s, m in
                  zip(p.example.tolist(), p.start.tolist(), p.length.tolist())]
        batch = build_rows(pieces, p, config, dtype=run_dtype or np.dtype(np.int32))
        tokens = batch[config.feature]
        if tokens.dtype.kind == "i" and tokens.size and tokens.min() < 0:
            name_first_bad()  # checked once per batch of rows instead of once per example
        keys = list(batch)
        cols = [batch[k] for k in keys]
        for i in range(p.num_rows):
            yield {k: c[i] for k, c in zip(keys, cols)}

    def name_first_bad() -> None:
        # Examples of the run's dtype are checked for negative ids only when their rows are
        # built, so on any failure the first bad example may be one still held: raise for it.
        if run_dtype is None:  # only empty examples so far
            return
        for e in sorted(held):
            fit_dtype(held[e], run_dtype, f"example {e}", origin=origin)

    def release() -> None:
        # Every id seen so far is planned; only those in open rows are still needed.
        oldest = planner.oldest_open_id()
        while order and (oldest is None or order[0] < oldest):
            held.pop(order.popleft())

    for i, seq in enumerate(iterable):
        arr = np.asarray(seq)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ValueError(
                f"example {i} must be a 1-D array of integer token ids, got shape {arr.shape} "
                f"dtype {arr.dtype}"
            )
        if arr.size:
            if run_dtype is None:
                run_dtype = arr.dtype
                check_pad(config.pad_id, run_dtype)
                origin = " (the first example's dtype; pass dtype= for a wider one)"
            elif arr.dtype != run_dtype:  # same dtype: the negative check runs per batch
                try:
                    arr = fit_dtype(arr, run_dtype, f"example {i}", origin=origin)
                except InputError:
                    name_first_bad()  # an earlier, still unchecked example comes first
                    raise
        held[i] = arr
        order.append(i)
        ids.append(i)
        if len(ids) == window:
            p = planner.add_plan(ids, [held[j].size for j in ids])
            ids = []
            yield from emit(p)
            release()
    if ids:
        yield from emit(planner.add_plan(ids, [held[j].size for j in ids]))
    yield from emit(planner.finish_plan())
