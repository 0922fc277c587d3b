"""Grain's packer arguments (`length_struct`, `meta_features`, ...) as one `BatchSpec`.

`length_struct` is a dict feature -> int, or, as in Grain, a tree of dicts whose nested parts
sit under meta features; `get_leaf` / `nest` walk such trees. seqpack's own additions:
`max_segments` (S of the segment lengths/offsets keys; default the segment cap
`max_sequences_per_bin`, else the longest feature's length L, which no row's segments exceed
unless empty examples are packed), `segment_metadata` (False: Grain's keys only) and label /
mask columns (`Columns`, `pipelines.datasets.columns`) riding on a segment feature. A column
`c` on feature `f` is packed as Grain would pack a meta feature `c` with
`length_struct[c] = length_struct[f]` and `padding_struct[c] = pad`: every example's `c` has
f's length, so it takes the bin and the offsets f takes, and Grain's bin choice is the same as
with `c` in `length_struct`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from seqpack.packer.online import BatchSpec
from seqpack.pipelines.datasets.columns import Column, Columns, check_type

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


def unmarked_nested(length_struct: Mapping[str, Any], meta_features: Sequence[str]
                    ) -> str | None:
    """The error for a nested part of `length_struct` outside `meta_features`, in Grain's words
    (Grain raises it on the first element; the drop-ins when iterated), or None."""
    for k, v in length_struct.items():
        if isinstance(v, Mapping) and k not in meta_features:
            return (f"Failed to extract segment ids for {k!r}, which has type <class 'dict'> "
                    "rather than np.ndarray. Perhaps it should be marked as a meta feature? "
                    f"(length_struct[{k!r}] is a nested dict: add {k!r} to meta_features to "
                    "pack its values)")
    return None


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
    segment_metadata: bool = True,
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
    if not isinstance(segment_metadata, bool):
        raise ValueError(f"{segment_metadata=} must be True or False")
    segment_features = tuple(k for k in features
                             if not isinstance(k, tuple) and k not in meta_features)
    if max_segments is None:
        # S = what a row can hold: the cap, else one segment per token of the longest feature
        max_segments = max_sequences_per_bin or max(
            (c for k, c in zip(features, caps, strict=True) if k in segment_features),
            default=1)
    elif not segment_metadata:
        raise ValueError(f"{max_segments=} sizes the segment lengths/offsets keys, which "
                         "segment_metadata=False leaves out; pass one or the other")
    if isinstance(max_segments, bool) or not isinstance(max_segments, (int, np.integer)) \
            or max_segments < 1:
        raise ValueError(f"{max_segments=} must be a positive int")
    return BatchSpec(
        features=features,
        capacities=tuple(caps),
        alignments=aligns,
        paddings=_per_feature(padding_struct, features, None, "padding_struct"),
        segment_features=segment_features,
        nonseq_meta=tuple(k for k in meta_features if k not in length_struct),
        num_bins=int(num_packing_bins),
        max_sequences_per_bin=max_sequences_per_bin,
        max_segments=int(max_segments),
        best_fit=best_fit,
        segment_metadata=segment_metadata,
    )


def add_columns(spec: BatchSpec, columns: Columns) -> tuple[BatchSpec, tuple[Column, ...]]:
    """`spec` with label / mask columns packed as meta features of their host's length,
    alignment and bins (see the module docstring), and those columns. `Columns.meta` and
    `Columns.drop` are Grain's business here (`meta_features`; keys outside `length_struct`
    are left out): a ValueError says so."""
    check_type("columns", columns, Columns, " (e.g. Columns(labels={'labels': -100}))")
    if columns.meta:
        raise ValueError(f"Columns(meta={columns.meta!r}): the drop-ins pack other per-token "
                         "values as Grain does: add them to length_struct and meta_features")
    if columns.drop:
        raise ValueError(f"Columns(drop={columns.drop!r}): the drop-ins leave out every key "
                         "outside length_struct and meta_features, as Grain does; drop "
                         "nothing here")
    cols = columns.of(spec.segment_features)
    if not cols:
        return spec, ()
    taken = set(spec.features) | set(spec.nonseq_meta)
    for c in cols:
        if c.name in taken:
            raise ValueError(f"column {c.name!r} is also in length_struct or meta_features; "
                             "give it in one place")
    host = [spec.features.index(c.feature) for c in cols]
    return dataclasses.replace(
        spec,
        features=spec.features + tuple(c.name for c in cols),
        capacities=spec.capacities + tuple(spec.capacities[h] for h in host),
        alignments=spec.alignments + tuple(spec.alignments[h] for h in host),
        paddings=spec.paddings + tuple(c.pad for c in cols),
    ), cols
