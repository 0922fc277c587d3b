"""The positions of a seeded global order that one consumer reads, pooled and dealt again.

A run of H hosts with W worker processes each has K = H W consumers; consumer j = w H + h
(host h, worker w) reads positions j, j + K, j + 2K, ... of the global order of examples (a
`Stream`: finite runs read first, then an endless tail). What a layout leaves unread is a
`Pool`: every consumer's finite runs, plus each tail's positions below T, the first position
from which the tails together hold every position of their class (all positions; one host's
class when only its workers change); `deal` gives consumer i of a new layout of K' a
contiguous share of the pooled runs, then the tail (T + i d, d K'). Nothing is read twice or
skipped, whatever the layouts before and after.

Worked example (K = 2: consumer 0 reads 0, 2, 4 and stops at 6; consumer 1 reads 1 and stops
at 3; the new layout has K' = 3)::

    left       consumer 0: tail (6, 2)           consumer 1: tail (3, 2)
    pool       runs: 3, 5 (consumer 1's positions below T = 6)    tail (6, step 1)
    dealt      consumer 0: 6, 9, ...    consumer 1: 3, then 7, 10, ...    consumer 2: 5, 8, ...
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Any


@dataclasses.dataclass
class Positions:
    """Finite `runs` ([start, step, count] each, in order), then the endless `tail` [t, step]:
    t, t + step, ...; as a state, plain lists."""

    runs: list[list[int]]
    tail: list[int]

    def to_state(self) -> dict[str, Any]:
        return {"runs": [list(r) for r in self.runs], "tail": list(self.tail)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Any:
        return cls([[int(v) for v in r] for r in state["runs"]],
                   [int(v) for v in state["tail"]])


class Stream(Positions):
    """Positions one consumer reads, in order. Reading moves the front; the state is what is
    left."""

    @classmethod
    def initial(cls, index: int, count: int) -> Stream:
        """Consumer `index` of `count`: index, index + count, ..."""
        return cls([], [int(index), int(count)])

    def next(self, limit: int | None) -> int | None:
        """The next position (and moves past it); None, without moving, where it is at or past
        `limit` (the end of the run's epochs; finite runs are clipped to it, `clip`)."""
        runs = self.runs
        if runs:
            run = runs[0]
            p = run[0]
            if run[2] == 1:
                del runs[0]
            else:
                run[0] += run[1]
                run[2] -= 1
            return p
        p = self.tail[0]
        if limit is not None and p >= limit:
            return None
        self.tail[0] = p + self.tail[1]
        return p

    def peek(self) -> int:
        return self.runs[0][0] if self.runs else self.tail[0]

    def clip(self, limit: int | None) -> Stream:
        """The finite runs without their positions at or past `limit`."""
        if limit is not None:
            runs = []
            for start, step, count in self.runs:
                n = 0 if start >= limit else min(count, -(-(limit - start) // step))
                if n:
                    runs.append([start, step, n])
            self.runs = runs
        return self


class Pool(Positions):
    """Positions left by a layout: `runs` (finite, dealt in contiguous shares), then every
    position t, t + step, ... of the tail (`step` 1: all; H: one host's class of H)."""


def pool(streams: list[Stream], *, whole: bool) -> Pool:
    """The positions `streams` leave. `whole`: they are every consumer of the run, and their
    tails hold every position from some point on (else: one host's consumers, whose tails hold
    one class of positions: t mod d, d = their step / their number)."""
    tails = [s.tail for s in streams]
    if whole:
        step = 1
        # the tails must deal every position between them: densities sum to 1
        assert sum(Fraction(1, s) for _, s in tails) == 1, tails
    else:
        step = tails[0][1] // len(tails)
        assert all(s == tails[0][1] for _, s in tails), tails
        assert len({t % step for t, _ in tails}) == 1, tails
    T = max(t for t, _ in tails)
    T += (tails[0][0] - T) % step  # the class of the tails (0 where step is 1)
    runs = [list(r) for s in streams for r in s.runs]
    for t, s in tails:
        n = -(-(T - t) // s)
        if n > 0:
            runs.append([t, s, n])
    return Pool(runs, [T, step])


def deal(left: Pool, index: int, count: int) -> Stream:
    """Consumer `index` of `count`'s stream of the pool: its contiguous share of the runs (in
    order), then the tail (T + index step, step count)."""
    total = sum(c for _, _, c in left.runs)
    lo, hi = total * index // count, total * (index + 1) // count
    runs, at = [], 0
    for start, step, n in left.runs:
        a, b = max(lo, at), min(hi, at + n)
        if a < b:
            runs.append([start + (a - at) * step, step, b - a])
        at += n
    T, step = left.tail
    return Stream(runs, [T + index * step, step * count])
