"""The shortfall rule of a mixture: which dataset gives the next example.

Weights are target shares of a unit (tokens, loss tokens or examples). At every step the next
example comes from the active dataset furthest below its target share of the units consumed
since the current stage began, counted as if the next example (of the mean size so far) were
already drawn (largest shortfall, ties to the lower index), so every prefix of the stream
holds each share within about one example (docs/mixing.md). The rule counts what was drawn,
never what a packer downstream still holds: it is open-loop, so no feedback can overshoot.
A schedule switches weights at given totals of units consumed (by the whole run: a mixer that
is one of `scale` drawing alike counts its own units `scale` times); a stage counts from its
own start, and so does a dataset leaving the mixture (the others' weights renormalized), a
weight change at a restore, or a restore on another number of consumers.

Worked example (weights 0.5 / 0.5; every example of `a` is 4 units, of `b` 1 unit)::

    step   units since stage + mean   shortfall a, b    pick   consumed a, b
    0      0 + 1                        0.5,  0.5         a      4, 0
    1      4 + 4                        0.0,  4.0         b      4, 1
    2      5 + 2.5                     -0.25, 2.75        b      4, 2
    3      6 + 2                        0.0,  2.0         b      4, 3
    4      7 + 1.75                     0.375, 1.375      b      4, 4
    5      8 + 1.6                      0.8,  0.8         a      8, 4
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from seqpack.packer.contract import DATASET_DTYPE, IGNORE_INDEX, SOURCE_DTYPE

UNITS = ("tokens", "loss_tokens", "examples")
# What marks a token without a loss in a column of each role (`carries_loss`).
NO_LOSS = {"labels": IGNORE_INDEX, "mask": 0}


def carries_loss(columns: Iterable[tuple[np.ndarray, str]], shape: int | tuple[int, ...]
                 ) -> np.ndarray:
    """bool[shape]: the tokens that carry a loss, where no "labels" column holds -100 and no
    "mask" column 0 (`columns`: (values of `shape`, role) pairs). The one definition of a loss
    token, online (`Mixture(unit="loss_tokens")`, a batch's `loss_tokens`) and offline
    (`--mix-unit loss_tokens`)."""
    out = np.ones(shape, bool)
    for values, role in columns:
        out &= np.asarray(values) != NO_LOSS[role]
    return out


def slot_counts(marks: np.ndarray,  # bool[R, L]: the tokens to count
                offsets: np.ndarray,  # int[R, S]: each slot's start
                lengths: np.ndarray) -> np.ndarray:  # int[R, S] -> i64[R, S]
    """How many marked tokens each slot's segment holds."""
    R, L = marks.shape
    run = np.zeros((R, L + 1), np.int64)
    np.cumsum(marks, axis=1, out=run[:, 1:])
    start = np.minimum(np.asarray(offsets, np.int64), L)
    end = np.minimum(start + np.asarray(lengths, np.int64), L)
    return np.take_along_axis(run, end, 1) - np.take_along_axis(run, start, 1)


def row_units(unit: str,
              dataset_id: np.ndarray,  # int[R, S] (or [P]): each slot's dataset, -1 unused
              lengths: np.ndarray,  # int[R, S] (or [P]): its tokens
              starts: np.ndarray,  # int[R, S] (or [P]): where in its example it starts
              *, num_datasets: int, loss: np.ndarray | None = None,
              row: np.ndarray | None = None, num_rows: int = 0) -> np.ndarray:  # i64[R, K]
    """Each packed row's units of each dataset of a mixture, in `unit`: tokens; loss tokens
    (`loss`: each slot's, `slot_counts`; None: its tokens, where they are not known); or
    examples (first pieces). Slots as `[R, S]` arrays, or pieces as `[P]` arrays with each
    piece's `row` of `num_rows`. The one count of a row's shares, online (a window's row
    order), offline (steps) and in `seqpack stats`."""
    ids = np.asarray(dataset_id, np.int64)
    if row is None:
        num_rows, slots = ids.shape
        row = np.repeat(np.arange(num_rows), slots)
    if unit == "examples":
        weight = (np.asarray(starts) == 0) & (np.asarray(lengths) > 0)
    else:
        weight = np.asarray(lengths if loss is None or unit != "loss_tokens" else loss)
    ids, weight = ids.reshape(-1), weight.reshape(-1).astype(np.int64)
    used = ids >= 0
    at = np.asarray(row, np.int64).reshape(-1)[used] * num_datasets + ids[used]
    out = np.bincount(at, weights=weight[used], minlength=num_rows * num_datasets)
    return out.astype(np.int64).reshape(num_rows, num_datasets)


def dataset_columns(source_index: np.ndarray,  # int[R, S]: each slot's corpus example
                    firsts: np.ndarray  # i64[K]: each dataset's first corpus example
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(`segment_dataset_id` i32, `segment_source_index` i64) of a mixture's rows whose source
    index is a corpus example (datasets back to back from `firsts`); -1 on unused slots."""
    source_index = np.asarray(source_index, np.int64)
    used = source_index >= 0
    dataset = np.searchsorted(firsts, np.where(used, source_index, 0), side="right") - 1
    index = np.where(used, source_index - firsts[dataset], -1)
    return np.where(used, dataset, -1).astype(DATASET_DTYPE), index.astype(SOURCE_DTYPE)


@dataclasses.dataclass(frozen=True)
class Stage:
    """Weights (one per dataset, in the mixture's order, summing to 1) from `start` units on."""

    start: int
    weights: tuple[float, ...]


def make_stages(names: Sequence[str], weights: Mapping[str, float] | None = None,
                schedule: Sequence[tuple[int, Mapping[str, float]]] | None = None
                ) -> tuple[Stage, ...]:
    """The stages of `weights` (one stage from 0) or `schedule` ([(0, w0), (T1, w1), ...]):
    ValueError naming the stage and dataset for a missing, unknown or negative weight."""
    if (weights is None) == (schedule is None):
        raise ValueError("pass one of weights= (a dict name -> weight) or schedule= "
                         "([(0, weights_0), (T_1, weights_1), ...])")
    pairs = [(0, weights)] if schedule is None else list(schedule)
    if not pairs or pairs[0][0] != 0:
        raise ValueError(f"schedule={schedule!r} must start at 0 units: [(0, weights_0), ...]")
    stages: list[Stage] = []
    for k, pair in enumerate(pairs):
        if not (isinstance(pair, tuple | list) and len(pair) == 2):
            raise ValueError(f"schedule[{k}]={pair!r} must be (units, weights)")
        start, w = pair
        where = "weights" if schedule is None else f"schedule[{k}] (from {start} units)"
        if stages and not (isinstance(start, int) and start > stages[-1].start):
            raise ValueError(f"{where}: stage starts must be increasing integers")
        stages.append(Stage(int(start), normalized(names, w, where)))
    return tuple(stages)


def normalized(names: Sequence[str], weights: Any, where: str) -> tuple[float, ...]:
    """The weights of `names`, in order, scaled to sum to 1 (ValueError naming the problem)."""
    if not isinstance(weights, Mapping):
        raise ValueError(f"{where}={weights!r} must be a dict name -> weight")
    unknown = sorted(set(map(str, weights)) - set(names))
    missing = [n for n in names if n not in weights]
    if unknown or missing:
        raise ValueError(f"{where}: weights name {unknown or 'no unknown'} dataset(s) not in "
                         f"the mixture and miss {missing or 'none'}; the datasets are "
                         f"{list(names)}")
    values = []
    for n in names:
        v = weights[n]
        if isinstance(v, bool) or not isinstance(v, int | float) or not v >= 0:
            raise ValueError(f"{where}: the weight of {n!r} is {v!r}; weights are numbers >= 0")
        values.append(float(v))
    total = sum(values)
    if total <= 0:
        raise ValueError(f"{where}: every weight is 0; give at least one dataset a weight > 0")
    return tuple(v / total for v in values)


class ShortfallMixer:
    """Picks datasets by largest shortfall (see the module docstring); small, exact state."""

    def __init__(self, stages: Sequence[Stage], *, scale: int = 1):
        self.stages = tuple(stages)
        self.scale = int(scale)  # mixers of the run drawing alike: stage starts count them all
        k = len(self.stages[0].weights)
        self.consumed = [0] * k  # units per dataset since the start
        self.active = [True] * k
        self.stage = 0
        self.total = 0
        self.count = 0  # examples drawn since the start
        self._begin(self.stages[0].weights)

    def _begin(self, weights: Sequence[float]) -> None:
        """A new stage from here: targets count from the units consumed so far."""
        self.weights = tuple(weights)
        self.base = list(self.consumed)
        self.base_total = self.total
        self.base_count = self.count
        self._renormalize()

    def _renormalize(self) -> None:
        """The weights over the active datasets, summing to 1 (all 0 when none is left)."""
        live = [w if a else 0.0 for w, a in zip(self.weights, self.active)]
        norm = sum(live)
        self._live = [w / norm for w in live] if norm > 0 else live

    def pick(self) -> int:
        """The dataset to draw from next; -1 when no active dataset has a weight > 0."""
        since: float = self.total - self.base_total
        drawn = self.count - self.base_count
        since += since / drawn if drawn else 1.0
        best, best_gap = -1, 0.0
        for d, w in enumerate(self._live):
            if w > 0:
                gap = w * since - (self.consumed[d] - self.base[d])
                if best < 0 or gap > best_gap:
                    best, best_gap = d, gap
        return best

    def add(self, d: int, units: int) -> None:
        self.consumed[d] += units
        self.total += units
        self.count += 1
        nxt = self.stage + 1
        run = self.total * self.scale
        if nxt < len(self.stages) and run >= self.stages[nxt].start:
            while nxt + 1 < len(self.stages) and run >= self.stages[nxt + 1].start:
                nxt += 1
            self.stage = nxt
            self._begin(self.stages[nxt].weights)

    def share(self, d: int) -> float:
        """Dataset d's share of what is drawn now (its weight over the active datasets)."""
        return self._live[d]

    def deactivate(self, d: int) -> None:
        """Dataset `d` leaves; the others' weights are renormalized from here on."""
        self.active[d] = False
        self._begin(self.weights)

    def hold_back(self, units: Sequence[int], count: int) -> float:
        """Counts `units` per dataset (`count` examples), drawn before this stage began but
        not yet emitted by the packer, as drawn in this stage (a restore under edited
        weights: the packer plans them again with the stage's first draws, which make up
        for them). Returns the units the stage must reach before each held share fits its
        weight: max over datasets of held / weight (those of weight 0 are left out)."""
        for d, u in enumerate(units):
            self.base[d] -= int(u)
        self.base_total -= int(sum(units))
        self.base_count -= int(count)
        need = [u / w for u, w in zip(units, self._live) if w > 0]
        return max(need, default=0.0)

    def stage_units(self) -> int:
        """Units drawn since the current stage began (with those held back)."""
        return self.total - self.base_total

    def _stage_at(self, total: int) -> int:
        return max(k for k, s in enumerate(self.stages) if s.start <= total * self.scale)

    def resume_at(self, consumed: Sequence[float], total: float, count: float) -> None:
        """Goes on from the run's draws so far, shared out over `scale` mixers (`consumed`,
        `total` and `count` summed over the run's mixers before a change of their number):
        this mixer's stage from them, every dataset active (one that ran out leaves again
        when drawn), and a new stage of its weights counting from here."""
        s = self.scale
        self.consumed = [round(float(c) / s) for c in consumed]
        self.total = round(float(total) / s)
        self.count = round(float(count) / s)
        self.active = [True] * len(self.consumed)
        self.stage = self._stage_at(self.total)
        self._begin(self.stages[self.stage].weights)

    def get_state(self) -> dict[str, Any]:
        return {"consumed": list(self.consumed), "active": list(self.active),
                "stage": self.stage, "total": self.total, "count": self.count,
                "weights": list(self.weights), "base": list(self.base),
                "base_total": self.base_total, "base_count": self.base_count}

    def set_state(self, state: Mapping[str, Any]) -> bool:
        """Restores `state`; when this mixer's weights at that point differ from the state's
        (weights or schedule edited), a new stage starts there. True when they differed."""
        self.consumed = [int(c) for c in state["consumed"]]
        self.active = [bool(a) for a in state["active"]]
        self.total = int(state["total"])
        self.count = int(state["count"])  # a state's "held" (older versions) is not used
        self.stage = self._stage_at(self.total)
        weights = self.stages[self.stage].weights
        same = self.stage == int(state["stage"]) and list(weights) == list(state["weights"])
        if same:
            self.weights = tuple(weights)
            self.base = [int(b) for b in state["base"]]
            self.base_total = int(state["base_total"])
            self.base_count = int(state["base_count"])
            self._renormalize()
        else:
            self._begin(weights)
        return not same
