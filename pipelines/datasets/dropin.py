"""Drop-in replacements for Grain's `FirstFitPackIterDataset` / `BestFitPackIterDataset`.

Same constructor arguments, the same rows in the same order (bins filled by Grain's rules,
optionally shuffled with Grain's seeding), the same checkpoint state format — plus, for every
packed feature `f` that is not a meta feature, the contract's `f_segment_lengths` and
`f_segment_offsets` (`[S]` i32, S = `max_segments`, default the segment cap
`max_sequences_per_bin`, else L: a row holds at most L non-empty segments), which
`segment_metadata=False` leaves out. `max_sequences_per_bin=None` puts no cap on segments, as
in Grain. Swap in one line::

    ds = grain.experimental.BestFitPackIterDataset(ds, length_struct={"tokens": 2048},
                                                   num_packing_bins=1024)
    ds = pipelines.BestFitPackIterDataset(ds, length_struct={"tokens": 2048},
                                          num_packing_bins=1024)

One dtype per packed feature for the whole run (the first element's): an element whose values it
cannot hold raises `InputError` naming it (Grain's buffers take each batch's first element's dtype
and wrap). Negative values pass, as in Grain (MaxText's SFT writes its pad id, -1 for some
tokenizers, over the prompt's `targets`). A parent whose
elements are already packed (`f_segment_ids`) is refused. Keys outside `length_struct` and
`meta_features` are left out, as Grain does (so `Columns.meta` and `Columns.drop` are refused).

Labels and masks (any integers, e.g. -100) ride on a token feature's layout and are padded with
their own pad; each must have the feature's length (else `InputError` naming the element)::

    ds = pipelines.BestFitPackIterDataset(ds, length_struct={"tokens": 2048},
                                          num_packing_bins=1024,
                                          columns=Columns(labels={"labels": -100}))
    # row["labels"]: [L], -100 on padding; the same bins as Grain with labels as a meta feature

`length_struct` is a dict feature -> int, or, as in Grain, a tree of dicts whose nested parts
sit under meta features (Grain re-keys only top-level features with segment ids): the nested
leaves are packed like any meta feature (values only, the same bins) and come back nested::

    length_struct={"tokens": 2048, "extras": {"mask": 2048, "weights": 2048}},
    meta_features=["extras"]     # row["extras"]["mask"]: [L]; no extras_segment_ids
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np

from seqpack.packer.contract import check_not_packed
from seqpack.packer.online import BatchSpec, FitBatch, element_dtypes
from seqpack.pipelines.datasets.columns import Column, Columns
from seqpack.pipelines.datasets.grain_args import (
    add_columns,
    get_leaf,
    make_spec,
    nest,
    unmarked_nested,
)
from seqpack.pipelines.errors import InputError


class DropinPackIterator(grain.DatasetIterator):
    """Grain's packing loop over `FitBatch`; state = Grain's {parent, next_row, counter}."""

    def __init__(
        self,
        parent: grain.DatasetIterator,
        *,
        spec: BatchSpec,
        columns: tuple[Column, ...] = (),
        seed: int,
        shuffle_bins: bool,
        shuffle_bins_group_by_feature: str | None,
    ):
        super().__init__(parent)
        self._spec = spec
        self._columns = [(c.name, c.feature) for c in columns]
        self._seed = seed
        self._shuffle_bins = shuffle_bins
        self._group_by = shuffle_bins_group_by_feature
        self._keys = spec.features + spec.nonseq_meta
        # One feature, no meta: elements go to the batch as they are (no per-element copy).
        self._raw = len(self._keys) == 1 and isinstance(self._keys[0], str)
        self._nested = any(isinstance(k, tuple) for k in self._keys)
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
            if self._nested:
                return {k: get_leaf(element, k) for k in self._keys}
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

    def _check_columns(self, element: dict[str, Any]) -> None:
        for name, host in self._columns:
            n, m = np.shape(element[name])[:1], np.shape(element[host])[:1]
            if n != m:
                raise InputError(
                    f"parent element {self._read - 1}: column {name!r} has length "
                    f"{n[0] if n else 1} but the feature {host!r} it is packed with has "
                    f"{m[0] if m else 1}; they must match per example")

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
            if self._columns:
                self._check_columns(element)
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
        if self._nested:
            row = nest(row)
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
        segment_metadata: bool = True,
        columns: Columns = Columns(),
    ):
        """Grain's arguments, plus `max_segments` = S of the segment lengths/offsets keys
        (default: `max_sequences_per_bin`, else L = the longest feature's length, what a row
        can hold; a row with more segments, possible only with empty examples, raises),
        `segment_metadata=False` (exactly Grain's keys: no lengths / offsets), and
        label / mask columns packed with a segment feature's layout (`Columns(labels=...,
        masks=...)`, columns.py: a list, or {name: pad}, or {name: (feature, pad)}; pads
        default to -100 / 0)."""
        super().__init__(parent)
        self._unmarked = unmarked_nested(length_struct, meta_features) if isinstance(
            length_struct, Mapping) else None
        spec = make_spec(
            length_struct=length_struct,
            num_packing_bins=num_packing_bins,
            meta_features=meta_features,
            pack_alignment_struct=pack_alignment_struct,
            padding_struct=padding_struct,
            max_sequences_per_bin=max_sequences_per_bin,
            max_segments=max_segments,
            best_fit=self._BEST_FIT,
            segment_metadata=segment_metadata,
        )
        self._spec, self._columns = add_columns(spec, columns)
        self._seed = seed
        self._shuffle_bins = shuffle_bins
        self._group_by = shuffle_bins_group_by_feature

    def __iter__(self) -> DropinPackIterator:
        if self._unmarked is not None:
            raise ValueError(self._unmarked)
        return DropinPackIterator(
            self._parent.__iter__(),
            spec=self._spec,
            columns=self._columns,
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
