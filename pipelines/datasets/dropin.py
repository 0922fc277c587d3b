"""Drop-in replacements for Grain's `FirstFitPackIterDataset` / `BestFitPackIterDataset`.

Same constructor arguments, the same rows in the same order (bins filled by Grain's rules,
optionally shuffled with Grain's seeding), the same checkpoint state format — plus, for every
packed feature `f` that is not a meta feature, the contract's `f_segment_lengths` and
`f_segment_offsets` (`[S]` i32, S = `max_segments`). Swap in one line::

    ds = grain.experimental.BestFitPackIterDataset(ds, length_struct={"tokens": 2048},
                                                   num_packing_bins=1024)
    ds = pipelines.BestFitPackIterDataset(ds, length_struct={"tokens": 2048},
                                          num_packing_bins=1024)

One dtype per packed feature for the whole run (the first element's): an element whose values it
cannot hold raises `InputError` naming it (Grain's buffers take each batch's first element's dtype
and wrap). A parent whose elements are already packed (`f_segment_ids`) is refused.

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
from seqpack.packer.grain_fit import BatchSpec, FitBatch, element_dtypes
from seqpack.pipelines.errors import InputError

Key = Any  # a top-level feature name, or a tuple path to a nested leaf of length_struct


def _leaves(struct: Mapping[str, Any]) -> list[tuple[Key, Any]]:
    """(key, leaf) of a tree of dicts: the name for a top-level leaf, the path for a nested one
    (dict order; Grain's tree order does not change which bin an example takes)."""
    out: list[tuple[Key, Any]] = []

    def walk(node: Mapping[str, Any], path: tuple[str, ...]) -> None:
        for k, v in node.items():
            if isinstance(v, Mapping):
                if not v:
                    raise ValueError(f"length_struct at {(*path, k)} is an empty dict")
                walk(v, (*path, k))
            else:
                out.append(((*path, k) if path else k, v))

    walk(struct, ())
    return out


def get_leaf(tree: Any, key: Key) -> Any:
    """The leaf `key` (a name or a path) of a tree of dicts."""
    if isinstance(key, tuple):
        for k in key:
            tree = tree[k]
        return tree
    return tree[key]


def nest(flat: dict[Key, Any]) -> dict[str, Any]:
    """{path: v} -> nested dicts (top-level names stay as they are)."""
    out: dict[str, Any] = {}
    for key, v in flat.items():
        if not isinstance(key, tuple):
            out[key] = v
            continue
        node = out
        for k in key[:-1]:
            node = node.setdefault(k, {})
        node[key[-1]] = v
    return out


def _per_feature(struct: Any, features: Sequence[Key], default: Any, name: str) -> tuple:
    if struct is None:
        return tuple(default for _ in features)
    try:
        if not isinstance(struct, Mapping) or len(_leaves(struct)) != len(features):
            raise KeyError
        return tuple(get_leaf(struct, k) for k in features)
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{name}={struct!r} must be a dict with the structure of "
                         "length_struct") from None


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
    if not isinstance(length_struct, Mapping) or not length_struct:
        raise ValueError(
            f"length_struct={length_struct!r} must be a non-empty dict feature -> length, "
            "e.g. {'inputs': 2048, 'targets': 2048}"
        )
    leaves = _leaves(length_struct)
    features = tuple(k for k, _ in leaves)
    caps = []
    for k, v in leaves:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"length_struct[{k!r}]={v!r} must be a positive int")
        caps.append(int(v))
    for k in features:
        if isinstance(k, tuple) and k[0] not in meta_features:
            raise ValueError(
                f"length_struct[{k[0]!r}] is a nested dict: packed with segment ids it cannot be "
                f"(Grain raises for it too); add {k[0]!r} to meta_features to pack its values"
            )
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
        segment_features=tuple(k for k in features
                               if not isinstance(k, tuple) and k not in meta_features),
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
