"""Restoring `PackIterDataset`: from references, what a state names is fetched, never replayed;
else a replay is checked against the sizes of the window it re-plans (`check_replayed`).

Over a source that names its examples (a `Mixture`, `elastic.ElasticExamples`), a state names
the examples the packer held as (dataset, index) references. `fetch` gets them again and
returns what the iterator installs (`Held`: their tokens by window, the elements by id).
Pieces planned but not emitted can go back to the planner to be planned again (`unemitted`):
under edited weights, and on another layout (`elastic.merge`); a mixture's new stage then
counts them as drawn in it (`waiting_units` -> `MixtureIterator.hold_back`), so the rule draws
what makes up for them, and the packer reads until they fit the new weights (at most
`MAX_SPREAD` times their units) before planning them with those draws as one window, whose
rows leave in an order that keeps the shares: the first batches hold the new weights too
(docs/mixing.md).
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import numpy as np

from seqpack.pipelines.datasets.elastic.refs import Refs
from seqpack.pipelines.errors import InputError

# A restore that plans pieces again reads at most this many times their units before planning
# them with the new draws.
MAX_SPREAD = 8


@dataclasses.dataclass
class Held:
    """Fetched examples: `tokens` name -> window number -> values (None where not held), the
    `elements` by id, their references (id -> (dataset, index)) and their sizes (the first
    feature's tokens, i64 in the order of the ids)."""

    tokens: dict[str, dict[int, list]]
    elements: dict[int, Any]
    refs: dict[int, tuple[int, int]]
    sizes: np.ndarray


_CHANGED = ("the data is not the data the state was saved over (the same number of examples, "
            "other contents?); restore into a pipeline over that data")


def fetch(parent: Any, ids: np.ndarray, refs: Refs, *, names: tuple[str, ...], window: int,
          values: Any, extents: np.ndarray | None = None) -> Held:
    """The elements `refs` names (dataset, index) from `parent.fetch`, held under `ids`
    (sorted) in the windows of `window` ids; `values` (`columns.RunValues`) checks and casts
    them as reading does. InputError where an example changed since the save: its size is not
    the one `refs` recorded (-1: none), or it is too short for `extents` (i64[P, 3]: id, start,
    length of the first feature's pieces the state holds)."""
    dataset, index, sizes = refs
    id_list = ids.tolist()
    elements = [parent.fetch(int(d), int(i)) for d, i in zip(dataset, index)]
    tokens: dict[str, dict[int, list]] = {n: {} for n in names}
    have = np.zeros(0, np.int64)
    for n in names:
        col = [values.values(e[n], j, n) for j, e in zip(id_list, elements)]
        if n == names[0]:
            have = np.array([len(v) for v in col], np.int64)
            _check_sizes(parent, have, sizes, ids, dataset, index, extents)
        values.fit(col, n, 0)
        for j, v in zip(id_list, col):
            tokens[n].setdefault(j // window, [None] * window)[j % window] = v
    return Held(tokens, dict(zip(id_list, elements)),
                dict(zip(id_list, zip(dataset.tolist(), index.tolist()))), have)


def _check_sizes(parent: Any, have: np.ndarray, sizes: np.ndarray, ids: np.ndarray,
                 dataset: np.ndarray, index: np.ndarray, extents: np.ndarray | None) -> None:
    def where(e: int) -> str:
        names = getattr(parent, "names", None)
        return (f"dataset {names[int(dataset[e])]!r} example {int(index[e])}"
                if names and len(names) > 1 else f"example {int(index[e])} of the source")

    bad = np.flatnonzero((sizes >= 0) & (sizes != have))
    if bad.size:
        e = int(bad[0])
        raise InputError(f"restoring: {where(e)} holds {int(have[e])} tokens, but held "
                         f"{int(sizes[e])} when the state was saved, which holds some of them "
                         f"in flight: {_CHANGED}")
    if extents is None or not len(extents):
        return
    extents = extents[np.isin(extents[:, 0], ids)]
    at = np.searchsorted(ids, extents[:, 0])  # extents: (id, start, length, ...) per piece
    end = extents[:, 1] + extents[:, 2]
    bad = np.flatnonzero(end > have[at])
    if bad.size:
        p, e = int(bad[0]), int(at[bad[0]])
        raise InputError(f"restoring: {where(e)} holds {int(have[e])} tokens, but the state "
                         f"holds its tokens [{int(extents[p, 1])}, {int(end[p])}) in flight: "
                         f"{_CHANGED}")


def check_kind(state: dict[str, Any], *, by_ref: bool) -> None:
    """InputError where `state` was saved by a packer over another kind of parent than this
    one's (`by_ref`: one naming its examples by reference)."""
    if ("refs" in state) != by_ref:
        raise InputError("restoring: the state was saved by a packer over another kind of "
                         "parent (one naming its examples by reference or not); restore into "
                         "the same pipeline")


def sizes_digest(lengths: Any) -> int:
    """crc32 of the sizes of a window's elements (`lengths`: the layout's `window_lengths`,
    every packed feature's): what a state that replays records of the window it re-plans
    (`check_replayed`)."""
    return zlib.crc32(np.asarray(lengths, np.int64).tobytes())


def check_replayed(state: dict[str, Any], snap: dict[str, Any] | None) -> None:
    """InputError where the window a replay re-planned (`snap`: its new snapshot) holds other
    sizes than the one `state` was saved in: the parent's data changed, and skipping the rows
    already emitted would skip other rows. States saved before the digest pass."""
    if snap is None or "sizes" not in state or snap.get("sizes") == state["sizes"]:
        return
    first = int(state["window_first"])
    raise InputError(f"restoring: the parent's elements from {first} (the window the state "
                     "was leaving) have other sizes than when the state was saved: "
                     f"{_CHANGED}")


def extents_of(state: dict[str, Any]) -> np.ndarray | None:
    """(id, start, length, ...) of the pieces in flight a state records (None: none recorded)."""
    from seqpack.pipelines.datasets.elastic.flight import decode_table

    flight = state.get("flight")
    return decode_table(flight["pieces"])[:, 1:] if isinstance(flight, dict) else None


def unemitted(plan: Any, order: list[int] | None, num_rows: int, emitted: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(id, start, length) i64 of the pieces of a staged plan's rows after the first `emitted`
    to leave (in `order`, None: row order)."""
    rows = (list(range(num_rows)) if order is None else order)[emitted:]
    bounds = plan.row_slices()
    sel = np.concatenate([np.zeros(0, np.int64), *(np.arange(bounds[r], bounds[r + 1])
                                                   for r in rows)])
    return plan.example[sel], plan.start[sel], plan.length[sel]


def waiting_units(parent: Any, waiting: np.ndarray, held: Held) -> list[int]:
    """Per dataset, the units (the mixture's unit) of the `waiting` pieces (i64[P, 3]: id,
    start, length) of `held` examples: each piece its share of its example's units."""
    units = [0] * len(parent.names)
    for i, length in zip(waiting[:, 0].tolist(), waiting[:, 2].tolist()):
        d, index = held.refs[i]
        u, tokens = parent.units(d, index, held.elements[i])
        units[d] += round(u * length / tokens) if tokens else u
    return units
