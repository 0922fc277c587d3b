"""The examples a packer holds, as (dataset, index) references into a mixture.

`PackIterDataset` over a `Mixture` numbers the examples it reads 0, 1, ... (its ids); this
table maps each held id to its dataset and its index there, labels built rows with
`segment_dataset_id` and the index within the dataset, and encodes the ids a checkpoint needs
as one string (`flight.encode_table`), so a restore fetches them instead of replaying. Each
reference keeps its example's size (the first feature's tokens), so a restore can tell an
example that changed since the save (`restore.fetch`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from seqpack.packer.contract import DATASET_DTYPE, DATASET_ID, SOURCE_DTYPE, SOURCE_INDEX
from seqpack.pipelines.datasets.elastic.flight import decode_table, encode_table

Refs = tuple[np.ndarray, np.ndarray, np.ndarray]  # dataset i32, index i64, size i64 per example


class RefTable:
    """Window number -> (dataset i32[w], index i64[w], size i64[w]) of that window's examples
    (-1: unknown)."""

    def __init__(self, window: int):
        self.window = window
        self.windows: dict[int, Refs] = {}

    def put(self, k: int, dataset: np.ndarray, index: np.ndarray, size: np.ndarray) -> None:
        self.windows[k] = (dataset, index, np.asarray(size, np.int64))

    def put_ids(self, ids: np.ndarray, dataset: np.ndarray, index: np.ndarray,
                size: np.ndarray) -> None:
        """Scattered ids (a restore): their windows, -1 where an id is not given."""
        w = self.window
        for k in np.unique(ids // w).tolist():
            sel = ids // w == k
            d = np.full(w, -1, np.int32)
            i, n = np.full(w, -1, np.int64), np.full(w, -1, np.int64)
            at = ids[sel] % w
            d[at], i[at], n[at] = dataset[sel], index[sel], size[sel]
            self.windows[k] = (d, i, n)

    def drop_below(self, oldest: int) -> None:
        """Forgets the windows wholly before id `oldest`."""
        for k in [k for k in self.windows if (k + 1) * self.window <= oldest]:
            del self.windows[k]

    def lookup(self, ids: np.ndarray) -> Refs:
        """(dataset, index, size) of held `ids` (i64[n])."""
        w = self.window
        if not ids.size:
            return np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int64)
        lo, hi = int(ids.min()) // w, int(ids.max()) // w
        out = (np.full((hi - lo + 1) * w, -1, np.int32), np.full((hi - lo + 1) * w, -1, np.int64),
               np.full((hi - lo + 1) * w, -1, np.int64))
        for k, refs in self.windows.items():
            if lo <= k <= hi:
                for full, part in zip(out, refs):
                    full[(k - lo) * w:(k - lo) * w + part.size] = part
        return out[0][ids - lo * w], out[1][ids - lo * w], out[2][ids - lo * w]

    def label(self, batch: dict[str, np.ndarray], *, datasets: bool = True) -> None:
        """Rows of ids -> the index within each dataset (and, `datasets`, each segment's
        `segment_dataset_id`), in place."""
        src = batch.get(SOURCE_INDEX)
        if src is None:
            return
        used = src >= 0
        d, i, _ = self.lookup(src[used])
        dataset = np.full(src.shape, -1, DATASET_DTYPE)
        index = np.full(src.shape, -1, SOURCE_DTYPE)
        dataset[used], index[used] = d, i
        batch[SOURCE_INDEX] = index
        if datasets:
            batch[DATASET_ID] = dataset

    def deferred(self, open_ids: Callable[[Any], Iterable[int]], first: int, end: int
                 ) -> Callable[[Any], str]:
        """planner state -> `encode` of its open ids and of [first, end), over the windows held
        now (a checkpoint encodes it only when asked)."""
        table = RefTable(self.window)
        table.windows = dict(self.windows)
        return lambda planner: table.encode([*open_ids(planner), *range(first, end)])

    def rename(self, message: str, names: tuple[str, ...]) -> str:
        """`message` with "example <id>" (an id of the packer's stream) as the dataset's name
        (of `names`; one: the source's) and the example's index there."""
        def named(m: re.Match) -> str:
            d, i, _ = self.lookup(np.array([int(m.group(1))]))
            if len(names) == 1:
                return f"example {int(i[0])} of the source"
            return f"dataset {names[int(d[0])]!r} example {int(i[0])}"
        return re.sub(r"\bexample (\d+)", named, message, count=1)

    def encode(self, ids: Iterable[int]) -> str:
        """The references of `ids` as one string (`flight.encode_table` of the sorted ids, their
        datasets, indices and sizes)."""
        arr = np.asarray(sorted(set(ids)), np.int64)
        d, i, n = self.lookup(arr)
        return encode_table(np.stack([arr, d.astype(np.int64), i, n], 1), deltas=(0,))


def decode_refs(blob: str) -> tuple[np.ndarray, Refs]:
    """(ids i64, (dataset i32, index i64, size i64)) of `RefTable.encode`; sizes -1 in a state
    saved before they were recorded."""
    table = decode_table(blob)
    size = table[:, 3].copy() if table.shape[1] > 3 else np.full(len(table), -1, np.int64)
    return table[:, 0].copy(), (table[:, 1].astype(np.int32), table[:, 2].copy(), size)
