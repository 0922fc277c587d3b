"""The examples a packer holds, as (dataset, index) references into a mixture.

`PackIterDataset` over a `Mixture` numbers the examples it reads 0, 1, ... (its ids); this
table maps each held id to its dataset and its index there, labels built rows with
`segment_dataset_id` and the index within the dataset, and encodes the ids a checkpoint needs
as one string (`flight.encode_table`), so a restore fetches them instead of replaying.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from seqpack.packer.contract import DATASET_DTYPE, DATASET_ID, SOURCE_DTYPE, SOURCE_INDEX
from seqpack.pipelines.datasets.elastic.flight import decode_table, encode_table


class RefTable:
    """Window number -> (dataset i32[w], index i64[w]) of that window's examples (-1: unknown)."""

    def __init__(self, window: int):
        self.window = window
        self.windows: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def put(self, k: int, dataset: np.ndarray, index: np.ndarray) -> None:
        self.windows[k] = (dataset, index)

    def put_ids(self, ids: np.ndarray, dataset: np.ndarray, index: np.ndarray) -> None:
        """Scattered ids (a restore): their windows, -1 where an id is not given."""
        w = self.window
        for k in np.unique(ids // w).tolist():
            sel = ids // w == k
            d = np.full(w, -1, np.int32)
            i = np.full(w, -1, np.int64)
            d[ids[sel] % w], i[ids[sel] % w] = dataset[sel], index[sel]
            self.windows[k] = (d, i)

    def drop_below(self, oldest: int) -> None:
        """Forgets the windows wholly before id `oldest`."""
        for k in [k for k in self.windows if (k + 1) * self.window <= oldest]:
            del self.windows[k]

    def lookup(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dataset, index) of held `ids` (i64[n])."""
        w = self.window
        if not ids.size:
            return np.zeros(0, np.int32), np.zeros(0, np.int64)
        lo, hi = int(ids.min()) // w, int(ids.max()) // w
        d = np.full((hi - lo + 1) * w, -1, np.int32)
        i = np.full(d.size, -1, np.int64)
        for k, (dk, ik) in self.windows.items():
            if lo <= k <= hi:
                d[(k - lo) * w:(k - lo) * w + dk.size] = dk
                i[(k - lo) * w:(k - lo) * w + ik.size] = ik
        return d[ids - lo * w], i[ids - lo * w]

    def label(self, batch: dict[str, np.ndarray], *, datasets: bool = True) -> None:
        """Rows of ids -> the index within each dataset (and, `datasets`, each segment's
        `segment_dataset_id`), in place."""
        src = batch.get(SOURCE_INDEX)
        if src is None:
            return
        used = src >= 0
        d, i = self.lookup(src[used])
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
            d, i = self.lookup(np.array([int(m.group(1))]))
            if len(names) == 1:
                return f"example {int(i[0])} of the source"
            return f"dataset {names[int(d[0])]!r} example {int(i[0])}"
        return re.sub(r"\bexample (\d+)", named, message, count=1)

    def encode(self, ids: Iterable[int]) -> str:
        """The references of `ids` as one string (`flight.encode_table` of the sorted ids, their
        datasets and indices)."""
        arr = np.asarray(sorted(set(ids)), np.int64)
        d, i = self.lookup(arr)
        return encode_table(np.stack([arr, d.astype(np.int64), i], 1), deltas=(0,))


def decode_refs(blob: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids i64, dataset i32, index i64) of `RefTable.encode`."""
    table = decode_table(blob)
    return table[:, 0].copy(), table[:, 1].astype(np.int32), table[:, 2].copy()
