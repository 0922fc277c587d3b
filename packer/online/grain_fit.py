"""One multi-bin packed batch with Grain's first-fit / best-fit rules, at a fraction of the cost.

Grain's `FirstFitPackedBatch` / `BestFitPackedBatch` copy every example into its row on arrival
and test every bin with numpy per example. Here an arriving example only picks its bin (pure
Python: a min segment tree for first fit, a sorted key list + bisect for best fit; numpy only
when several features are packed) and is remembered; `finalize()` writes all rows at once with
`packer.assemble` (the one row writer). Bin choice replicates Grain exactly, so rows are identical.

Worked example (one feature, capacity 8, 2 bins, first fit; lengths 5, 4, 3, 2)::

    example:   e0(5)  e1(4)  e2(3)  e3(2)
    bin:       0      1      0      1            (e2 fits bin 0: 5 + 3 <= 8)
    used:      [5,0]  [5,4]  [8,4]  [8,6]
    row 0:     e0 e0 e0 e0 e0 e2 e2 e2    segment ids 1 1 1 1 1 2 2 2
    row 1:     e1 e1 e1 e1 e3 e3 0  0     segment ids 1 1 1 1 2 2 0 0
    best fit sends e2 to the fullest bin it fits (bin 0 again: 5 > 4).
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any

import numpy as np

from seqpack.packer.assemble import RowLayout, fill_rows, write_feature
from seqpack.packer.contract import keys
from seqpack.packer.inputs import InputError, fit_dtype

_INF = 1 << 62


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    """What every batch of one drop-in shares (derived from Grain's constructor arguments)."""

    features: tuple[Any, ...]  # packed features: names, or paths (tuples) of nested leaves
    capacities: tuple[int, ...]
    alignments: tuple[int, ...]
    paddings: tuple[Any, ...]  # None -> zeros
    segment_features: tuple[str, ...]  # packed features that get segment metadata
    nonseq_meta: tuple[str, ...]  # meta features outside length_struct: lists per row
    num_bins: int
    max_sequences_per_bin: int | None
    max_segments: int  # S of the extra [S] keys
    best_fit: bool
    segment_metadata: bool = True  # False: Grain's keys only (no [S] lengths / offsets)


def _length(x: Any) -> int:
    if type(x) is np.ndarray:
        return x.shape[0] if x.ndim else 1
    return 1 if np.ndim(x) == 0 else len(x)


def element_dtypes(element: dict[str, Any], spec: BatchSpec) -> list[np.dtype]:
    """The dtype of each packed feature of `element` (Grain's buffers take the first one's)."""
    out = []
    for k in spec.features:
        x = element[k]
        out.append(np.dtype(np.int64) if np.ndim(x) == 0 and isinstance(x, int)
                   else np.asarray(x).dtype)
    return out


class FitBatch:
    """Bins being filled; `try_add` places one example or reports that none fits.

    `dtypes`: the row dtype of each feature, fixed for the whole run (default: the dtypes of
    `element_for_shapes`). An example of another dtype is cast only if every value fits;
    otherwise `InputError`, never a silent wrap.
    """

    def __init__(self, element_for_shapes: dict[str, Any], spec: BatchSpec,
                 dtypes: list[np.dtype] | None = None):
        self.spec = spec
        nb = spec.num_bins
        self._dtypes = list(dtypes) if dtypes is not None else element_dtypes(
            element_for_shapes, spec)
        self._trails = [() if np.ndim(element_for_shapes[k]) == 0
                        else tuple(np.shape(element_for_shapes[k])[1:]) for k in spec.features]
        self._count = [0] * nb
        self._rows: list[int] = []
        self._slots: list[int] = []
        nf = len(spec.features)
        self._starts: list[list[int]] = [[] for _ in range(nf)]
        self._lens: list[list[int]] = [[] for _ in range(nf)]
        self._values: list[list[Any]] = [[] for _ in range(nf)]
        self._meta: dict[str, list[list[Any]]] = {k: [[] for _ in range(nb)]
                                                  for k in spec.nonseq_meta}
        self._max_seq = spec.max_sequences_per_bin or _INF
        self._key, self._best = spec.features[0], spec.best_fit
        if nf == 1:
            self._used = [0] * nb
            self._cap, self._align = spec.capacities[0], spec.alignments[0]
            if spec.best_fit:
                self._keys = [nb - 1 - b for b in range(nb)][::-1]  # used * nb + (nb - 1 - b)
            else:
                size = 1 << max(0, (nb - 1).bit_length())
                self._size = size
                self._tree = [_INF] * (2 * size)
                for b in range(nb):
                    self._tree[size + b] = 0
                for i in range(size - 1, 0, -1):
                    self._tree[i] = min(self._tree[2 * i], self._tree[2 * i + 1])
        else:
            self._used_m = np.zeros((nf, nb), np.int64)
            self._caps_col = np.asarray(spec.capacities, np.int64)[:, None]
            self._count_np = np.zeros(nb, np.int32)

    # ---- placing one example -------------------------------------------------------------

    def try_add(self, element: dict[str, Any]) -> bool:
        """Adds `element` to the bin Grain would choose; False if no bin has room."""
        spec = self.spec
        if len(spec.features) == 1:
            return self._try_add_single(element)
        xs = [self._coerce(i, element[k]) for i, k in enumerate(spec.features)]
        lens = np.fromiter((_length(x) for x in xs), np.int64, len(xs))
        if np.any(lens > self._caps_col[:, 0]):
            self._too_long(lens.tolist())
        b = self._choose_multi(lens)
        if b < 0:
            return False
        for i, x in enumerate(xs):
            start = int(self._used_m[i, b])
            self._starts[i].append(start)
            self._lens[i].append(int(lens[i]))
            self._values[i].append(x)
            a = spec.alignments[i]
            self._used_m[i, b] = -(-(start + int(lens[i])) // a) * a
        self._count_np[b] += 1
        self._commit(b, element)
        return True

    def _try_add_single(self, element: dict[str, Any]) -> bool:
        # One feature: the hot path, kept inline (this runs once per example).
        x = element[self._key]
        if type(x) is not np.ndarray or x.dtype is not self._dtypes[0]:
            x = self._coerce(0, x)
        n = x.shape[0] if type(x) is np.ndarray and x.ndim else _length(x)
        if n > self._cap:
            self._too_long([n])
        nb = self.spec.num_bins
        if self._best:
            if n == 0 and self.spec.max_sequences_per_bin is not None:
                b = self._choose_bf_zero_length()
                if b < 0:
                    return False
            else:
                keys = self._keys
                i = bisect.bisect_right(keys, (self._cap - n) * nb + nb - 1) - 1
                if i < 0:
                    return False
                b = nb - 1 - keys.pop(i) % nb
        else:
            tree, thr = self._tree, self._cap - n
            if tree[1] > thr:
                return False
            node, size = 1, self._size
            while node < size:
                node <<= 1
                if tree[node] > thr:
                    node += 1
            b = node - size
        used = self._used
        start = used[b]
        self._starts[0].append(start)
        self._lens[0].append(n)
        self._values[0].append(x)
        end = start + n
        if self._align != 1:
            end = -(-end // self._align) * self._align
        used[b] = end
        self._rows.append(b)
        c = self._count[b]
        self._slots.append(c)
        c += 1
        self._count[b] = c
        for k, per_bin in self._meta.items():
            per_bin[b].append(element[k])
        if self._best:
            if c < self._max_seq:
                bisect.insort(self._keys, end * nb + nb - 1 - b)
        else:
            tree = self._tree
            node = self._size + b
            tree[node] = end if c < self._max_seq else _INF
            node >>= 1
            while node:
                v = min(tree[2 * node], tree[2 * node + 1])
                if tree[node] == v:
                    break
                tree[node] = v
                node >>= 1
        return True

    def _coerce(self, i: int, x: Any) -> Any:
        """Feature i's value in the run's dtype (checked: a value that does not fit raises)."""
        arr = np.asarray(x)
        dtype = self._dtypes[i]
        if arr.dtype == dtype:
            return x
        return fit_dtype(arr, dtype, f"feature {self.spec.features[i]!r}", token_ids=False,
                         origin=" (the dtype of the run's first element)")

    def _commit(self, b: int, element: dict[str, Any]) -> None:
        self._rows.append(b)
        self._slots.append(self._count[b])
        self._count[b] += 1
        for k, per_bin in self._meta.items():
            per_bin[b].append(element[k])

    def _too_long(self, lens: list[int]) -> None:
        spec = self.spec
        details = [
            (k, n, c)
            for k, n, c in zip(spec.features, lens, spec.capacities, strict=True)
            if n > c
        ]
        raise InputError(
            "Inputs to packer must be truncated to max length. "
            f"Exceeds: (feature, feature_length, max_length) = {details}; truncate examples "
            "first or use pipelines.PackIterDataset(overflow='truncate'|'split'|'drop')"
        )

    def _choose_bf_zero_length(self) -> int:
        # Grain masks full bins by adding the capacity to their fill; an empty-length example
        # still "fits" a full bin whose fill is 0. Replicate that exactly.
        best, best_used = -1, -1
        for b in range(self.spec.num_bins):
            if self._count[b] < self._max_seq or self._used[b] == 0:
                if self._used[b] > best_used:
                    best, best_used = b, self._used[b]
        if best >= 0 and self._count[best] < self._max_seq:
            nb = self.spec.num_bins
            key = self._used[best] * nb + nb - 1 - best
            del self._keys[bisect.bisect_left(self._keys, key)]
        return best

    def _choose_multi(self, lens: np.ndarray) -> int:
        spec = self.spec
        new = self._used_m + lens[:, None]
        caps = self._caps_col
        if spec.best_fit:
            if spec.max_sequences_per_bin is not None:
                full = self._count_np >= spec.max_sequences_per_bin
                new = new + full.astype(np.int64) * caps
            fit = np.all(new <= caps, axis=0)
            if not fit.any():
                return -1
            scores = self._used_m.sum(axis=0)
            scores[~fit] = -1
            return int(np.argmax(scores))
        fit = np.all(new <= caps, axis=0)
        if spec.max_sequences_per_bin is not None:
            fit &= self._count_np < spec.max_sequences_per_bin
        b = int(np.argmax(fit))
        return b if fit[b] else -1

    # ---- writing the rows --------------------------------------------------------------------

    def finalize(self) -> tuple[dict[str, np.ndarray], int]:
        """All rows at once: ({key: [R, ...]}, R) with R = bins holding an example."""
        spec = self.spec
        nb, S = spec.num_bins, spec.max_segments
        num_rows = sum(1 for c in self._count if c > 0)
        rows = np.asarray(self._rows, np.int64)
        slots = np.asarray(self._slots, np.int64)
        if not spec.segment_metadata:
            S = int(slots.max()) + 1 if slots.size else 1  # the [S] keys are left out
        elif slots.size and int(slots.max()) >= S:
            raise ValueError(
                f"a packed row holds {int(slots.max()) + 1} segments > max_segments={S} (empty "
                "examples take a segment each); pass a larger max_segments, "
                "max_sequences_per_bin=S (caps rows the Grain way), or segment_metadata=False"
            )
        out: dict[str, np.ndarray] = {}
        for i, k in enumerate(spec.features):
            cap, trail = spec.capacities[i], self._trails[i]
            layout = RowLayout(rows, slots, np.asarray(self._starts[i], np.int64),
                               np.asarray(self._lens[i], np.int64), nb)
            pad = 0 if spec.paddings[i] is None else spec.paddings[i]
            pieces = self._pieces(i, trail)
            if k in spec.segment_features:
                arrays = write_feature(pieces, layout, cap, S, feature=k, dtype=self._dtypes[i],
                                       pad=pad)
                if not spec.segment_metadata:
                    del arrays[keys(k).segment_lengths], arrays[keys(k).segment_offsets]
            else:
                arrays = {k: fill_rows(pieces, layout, cap, dtype=self._dtypes[i], pad=pad)}
            out.update({name: v[:num_rows] for name, v in arrays.items()})
        for k, per_bin in self._meta.items():
            arr = np.empty(num_rows, dtype=object)
            for r in range(num_rows):
                arr[r] = per_bin[r]
            out[k] = arr
        return out, num_rows

    def _pieces(self, i: int, trail: tuple[int, ...]) -> list[np.ndarray]:
        """Feature i's values as arrays of shape (n, *trail) (scalars and lists converted)."""
        return [v if type(v) is np.ndarray and v.ndim else np.reshape(np.asarray(v), (-1, *trail))
                for v in self._values[i]]
