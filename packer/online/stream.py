"""Online packing with bounded memory: windows of examples into rows kept open across windows.

Examples arrive one window at a time (default 1024). The pieces of the window and those of the
rows left open by earlier windows are planned together by the offline planner (best fit
decreasing with all its passes, in its window form: `assign_best_fit_decreasing(window=...)`,
where worst fit deals only into the rows the pieces can fill and the repair runs where slots and
tokens bind alike; the sieve does not), so pieces carried over are placed again with the new
ones instead of being stuck in a row whose slots they fill or whose last few tokens no piece
fits; rows exactly full are emitted (but, where the slots bind, not those full in tokens with
fewer pieces than the window's mean: `_slot_poor_open`), of the others the least filled
are kept open (up to `max_open_rows` rows and two windows of pieces, or two rows' worth of
tokens), so that a row with a little room left can still be planned tighter with the next
window's pieces. Where a row takes more than a quarter of a window's pieces (and the cap does
not bind), the open rows stay as they are and the window's pieces go into them by best fit,
largest first; rows are emitted once full (no room, or every slot used) or beyond
`max_open_rows` (the fullest first). Either way no piece stays open for more than `max_carry`
windows (a piece due trades places with a younger one of an emitted row where it can, else its
row is emitted), so every example leaves within `max_carry + 1` windows of arriving.

A window is planned once it holds `window_rows` rows' worth of pieces (default 128: that
many times `max_segments` pieces, or `seq_len` tokens): where a row takes more than a 128th of
the examples of one call, the pieces of the calls wait (`add` returns no rows) until they do,
and are planned as one window (a plan of a few rows' worth cannot mix sizes within a row).
Memory is then bounded by the larger of the window and `window_rows` rows, and `max_carry`
counts planned windows. `window_rows=0` plans every call.

Worked example (seq_len 8, max_segments 4, window 3, window_rows 2: a window is planned from
8 pieces or 16 tokens)::

    call 0:    lengths 5 2 6      13 tokens, 3 pieces: they wait (no rows)
    call 1:    lengths 3 4 1      21 tokens: window 0 = 5 2 6 3 4 1, sorted 6 5 4 3 2 1
                                  -> [6, 2] and [5, 3] full: emitted; [4, 1] stays open
    finish:                       [4, 1] emitted

Worked example (as above, window_rows 0 and max_open_rows 1; rows take two pieces of the three
of a window: the open rows are extended)::

    window 0:  lengths 5 2 6      sorted 6 5 2 -> row 0 = [6, 2] (full: emitted), row 1 = [5]
                                  row 1 is carried over (room 3)
    window 1:  lengths 3 4 1      sorted 4 3 1 -> row 1 += 3 (full: emitted), row 2 = [4, 1]
    finish:                       row 2 emitted

`StreamPlanner` plans lengths only (the Grain pipeline keeps the tokens); `pack_stream`
is the whole online packer over an iterable of token arrays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from seqpack.packer.bounds import SLOTS_BIND_HALF, slot_share
from seqpack.packer.config import PackConfig, Strategy
from seqpack.packer.inputs import check_count, check_lengths
from seqpack.packer.online.state_codec import decode_planner_state, encode_row_arrays
from seqpack.packer.plan import Counters, PackPlan, aligned, apply_overflow, order_pieces
from seqpack.packer.strategies import BestFitBins, assign_best_fit_decreasing, keep_open

STREAM_STRATEGIES = (Strategy.BEST_FIT_DECREASING, Strategy.BEST_FIT)
_ID, _START, _LEN, _BORN, _ROW = range(5)  # columns of StreamPlanner._held


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
        window_rows: int = 128,
    ) -> None:
        if config.strategy not in STREAM_STRATEGIES:
            raise ValueError(
                f"strategy={str(config.strategy)!r} cannot stream; use one of "
                f"{[s.value for s in STREAM_STRATEGIES]} (concat_split: plan offline)"
            )
        window = check_count("window", window, 1)
        max_open_rows = window if max_open_rows is None else \
            check_count("max_open_rows", max_open_rows, 0)
        max_carry = check_count("max_carry", max_carry, 0)
        window_rows = check_count("window_rows", window_rows, 0)
        self.config = config
        self.window = window
        self.max_open_rows = max_open_rows
        self.max_carry = max_carry
        self.window_rows = window_rows
        # Pieces of the open rows, i64[P, 5]: id, start, length, window it arrived in, open row
        # (0..num_open_rows-1), sorted by (row, born, id, start).
        self._held = np.zeros((0, 5), np.int64)
        self._open_rows = 0
        self._windows = 0
        # Pieces of the calls since the last plan, waiting for `window_rows` rows' worth (as
        # `_held`, row -1, born the window they will be planned in): one array per call (a
        # wait of k calls copies each piece once, not k times), their pieces, aligned tokens
        # and smallest id so far.
        self._pending: list[np.ndarray] = []
        self._pending_pieces = self._pending_tokens = 0
        self._pending_min_id: int | None = None
        self.counters = Counters()

    @property
    def _pending_calls(self) -> int:
        return len(self._pending)

    def _take_pending(self) -> np.ndarray:
        """The waiting pieces as one array (i64[P, 5]), no longer waiting."""
        out = np.concatenate([np.zeros((0, 5), np.int64), *self._pending])
        self._pending = []
        self._pending_pieces = self._pending_tokens = 0
        self._pending_min_id = None
        return out

    # -- planning ------------------------------------------------------------------------------
    def add(self, ids: object, lengths: object) -> list[RowPlan]:
        """Plans one window of examples; returns the rows that became final."""
        return rows_from_plan(self.add_plan(ids, lengths))

    def finish(self) -> list[RowPlan]:
        """Emits every open row (end of stream)."""
        return rows_from_plan(self.finish_plan())

    def add_plan(self, ids: object, lengths: object, *, flush: bool = False) -> PackPlan:
        """`add`, returning the final rows as one `PackPlan` (`example` holds the ids);
        `flush`: every row, as `finish` (the planner goes on empty: a mixture's stage ends)."""
        ids = np.asarray(ids, np.int64)
        lengths = check_lengths(lengths)
        if ids.shape != lengths.shape:
            raise ValueError(f"ids {ids.shape} and lengths {lengths.shape} must have one shape")
        example, start, length, counters = apply_overflow(lengths, self.config, ids=ids)
        self.counters = self.counters + counters
        new = np.stack([ids[example], start, length,
                        np.full(example.size, self._windows, np.int64),
                        np.full(example.size, -1, np.int64)], axis=1)
        self._pending.append(new)
        self._pending_pieces += len(new)
        self._pending_tokens += int(aligned(length, self.config.alignment).sum())
        if new.size:
            low = int(new[:, _ID].min())
            self._pending_min_id = low if self._pending_min_id is None \
                else min(low, self._pending_min_id)
        if not flush and self._waits():
            none = np.zeros(0, np.int64)
            return order_pieces(none, none, none, none, 0, Counters(), self.config)
        window = self.window * self._pending_calls
        pieces = np.concatenate([self._held, self._take_pending()])
        self._windows += 1
        return self._plan(pieces, final=flush, window=window)

    def finish_plan(self) -> PackPlan:
        """`finish`, returning the rows as one `PackPlan`."""
        pieces = np.concatenate([self._held, self._take_pending()])
        return self._plan(pieces, final=True, window=self.window)

    def _waits(self) -> bool:
        """Whether the pieces of the calls since the last plan wait for more: they fill fewer
        than `window_rows` rows, in tokens and in slots (best_fit_decreasing only; see the
        module docstring)."""
        cfg = self.config
        if cfg.strategy is not Strategy.BEST_FIT_DECREASING or not self.window_rows:
            return False
        k = self.window_rows
        return self._pending_pieces < k * cfg.max_segments \
            and self._pending_tokens < k * cfg.seq_len

    def _plan(self, pieces: np.ndarray, *, final: bool, window: int) -> PackPlan:
        """Plans `pieces` (i64[P, 5], see `_held`) as a window of `window` examples, emits the
        final rows, keeps the rest open."""
        cfg = self.config
        sizes = aligned(pieces[:, _LEN], cfg.alignment)
        if not final and self._extends(sizes, window):
            row, num_rows = self._extend(pieces, sizes)
            emit = self._final_extended(pieces, sizes, row, num_rows)
        else:  # planned again, oldest first among equal sizes
            order = np.lexsort((pieces[:, _START], pieces[:, _ID], pieces[:, _BORN]))
            pieces, sizes = pieces[order], sizes[order]
            row, num_rows = assign_best_fit_decreasing(sizes, cfg.seq_len, cfg.max_segments,
                                                       slack=0, repair_rows=True,
                                                       window=0 if final else window)
            emit = np.ones(num_rows, bool)
            if not final:
                emit, row = self._final_rows(pieces, sizes, row, num_rows, window)
        out = emit[row]
        held = pieces[~out].copy()
        kept = np.flatnonzero(~emit)
        label = np.full(num_rows, -1, np.int64)
        label[kept] = np.arange(kept.size)
        held[:, _ROW] = label[row[~out]]
        self._held = held[np.lexsort((held[:, _START], held[:, _ID], held[:, _BORN],
                                      held[:, _ROW]))]
        self._open_rows = int(kept.size)
        number = np.cumsum(emit) - 1
        done = pieces[out]
        return order_pieces(done[:, _ID], done[:, _START], done[:, _LEN], number[row[out]],
                            int(emit.sum()), Counters(), cfg)

    def _extends(self, sizes: np.ndarray, window: int) -> bool:
        """Whether this window only adds pieces to the open rows (best fit, as they are) instead
        of planning everything again: with best_fit, and where a row takes more than a quarter
        of a window's pieces while slots do not bind (rows then grow over several windows;
        planning them again would find them a few tokens short of full)."""
        cfg = self.config
        if cfg.strategy is Strategy.BEST_FIT:
            return True
        if not sizes.size:
            return False
        mean = float(sizes.mean())
        slots = cfg.seq_len / (cfg.max_segments * mean)
        per_row = min(cfg.max_segments, cfg.seq_len / mean)
        return window <= 4 * per_row and slots < 1

    def _extend(self, pieces: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, int]:
        """Rows of the pieces: open rows keep theirs; new pieces (row -1) go by best fit, largest
        first (best_fit: in order), into the open rows or new ones."""
        cfg = self.config
        bins = BestFitBins(cfg.seq_len, cfg.max_segments)
        row = pieces[:, _ROW].copy()
        old = row >= 0
        m = int(row[old].max()) + 1 if old.any() else 0
        used = np.bincount(row[old], weights=sizes[old], minlength=m).astype(np.int64)
        count = np.bincount(row[old], minlength=m)
        for r in range(m):
            bins.add_row(cfg.seq_len - int(used[r]), int(count[r]))
        new = np.flatnonzero(~old)
        if cfg.strategy is Strategy.BEST_FIT_DECREASING:
            new = new[np.argsort(-sizes[new], kind="stable")]
        row[new] = bins.place(sizes[new].tolist())
        return row, bins.next_row

    def _final_extended(self, pieces: np.ndarray, sizes: np.ndarray, row: np.ndarray,
                        num_rows: int) -> np.ndarray:
        """bool[num_rows]: rows to emit after `_extend`: full (no room or every slot used),
        holding a piece due (open `max_carry` windows), or beyond `max_open_rows` (the
        fullest first)."""
        cfg = self.config
        used = np.bincount(row, weights=sizes, minlength=num_rows)
        count = np.bincount(row, minlength=num_rows)
        emit = (used >= cfg.seq_len) | (count >= cfg.max_segments)
        emit[row[pieces[:, _BORN] <= self._windows - 1 - self.max_carry]] = True
        rest = np.flatnonzero(~emit)
        excess = rest.size - self.max_open_rows
        if excess > 0:
            emit[rest[np.lexsort((rest, -used[rest]))][:excess]] = True
        return emit

    def _final_rows(self, pieces: np.ndarray, sizes: np.ndarray, row: np.ndarray,
                    num_rows: int, window: int) -> tuple[np.ndarray, np.ndarray]:
        """(bool[num_rows]: rows to emit, row per piece). Kept open: rows not exactly full,
        even with no room for the smallest piece or no free slot (planned again with the next
        window, their pieces may pack tighter) and, where slots bind, rows full in tokens but short
        in slots (`_slot_poor_open`), least filled first, up to `max_open_rows` rows and
        2 * `window` pieces (or 2 rows of tokens, when rows take more than a window). Pieces
        open half of `max_carry` windows trade places with younger pieces of their size in
        emitted rows (the smallest pieces, placed last, would otherwise stay behind); a piece
        due (open `max_carry` windows) with a younger piece of at least its size; a row still
        holding one is emitted."""
        cfg = self.config
        used = np.bincount(row, weights=sizes, minlength=num_rows)
        count = np.bincount(row, minlength=num_rows)
        keep = keep_open(_slot_poor_open(used, count, cfg.seq_len, cfg.max_segments), count,
                         cfg.seq_len, self.max_open_rows, window)
        emit = np.ones(num_rows, bool)
        emit[keep] = False
        age = self._windows - 1 - pieces[:, _BORN]
        due = age >= self.max_carry
        old = age >= (self.max_carry + 1) // 2
        if (old & ~emit[row]).any() and emit.any():  # old pieces leave by full rows, early
            row = _trade(row, sizes, old & ~emit[row], ~old & emit[row],
                         np.zeros(num_rows), exact=True)
        stuck = due & ~emit[row]
        if stuck.any():
            used = np.bincount(row, weights=sizes, minlength=num_rows)
            row = _trade(row, sizes, stuck, ~due & emit[row], cfg.seq_len - used)
            emit[row[due]] = True
        return emit, row

    def reopen(self, ids: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Puts the open rows' pieces and the given ones (of rows planned but not emitted)
        back to waiting, as one call: the next window plans them again with its own pieces
        (a restore under edited weights). Returns i64[P, 3]: (id, start, length) of every
        piece now waiting."""
        given = np.stack([np.asarray(a, np.int64) for a in (ids, starts, lengths)], 1)
        given = np.concatenate([given, np.full((len(given), 1), max(self._windows - 1, 0)),
                                np.full((len(given), 1), -1)], 1).astype(np.int64)
        waiting = np.concatenate([self._held, self._take_pending(), given])
        waiting[:, _ROW] = -1
        self._held = np.zeros((0, 5), np.int64)
        self._open_rows = 0
        self._pending = [waiting]
        self._pending_pieces = len(waiting)
        self._pending_tokens = int(aligned(waiting[:, _LEN], self.config.alignment).sum())
        self._pending_min_id = int(waiting[:, _ID].min()) if len(waiting) else None
        return waiting[:, :3].copy()

    # -- state ---------------------------------------------------------------------------------
    def oldest_open_id(self) -> int | None:
        """The smallest example id in any open row or waiting to be planned (None: none)."""
        low = [int(self._held[:, _ID].min())] if self._held.size else []
        if self._pending_min_id is not None:
            low.append(self._pending_min_id)
        return min(low) if low else None

    @property
    def num_open_rows(self) -> int:
        return self._open_rows

    def get_state(self) -> dict:
        """JSON-serializable state: the open rows, each its pieces as (id, start, length, window
        it arrived in) and "born" the earliest of those windows, then (where "pending" is 1)
        the pieces waiting to be planned, as one more row; the calls they came in
        ("pending_calls") and the counters. (`get_encoded_state`, decoded.)"""
        return decode_planner_state(self.get_encoded_state())

    def get_encoded_state(self) -> dict:
        """The state in the checkpoint form of `state_codec` (rows as one string), built from
        the arrays."""
        return self.snapshot()()

    def snapshot(self) -> Callable[[], dict]:
        """The state as it is now, encoded when called (`get_encoded_state`): `PackIterDataset`
        takes one after every window and encodes it only for a checkpoint (encoding costs more
        than the window's plan). The arrays it holds are never written in place, only
        replaced."""
        held, parts, rows, windows = self._held, tuple(self._pending), self._open_rows, \
            self._windows
        calls, counters = self._pending_calls, self.counters.to_dict()

        def encode() -> dict:
            pending = np.concatenate([np.zeros((0, 5), np.int64), *parts])
            born = np.full(rows + (calls > 0), windows, np.int64)
            if held.size:
                np.minimum.at(born, held[:, _ROW], held[:, _BORN])
            if calls and pending.size:
                born[-1] = int(pending[:, _BORN].min())
            row = np.concatenate([held[:, _ROW], np.full(len(pending), rows, np.int64)])
            scalars = {"windows": windows, "rows": None, "pending": int(calls > 0),
                       "pending_calls": calls, "counters": counters}
            return encode_row_arrays(scalars, born, np.concatenate([held, pending])[:, :4], row)

        return encode

    def set_state(self, state: dict) -> None:
        """Restores a state from `get_state` (on a planner with the same config). Pieces of
        three numbers (states before pieces kept their window) take their row's "born"; states
        without "pending" have no pieces waiting."""
        parts = []
        for k, r in enumerate(state["rows"]):
            p = np.asarray(r["pieces"], np.int64).reshape(len(r["pieces"]), -1) \
                if r["pieces"] else np.zeros((0, 4), np.int64)
            if p.shape[1] == 3:
                p = np.concatenate([p, np.full((len(p), 1), int(r["born"]), np.int64)], axis=1)
            parts.append(np.concatenate([p[:, :4], np.full((len(p), 1), k, np.int64)], axis=1))
        self._take_pending()
        calls = int(state.get("pending_calls", 0))
        if calls:
            # the calls' pieces as one array, then a part for each of the other calls (no
            # pieces): what counts is the pieces and the number of calls
            waiting = parts.pop() if int(state.get("pending", 0)) \
                else np.zeros((0, 5), np.int64)
            waiting[:, _ROW] = -1
            self._pending = [waiting] + [waiting[:0]] * (calls - 1)
            self._pending_pieces = len(waiting)
            self._pending_tokens = int(aligned(waiting[:, _LEN],
                                               self.config.alignment).sum())
            if waiting.size:
                self._pending_min_id = int(waiting[:, _ID].min())
        held = np.concatenate(parts) if parts else np.zeros((0, 5), np.int64)
        self._held = held[np.lexsort((held[:, _START], held[:, _ID], held[:, _BORN],
                                      held[:, _ROW]))]
        self._open_rows = len(parts)
        self._windows = int(state["windows"])
        self.counters = Counters(**state["counters"])


def _slot_poor_open(used: np.ndarray, count: np.ndarray, capacity: int, max_segments: int
                    ) -> np.ndarray:
    """`used` with the rows full in tokens but short in slots made to look one token short, so
    `keep_open` keeps them open after the rows with room: where the window's slot bound is at
    least half its token bound (`slot_share`), a row full in tokens with fewer pieces than
    the window's mean per row spends the big pieces that the rows to come need to carry their
    short ones."""
    n, tokens = int(count.sum()), int(used.sum())
    if not count.size or slot_share(n, tokens, capacity, max_segments) < SLOTS_BIND_HALF:
        return used
    poor = (used >= capacity) & (count < n / count.size) & (count < max_segments)
    if not poor.any():
        return used
    out = used.copy()
    out[poor] = capacity - 1
    return out


def _trade(row: np.ndarray, sizes: np.ndarray, stuck: np.ndarray, free: np.ndarray,
           room: np.ndarray, *, exact: bool = False) -> np.ndarray:
    """Trades rows between `stuck` pieces (in rows kept open) and `free` ones (in rows emitted):
    each stuck piece of size x, smallest first, takes the place of the smallest unused free
    piece of size y >= x whose difference its own row has room for (`room`, f64[rows]: the
    kept row gains y - x, the emitted one loses it; counts do not change). `exact`: y = x only
    (no row changes its load)."""
    row = row.copy()
    room = room.copy()
    s_idx, f_idx = np.flatnonzero(stuck), np.flatnonzero(free)
    s_idx = s_idx[np.argsort(sizes[s_idx], kind="stable")]
    f_idx = f_idx[np.argsort(sizes[f_idx], kind="stable")]
    f_sizes = sizes[f_idx].tolist()
    k = 0
    for a in s_idx.tolist():
        x = int(sizes[a])
        while k < len(f_sizes) and f_sizes[k] < x:
            k += 1
        if k == len(f_sizes):
            break
        b = int(f_idx[k])
        y = f_sizes[k]
        if exact and y != x:
            continue
        if y - x > room[row[a]]:
            continue  # this row cannot take the bigger piece; the row will be emitted
        room[row[a]] -= y - x
        room[row[b]] += y - x
        row[a], row[b] = row[b], row[a]
        k += 1
    return row
