"""The examples a packer holds in flight, named by reference, pooled over a layout and dealt out.

In flight at a checkpoint: the pieces of the rows planned but not yet emitted, and of the rows
kept open or waiting. Each piece is (example, start, length per packed feature); each example
is (dataset, index) in its source, with its size when saved (the first feature's tokens; -1:
not recorded), by which a restore tells an example that changed. A `Flight` holds them as
arrays; `encode` / `decode` are its checkpoint form (base64(zlib(i64))). `share` deals whole
examples (every piece of a split example together) to the consumers of a new layout, example e
to consumer e mod K.

Worked example (two examples in flight, one split; K = 2)::

    examples   0: (dataset 0, index 7)        1: (dataset 1, index 3)
    pieces     (0, start 2048, 900)   (1, start 0, 12)   (0, start 0, 2048)
    share(0, 2): example 7's two pieces        share(1, 2): example 3's piece
"""

from __future__ import annotations

import base64
import dataclasses
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from seqpack.packer.online import decode_planner_state

_WIDTHS = ("<i1", "<i2", "<i4", "<i8")


def encode_table(table: np.ndarray, *, deltas: tuple[int, ...] = ()) -> str:
    """i64[n, w] as one string, small: each column (its differences, for the columns in
    `deltas`) less its minimum, in the narrowest integer type that holds it; zlib; base64.
    States carry one with every element under worker processes, so bytes count."""
    table = np.asarray(table, np.int64)
    n, w = table.shape
    head, body = [n, w], []
    for c in range(w):
        col = table[:, c]
        first = int(col[0]) if n else 0
        if c in deltas and n:
            col = np.diff(col, prepend=first)
        low = int(col.min()) if n else 0
        span = int(col.max()) - low if n else 0
        code = next(k for k, t in enumerate(_WIDTHS) if span < np.iinfo(t).max)
        head += [int(c in deltas), first, low, code]
        body.append((col - low).astype(_WIDTHS[code]).tobytes())
    raw = np.asarray(head, "<i8").tobytes() + b"".join(body)
    return base64.b64encode(zlib.compress(raw, 1)).decode("ascii")


def decode_table(blob: str) -> np.ndarray:
    """Inverse of `encode_table`: i64[n, w]."""
    raw = zlib.decompress(base64.b64decode(blob))
    n, w = (int(v) for v in np.frombuffer(raw[:16], "<i8"))
    head = np.frombuffer(raw[16:16 + 32 * w], "<i8").reshape(w, 4)
    out, at = np.empty((n, w), np.int64), 16 + 32 * w
    for c, (delta, first, low, code) in enumerate(head.tolist()):
        size = np.dtype(_WIDTHS[code]).itemsize * n
        col = np.frombuffer(raw[at:at + size], _WIDTHS[code]).astype(np.int64) + low
        out[:, c] = np.cumsum(col) - col[0] + first if delta and n else col
        at += size
    return out


@dataclasses.dataclass
class Flight:
    """Examples in flight: `dataset`, `index` and `size` i64[E] each; `pieces` i64[P, 2 + F]:
    (example number in [0, E), start, length per packed feature)."""

    dataset: np.ndarray
    index: np.ndarray
    size: np.ndarray
    pieces: np.ndarray

    @classmethod
    def empty(cls, features: int) -> Flight:
        none = np.zeros(0, np.int64)
        return cls(none, none.copy(), none.copy(), np.zeros((0, 2 + features), np.int64))

    @classmethod
    def of(cls, ids: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
           refs: tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]) -> Flight:
        """Pieces of a packer's examples `ids` (i64[P]; `lengths` i64[P, F]), named by `refs`
        (ids i64 sorted, (dataset, index, size): `refs.decode_refs`)."""
        ref_ids, (dataset, index, size) = refs
        ids = np.asarray(ids, np.int64)
        lengths = np.asarray(lengths, np.int64)
        lengths = lengths[:, None] if lengths.ndim == 1 else lengths
        if not ids.size:
            return cls.empty(lengths.shape[1])
        uniq, number = np.unique(ids, return_inverse=True)
        at = np.searchsorted(ref_ids, uniq)
        assert np.array_equal(ref_ids[np.minimum(at, len(ref_ids) - 1)], uniq), "unreferenced"
        pieces = np.concatenate([number[:, None], np.asarray(starts, np.int64)[:, None],
                                 lengths], 1)
        return cls(dataset[at].astype(np.int64), index[at].astype(np.int64),
                   size[at].astype(np.int64), pieces)

    @property
    def refs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(dataset i32, index, size): `refs.Refs`, as a restore fetches them."""
        return self.dataset.astype(np.int32), self.index, self.size

    @property
    def num_examples(self) -> int:
        return int(self.dataset.size)

    @classmethod
    def concat(cls, flights: list[Flight], features: int) -> Flight:
        out, first = [Flight.empty(features)], 0
        for f in flights:
            p = f.pieces.copy()
            p[:, 0] += first
            out.append(Flight(f.dataset, f.index, f.size, p))
            first += f.num_examples
        return cls(*(np.concatenate([getattr(f, k) for f in out])
                     for k in ("dataset", "index", "size", "pieces")))

    def share(self, index: int, count: int) -> Flight:
        """Consumer `index` of `count`'s examples (e mod count == index), renumbered."""
        mine = np.arange(index, self.num_examples, count)
        keep = self.pieces[:, 0] % count == index
        pieces = self.pieces[keep].copy()
        pieces[:, 0] //= count
        return Flight(self.dataset[mine], self.index[mine], self.size[mine], pieces)

    def encode(self) -> dict[str, str]:
        return {"examples": encode_table(np.stack([self.dataset, self.index, self.size], 1)),
                "pieces": encode_table(self.pieces)}

    @classmethod
    def decode(cls, state: dict[str, str]) -> Flight:
        ex = decode_table(state["examples"])  # a state saved before sizes: two columns
        size = ex[:, 2].copy() if ex.shape[1] > 2 else np.full(len(ex), -1, np.int64)
        return cls(ex[:, 0].copy(), ex[:, 1].copy(), size, decode_table(state["pieces"]))


def deferred_flight(layout: Any, plan: Any, order: list[int] | None,
                    after: Callable[[], dict]) -> Callable[[], dict[str, Any]]:
    """The pieces in flight while a staged window's rows leave, encoded when called: i64[P,
    3 + F] (the row's turn to leave in `order`, or -1: open or waiting in the planner state
    `after`; id, start, length per feature), by id; and the planner's counters."""
    counters = layout.counters()

    def encode() -> dict[str, Any]:
        staged = layout.pieces(plan)
        if order is not None and len(staged):
            turn = np.empty(len(order), np.int64)
            turn[np.asarray(order, np.int64)] = np.arange(len(order))
            staged[:, 0] = turn[staged[:, 0]]
        still = layout.open_pieces(decode_planner_state(after()))
        held = np.concatenate([np.full((len(still), 1), -1, np.int64), still], 1)
        table = np.concatenate([staged, held])
        table = table[np.lexsort((table[:, 2], table[:, 1]))]  # by id: small differences
        return {"pieces": encode_table(table, deltas=(1,)), "counters": counters}

    return encode
