"""Drop-in replacements for Grain's `FirstFitPackIterDataset` / `BestFitPackIterDataset`.

Same constructor arguments, the same rows in the same order (bins filled by Grain's rules,
optionally shuffled with Grain's seeding), the same checkpoint state format — plus, for every
packed feature `f` that is not a meta feature, the contract's `f_segment_lengths` and
`f_segment_offsets` (`[S]` i32, S = `max_segments`). Swap in one line::

    ds = grain.experimental.BestFitPackIterDataset(ds, length_struct={"tokens": 2048},
                                                   num_packing_bins=1024)
    ds = pipelines.BestFitPackIterDataset(ds, length_struct={"tokens": 2048},
                                          num_packing_bins=1024)

Supported: `length_struct` a flat dict feature -> int (what Grain's row re-keying supports).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from seqpack.packer.contract import check_not_packed
from seqpack.packer.grain_fit import BatchSpec, FitBatch, element_dtypes
from seqpack.pipelines.errors import InputError


def _per_feature(struct: Any, features: Sequence[str], default: Any, name: str) -> tuple:
    if struct is None:
        return tuple(default for _ in features)
    if not isinstance(struct, dict) or set(struct) != set(features):
        raise ValueError(f"{name}={struct!r} must be a dict with the keys of length_struct")
    return tuple(struct[k] for k in features)


def make_spec(
    *,
    length_struct: Any,
    num_packing_bins: int,
    meta_features: Sequence[str],
    pack_alignment_struct: Any,
    padding_struct: Any,
    max_sequences_per_bin: int | None,
    max_segments: int | None,
    best_fit: bool,
) -> BatchSpec:
    if not isinstance(length_struct, dict) or not length_struct:
        raise ValueError(
            f"length_struct={length_struct!r} must be a non-empty dict feature -> length, "
            "e.g. {'inputs': 2048, 'targets': 2048}"
        )
    features = tuple(length_struct)
    caps = []
    for k in features:
        v = length_struct[k]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"length_struct[{k!r}]={v!r} must be a positive int")
        caps.append(int(v))
    if isinstance(num_packing_bins, bool) or int(num_packing_bins) < 1:
        raise ValueError(f"{num_packing_bins=} must be a positive int")
    if max_sequences_per_bin is not None and max_sequences_per_bin <= 0:
        raise ValueError(
            "If specified, `max_sequences_per_bin` must be a positive integer,"
            f" but got {max_sequences_per_bin}."
        )
    aligns = tuple(int(a) for a in _per_feature(pack_alignment_struct, features, 1,
                                                "pack_alignment_struct"))
    if any(a < 1 for a in aligns):
        raise ValueError(f"pack_alignment_struct={pack_alignment_struct!r} must be >= 1")
    if max_segments is None:
        max_segments = max_sequences_per_bin or 64
    if max_segments < 1:
        raise ValueError(f"{max_segments=} must be >= 1")
    return BatchSpec(
        features=features,
        capacities=tuple(caps),
        alignments=aligns,
        paddings=_per_feature(padding_struct, features, None, "padding_struct"),
        segment_features=tuple(k for k in features if k not in meta_features),
        nonseq_meta=tuple(k for k in meta_features if k not in length_struct),
        num_bins=int(num_packing_bins),
        max_sequences_per_bin=max_sequences_per_bin,
        max_segments=int(max_segments),
        best_fit=best_fit,
    )


class DropinPackIterator(grain.DatasetIterator):
    """Grain's packing loop over `FitBatch`; state = Grain's {parent, next_row, counter}."""

    def __init__(
        self,
        parent: grain.DatasetIterator,
        *,
        spec: BatchSpec,
        seed: int,
        shuffle_bins: bool,
        shuffle_bins_group_by_feature: str | None,
    ):
        super().__init__(parent)
        self._spec = spec
        self._seed = seed
        self._shuffle_bins = shuffle_bins
        self._group_by = shuffle_bins_group_by_feature
        self._keys = spec.features + spec.nonseq_meta
        # One feature, no meta: elements go to the batch as they are (no per-element copy).
        self._raw = len(self._keys) == 1
        self._reset()

    def _reset(self) -> None:
        self._batch: FitBatch | None = None  # being filled
        self._last_emitted_parent_state = self._parent.get_state()
        self._next_batch_parent_state = None
        self._packed: dict[str, np.ndarray] | None = None  # finalized, rows being emitted
        self._num_rows = 0
        self._order: Any = None
        self._next_row = 0
        self._counter = 0
        self._dtypes: list[np.dtype] | None = None  # one per packed feature, for the whole run
        self._read = 0  # parent elements read since the start or the last set_state

    def get_state(self) -> dict[str, Any]:
        return {
            "parent": self._last_emitted_parent_state,
            "next_row": self._next_row,
            "counter": self._counter,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self._reset()
        self._next_row = int(state["next_row"])
        self._counter = int(state["counter"])

    def _select(self, element: Any) -> dict[str, Any]:
        try:
            if self._raw:
                element[self._keys[0]]
                return element
            return {k: element[k] for k in self._keys}
        except (KeyError, TypeError, IndexError):
            raise InputError(
                f"element {type(element).__name__} "
                f"{list(element) if isinstance(element, dict) else ''} lacks one of the "
                f"packed/meta features {list(self._keys)}"
            ) from None

    def _new_batch(self, element: dict[str, Any]) -> FitBatch:
        if self._dtypes is None:
            self._dtypes = element_dtypes(element, self._spec)
        return FitBatch(element, self._spec, self._dtypes)

    def _add(self, element: dict[str, Any]) -> bool:
        try:
            return self._batch.try_add(element)
        except InputError as e:
            raise InputError(f"parent element {self._read - 1}: {e}") from None

    def _finalize(self, element_for_shapes: dict[str, Any] | None) -> None:
        self._packed, self._num_rows = self._batch.finalize()
        if self._shuffle_bins:
            self._shuffle()
        self._batch = None if element_for_shapes is None else self._new_batch(element_for_shapes)

    def _shuffle(self) -> None:
        n = self._num_rows
        order = np.random.default_rng(self._seed + self._counter - self._next_row).permuted(
            range(n)
        )
        if self._group_by is not None:
            groups = [np.unique(row) for row in self._packed[self._group_by]]
            avg = [np.nan_to_num(np.sum(s) / np.count_nonzero(s), nan=0.0) for s in groups]
            order = [t[2] for t in sorted((avg[i], order[i], i) for i in range(n))]
        self._order = order

    def _fill(self) -> None:
        """Reads parent elements until a batch is finalized; StopIteration at the end."""
        parent, select = self._parent, self._select
        while True:
            prior_state = parent.get_state()
            try:
                element = next(parent)
            except StopIteration:
                if self._batch is not None:
                    self._finalize(None)
                    self._next_batch_parent_state = prior_state
                    return
                raise
            if self._read == 0:
                check_not_packed(element, self._spec.segment_features, "element 0 of the parent")
            element = select(element)
            self._read += 1
            if self._batch is None:
                self._batch = self._new_batch(element)
            if self._add(element):
                continue
            self._finalize(element)
            self._next_batch_parent_state = prior_state
            if not self._add(element):
                raise ValueError(
                    "Could not add element to empty packed batch! Packed batch has"
                    f" packing sequence_lengths: {self._spec.capacities}"
                )
            return

    def __next__(self) -> dict[str, Any]:
        if self._packed is None:
            self._fill()
        r = self._order[self._next_row] if self._shuffle_bins else self._next_row
        row = {k: v[r] for k, v in self._packed.items()}
        self._next_row += 1
        self._counter += 1
        if self._next_row >= self._num_rows:
            self._packed = None
            self._last_emitted_parent_state = self._next_batch_parent_state
            self._next_batch_parent_state = None
            self._next_row = 0
            self._order = None
        return row


class _DropinPackIterDataset(grain.IterDataset):
    _BEST_FIT = False

    def __init__(
        self,
        parent: grain.IterDataset,
        *,
        length_struct: Any,
        num_packing_bins: int,
        seed: int = 0,
        shuffle_bins: bool = True,
        shuffle_bins_group_by_feature: str | None = None,
        meta_features: Sequence[str] = (),
        pack_alignment_struct: Any = None,
        padding_struct: Any = None,
        max_sequences_per_bin: int | None = None,
        max_segments: int | None = None,
    ):
        """Grain's arguments, plus `max_segments` = S of the segment lengths/offsets keys
        (default: `max_sequences_per_bin`, else 64; a row with more segments raises)."""
        super().__init__(parent)
        self._spec = make_spec(
            length_struct=length_struct,
            num_packing_bins=num_packing_bins,
            meta_features=meta_features,
            pack_alignment_struct=pack_alignment_struct,
            padding_struct=padding_struct,
            max_sequences_per_bin=max_sequences_per_bin,
            max_segments=max_segments,
            best_fit=self._BEST_FIT,
        )
        self._seed = seed
        self._shuffle_bins = shuffle_bins
        self._group_by = shuffle_bins_group_by_feature

    def __iter__(self) -> DropinPackIterator:
        return DropinPackIterator(
            self._parent.__iter__(),
            spec=self._spec,
            seed=self._seed,
            shuffle_bins=self._shuffle_bins,
            shuffle_bins_group_by_feature=self._group_by,
        )


class FirstFitPackIterDataset(_DropinPackIterDataset):
    """Grain's first-fit packing (same rows, same state), faster, with segment lengths/offsets.

    Fills `num_packing_bins` bins in input order, each example into the first bin with room;
    when one does not fit anywhere, emits all bins (optionally shuffled) and starts over.
    """

    _BEST_FIT = False

    def __str__(self) -> str:
        return "seqpack.FirstFitPackIterDataset"


class BestFitPackIterDataset(_DropinPackIterDataset):
    """Grain's best-fit packing (same rows, same state), faster, with segment lengths/offsets.

    Like first fit, but each example goes to the fullest bin it still fits (ties: lowest bin).
    """

    _BEST_FIT = True

    def __str__(self) -> str:
        return "seqpack.BestFitPackIterDataset"
