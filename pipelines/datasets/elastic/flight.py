"""The examples a packer holds in flight, named by reference, pooled over a layout and dealt out.

In flight at a checkpoint: the pieces of the rows planned but not yet emitted, and of the rows
kept open or waiting. Each piece is (example, start, length per packed feature); each example
is (dataset, index) in its source. A `Flight` holds them as arrays; `encode` / `decode` are its
checkpoint form (base64(zlib(i64))). `share` deals whole examples (every piece of a split
example together) to the consumers of a new layout, example e to consumer e mod K.

Worked example (two examples in flight, one split; K = 2)::

    examples   0: (dataset 0, index 7)        1: (dataset 1, index 3)
    pieces     (0, start 2048, 900)   (1, start 0, 12)   (0, start 0, 2048)
    share(0, 2): example 7's two pieces        share(1, 2): example 3's piece
"""

from __future__ import annotations

import base64
import dataclasses
import zlib

import numpy as np


def encode_table(table: np.ndarray) -> str:
    """i64[n, w] as one string: base64(zlib(i64[n, w, *values]))."""
    table = np.asarray(table, np.int64)
    flat = np.concatenate(([table.shape[0], table.shape[1]], table.ravel())).astype("<i8")
    return base64.b64encode(zlib.compress(flat.tobytes(), 1)).decode("ascii")


def decode_table(blob: str) -> np.ndarray:
    flat = np.frombuffer(zlib.decompress(base64.b64decode(blob)), "<i8")
    n, w = int(flat[0]), int(flat[1])
    return flat[2:].reshape(n, w).astype(np.int64)


@dataclasses.dataclass
class Flight:
    """Examples in flight: `dataset` and `index` i64[E] each; `pieces` i64[P, 2 + F]:
    (example number in [0, E), start, length per packed feature)."""

    dataset: np.ndarray
    index: np.ndarray
    pieces: np.ndarray

    @classmethod
    def empty(cls, features: int) -> Flight:
        none = np.zeros(0, np.int64)
        return cls(none, none.copy(), np.zeros((0, 2 + features), np.int64))

    @classmethod
    def of(cls, ids: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
           refs: tuple[np.ndarray, np.ndarray, np.ndarray]) -> Flight:
        """Pieces of a packer's examples `ids` (i64[P]; `lengths` i64[P, F]), named by `refs`
        (ids i64 sorted, dataset, index: `mixing.decode_refs`)."""
        ref_ids, dataset, index = refs
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
        return cls(dataset[at].astype(np.int64), index[at].astype(np.int64), pieces)

    @property
    def num_examples(self) -> int:
        return int(self.dataset.size)

    @classmethod
    def concat(cls, flights: list[Flight], features: int) -> Flight:
        out, first = [Flight.empty(features)], 0
        for f in flights:
            p = f.pieces.copy()
            p[:, 0] += first
            out.append(Flight(f.dataset, f.index, p))
            first += f.num_examples
        return cls(np.concatenate([f.dataset for f in out]),
                   np.concatenate([f.index for f in out]),
                   np.concatenate([f.pieces for f in out]))

    def share(self, index: int, count: int) -> Flight:
        """Consumer `index` of `count`'s examples (e mod count == index), renumbered."""
        mine = np.arange(index, self.num_examples, count)
        keep = self.pieces[:, 0] % count == index
        pieces = self.pieces[keep].copy()
        pieces[:, 0] //= count
        return Flight(self.dataset[mine], self.index[mine], pieces)

    def encode(self) -> dict[str, str]:
        return {"examples": encode_table(np.stack([self.dataset, self.index], 1)),
                "pieces": encode_table(self.pieces)}

    @classmethod
    def decode(cls, state: dict[str, str]) -> Flight:
        ex = decode_table(state["examples"])
        return cls(ex[:, 0].copy(), ex[:, 1].copy(), decode_table(state["pieces"]))
