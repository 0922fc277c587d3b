"""In-memory example source and a lean in-order iterator over any random-access Grain dataset.

`ArraySource` serves examples from ragged columns held in memory (Arrow list layout: flat
values + offsets), as a `grain.MapDataset` with random access. `SequentialIterDataset` walks a
`MapDataset` in index order with a one-integer state; it is what the packing datasets read from
in benchmarks (Grain's own `to_iter_dataset()` adds a thread pool and per-element statistics, a
cost per example measured in benchmarks/README.md).

Example::

    src = ArraySource.from_sequences([[5, 6, 7], [8], [9, 10]])
    src[2]                        # {"tokens": array([ 9, 10], dtype=int32)}
    ds = SequentialIterDataset(src.shuffle(seed=0))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np

from seqpack.packer.inputs import check_offsets, check_values, ragged_from_sequences


def locate(cum_counts: np.ndarray, index: int) -> tuple[int, int]:
    """(file number, index inside that file) for a global index; cum_counts is i64[files + 1]."""
    f = int(np.searchsorted(cum_counts, index, side="right")) - 1
    return f, index - int(cum_counts[f])


def norm_index(index: int, n: int, name: str) -> int:
    if n == 0:
        raise IndexError(f"{name} is empty; nothing at index {index}")
    return int(index) % n


def as_path_list(paths: Any, *, name: str) -> list[str]:
    """Accepts one path or a sequence of paths; returns them as strings."""
    if isinstance(paths, (str, bytes)) or hasattr(paths, "__fspath__"):
        paths = [paths]
    out = [str(p) for p in paths]
    if not out:
        raise ValueError(f"{name}: no files given; pass at least one path")
    return out


class ArraySource(grain.MapDataset):
    """Examples from in-memory columns; each element is a dict of per-example numpy arrays.

    columns: name -> (values, offsets) for a ragged column (values X[N], offsets i64[n + 1],
             example i is values[offsets[i]:offsets[i + 1]]), or name -> array[n] for a
             per-example scalar column (e.g. an example id). All columns need the same n.
    value_columns: ragged columns of any integers (labels with -100, masks); the other ragged
             columns hold token ids, checked >= 0.
    Elements are views into `values` (no copy).
    """

    def __init__(self, columns: Mapping[str, Any], *, value_columns: Sequence[str] = ()):
        super().__init__()
        if not columns:
            raise ValueError("columns={} is empty; pass at least one column, e.g. tokens")
        self._ragged: list[tuple[str, np.ndarray, np.ndarray]] = []
        self._scalar: list[tuple[str, np.ndarray]] = []
        n = None
        for name, col in columns.items():
            if isinstance(col, tuple):
                values, offsets = col
                if name in value_columns:
                    values = np.asarray(values)
                    if values.ndim != 1 or (values.size and values.dtype.kind not in "iu"):
                        raise ValueError(f"columns[{name!r}] values must be a 1-D integer "
                                         f"array, got shape {values.shape} dtype {values.dtype}")
                else:
                    values = check_values(values, name=f"columns[{name!r}] values")
                offsets = check_offsets(offsets, values.size)
                self._ragged.append((name, values, offsets))
                size = offsets.size - 1
            else:
                arr = np.asarray(col)
                if arr.ndim != 1:
                    raise ValueError(
                        f"columns[{name!r}] has shape {arr.shape}; a scalar column is 1-D, "
                        "a ragged one is a (values, offsets) tuple"
                    )
                self._scalar.append((name, arr))
                size = arr.size
            if n is not None and size != n:
                raise ValueError(
                    f"columns[{name!r}] holds {size} examples but earlier columns hold {n}"
                )
            n = size
        self._n = int(n)
        if len(self._ragged) == 1 and not self._scalar:
            name, values, offsets = self._ragged[0]
            # Python ints index fastest; past 10M examples keep numpy (the list costs 36 B each).
            fast = offsets.tolist() if offsets.size <= 10_000_000 else offsets
            self._single = (name, values, fast)
        else:
            self._single = None

    @classmethod
    def from_ragged(
        cls, values: np.ndarray, offsets: np.ndarray, *, feature: str = "tokens"
    ) -> ArraySource:
        """One ragged feature: values X[N] back to back, offsets i64[n + 1]."""
        return cls({feature: (values, offsets)})

    @classmethod
    def from_sequences(
        cls, sequences: Sequence[Any], *, feature: str = "tokens", dtype: Any = np.int32
    ) -> ArraySource:
        """One ragged feature from a list of 1-D integer sequences (copied once)."""
        values, offsets = ragged_from_sequences(sequences)
        return cls({feature: (values.astype(dtype, copy=False), offsets)})

    def __len__(self) -> int:
        return self._n

    def __str__(self) -> str:
        return f"ArraySource(n={self._n}, columns={[c[0] for c in self._ragged + self._scalar]})"

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        if self._single is not None:
            name, values, offsets = self._single
            i = index if 0 <= index < self._n else norm_index(index, self._n, str(self))
            return {name: values[offsets[i] : offsets[i + 1]]}
        i = index if 0 <= index < self._n else norm_index(index, self._n, str(self))
        out = {name: values[offsets[i] : offsets[i + 1]] for name, values, offsets in self._ragged}
        for name, arr in self._scalar:
            out[name] = arr[i]
        return out


class SequentialIterator(grain.DatasetIterator):
    """Reads parent[0], parent[1], ... skipping None (filtered) elements."""

    def __init__(self, parent: grain.MapDataset):
        super().__init__()
        self._source = parent
        self._len = len(parent)
        self._next = 0

    def __next__(self):
        source, n = self._source, self._len
        while self._next < n:
            i = self._next
            self._next = i + 1
            element = source[i]
            if element is not None:
                return element
        raise StopIteration

    def get_state(self) -> dict[str, Any]:
        return {"next_index": self._next}

    def set_state(self, state: dict[str, Any]) -> None:
        self._next = int(state["next_index"])

    def _get_next_index(self) -> int:
        return self._next

    def _set_next_index(self, index: int) -> None:
        self._next = int(index)

    def __str__(self) -> str:
        return "SequentialIterator"


class SequentialIterDataset(grain.IterDataset):
    """Iterates a `MapDataset` once, in index order, in the calling thread.

    State is `{"next_index": i}`. Supports Grain's worker slicing, so it works under
    `mp_prefetch`: each worker reads `parent[worker::num_workers]` (or a contiguous block with
    `sequential_slice=True`).
    """

    def __init__(self, parent: grain.MapDataset):
        if not isinstance(parent, grain.MapDataset):
            raise ValueError(
                f"parent={type(parent).__name__} must be a grain.MapDataset (random access); "
                "wrap a plain source with grain.MapDataset.source(...)"
            )
        super().__init__(parent)

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        """Called by Grain in each prefetch worker (mutates this copy of the dataset)."""
        parent = self._parent
        if sequential_slice:
            n, k, w = len(parent), sl.step or 1, sl.start or 0
            lo, hi = (n * w) // k, (n * (w + 1)) // k
            self._parents = (parent.slice(slice(lo, hi)),)
        else:
            self._parents = (parent.slice(sl),)

    def __iter__(self) -> SequentialIterator:
        return SequentialIterator(self._parent)

    def __str__(self) -> str:
        return "SequentialIterDataset"


def read_options_inline() -> grain.ReadOptions:
    """ReadOptions that read in the calling thread (no thread pool)."""
    return grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
