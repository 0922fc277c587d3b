"""What a layout of online packers leaves, from their states, and each new consumer's share.

Every consumer (a host's worker process) packs its positions of the global order
(`streams`); its `PackIterDataset` state names the examples in flight by reference
(`flight`). `merge` pools the consumers' states into one restore state ("phase": "elastic"):
the positions their streams left per dataset, the examples in flight, and the run's counts
(units drawn by a mixture's rule, the planners' counters, rows emitted). `share` is what
consumer i of K of the new layout takes of it; the packer installs that and goes on
(`PackIterator.set_state`). A restore state that a consumer took but never moved past (it
made no row since) is pooled as its share, so layouts can change again at any point.

    states of H x W consumers --merge--> restore state --share(i, K')--> consumer i of K'
"""

from __future__ import annotations

import dataclasses
from typing import Any

from seqpack.pipelines.datasets.elastic.flight import Flight, decode_table
from seqpack.pipelines.datasets.elastic.refs import decode_refs
from seqpack.pipelines.datasets.elastic.streams import Pool, Stream, deal, pool

ELASTIC = "elastic"  # the "phase" of a restore state


@dataclasses.dataclass
class Share:
    """One consumer's part of a restore state (see the module docstring)."""

    streams: list[Stream]
    flight: Flight
    mixer: dict[str, Any] | None  # the run's units drawn (sums), or None: not a mixture
    counters: dict[str, Any]  # planner, datasets, rows_emitted: the whole run's on consumer 0


def index_in(over: str, layout: tuple[int, int, int, int]) -> tuple[int, int]:
    """(index, count) of the consumer of `layout` (h, H, w, W) among those a restore state is
    dealt over: every consumer of the run ("run"), or its host's workers ("host")."""
    h, H, w, W = layout
    return (w * H + h, H * W) if over == "run" else (w, W)


def share(state: dict[str, Any], index: int, count: int) -> Share:
    """Consumer `index` of `count`'s part of restore state `state`."""
    streams = [deal(Pool.from_state(p), index, count) for p in state["streams"]]
    flight = Flight.decode(state["flight"]).share(index, count)
    counters = state["counters"] if index == 0 else {}
    return Share(streams, flight, state.get("mixer"), counters)


def _consumer(state: dict[str, Any], layout: tuple[int, int, int, int], features: int,
              datasets: int) -> Share:
    """What one consumer's state leaves: its streams, its examples in flight, its counts."""
    phase = state["phase"]
    if phase == "start":
        j, K = index_in("run", layout)
        return Share([Stream.initial(j, K) for _ in range(datasets)], Flight.empty(features),
                     None, {})
    if phase == ELASTIC:
        index, count = index_in(state["over"], layout)
        part = share(state, index, count)
        if part.mixer is not None:
            part.mixer = {k: _scaled(v, 1 / count) for k, v in part.mixer.items()}
        return part
    parent = state["parent"]
    table = decode_table(state["flight"]["pieces"])  # rank, id, start, length per feature
    left = (table[:, 0] < 0) | (table[:, 0] >= int(state["emitted"]))
    flight = Flight.of(table[left, 1], table[left, 2], table[left, 3:],
                       decode_refs(state["refs"]))
    mixer = parent.get("mixer")
    counters = {"planner": state["flight"]["counters"],
                "rows_emitted": int(state["rows_emitted"])}
    if mixer is not None:
        mixer = {k: mixer[k] for k in ("consumed", "total", "count")}
        counters["datasets"] = {k: parent[k] for k in ("examples", "tokens", "loss_tokens")}
    return Share([Stream.from_state(s) for s in parent["streams"]], flight, mixer, counters)


def _scaled(value: Any, factor: float) -> Any:
    return [v * factor for v in value] if isinstance(value, list) else value * factor


def _summed(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Counts of several consumers added up (lists element-wise, dicts key by key)."""
    parts = [p for p in parts if p]
    if not parts:
        return None
    out: dict[str, Any] = {}
    for key in parts[0]:
        values = [p[key] for p in parts if key in p]
        first = values[0]
        if isinstance(first, dict):
            out[key] = _summed(values)
        elif isinstance(first, list):
            out[key] = [sum(v) for v in zip(*values)]
        else:
            out[key] = sum(values)
    return out


def merge(consumers: list[tuple[dict[str, Any], tuple[int, int, int, int]]], *, whole: bool,
          features: int, datasets: int, mixed: bool, dtypes: dict[str, str]
          ) -> dict[str, Any]:
    """The restore state of the consumers' `PackIterDataset` states, each with its layout
    (h, H, w, W). `whole`: they are every consumer of the run (dealt again over every consumer
    of the new run); else one host's (dealt over that host's new workers). `features`: packed
    features; `datasets`: 1, or a mixture's (`mixed`)."""
    parts = [_consumer(s, lay, features, datasets) for s, lay in consumers]
    mixers = [p.mixer for p in parts if p.mixer is not None]
    counters = _summed([p.counters for p in parts]) or {}
    zero = {"consumed": [0] * datasets, "total": 0, "count": 0}
    return {
        "phase": ELASTIC,
        "over": "run" if whole else "host",
        "streams": [pool([p.streams[d] for p in parts], whole=whole).to_state()
                    for d in range(datasets)],
        "flight": Flight.concat([p.flight for p in parts], features).encode(),
        "mixer": (_summed(mixers) or zero) if mixed else None,
        "counters": counters,
        "dtypes": dtypes,
    }
