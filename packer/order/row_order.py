"""The ordering stage: the ONE place packed rows get their output order.

The planner numbers rows its own way (best fit decreasing: longest examples first), which no
consumer should see. `RowOrder` says how output row o is chosen among the plan's rows:

* `SHUFFLE` (default): a seeded pseudo-random permutation of the rows (`order.permute`, a
  Feistel network evaluated per index), so every contiguous range of rows has the same mix.
* `PLAN`: the planner's order.
* `BALANCED` (`data_parallel` D, `batch_size` b): rank r of step s reads output rows
  [(s*D + r)*b, (s*D + r + 1)*b); the D ranks of every step carry near-equal cost under
  `cost` (`order.cost`), and the steps come in a seeded random order. The row count is
  unchanged. When the rows are not a multiple of D*b, the last, incomplete step comes last.

Two levels, so that nothing per row meets in one place (the Beam job plans blocks of examples on
different workers; the local writer runs the same functions, so both give the same order):

1. `block_layout(costs, order, block=j, segments=...)` — per block of plan rows, from the
   block's row costs (and segment counts): its full steps, rows in rank layout (4 bytes a row),
   and its leftover rows (< D*b, the block's cheapest: the sparse low tail). With one row a
   rank (b = 1) the rows are sorted by cost, D consecutive rows a step: rows of like cost share
   a step, the only way a step of one row per rank can be even. With two or more, a step is a
   random draw of rows, and only the heaviest rows, which no random step balances, make steps
   of their own (as few as the balance needs, and no more than keep the steps' mean segments
   per row spread within 1.5 times a random order's: a step stays a random sample, not a
   length curriculum). Inside a step the rows are dealt to the ranks by cost in snake order
   (the D heaviest one each, the next D the other way round, ...), then the ranks shuffled.
2. `global_order(summaries, order)` — from each block's `summary()` (row count, leftover rows
   and their costs: small): arranges all leftovers like a block, permutes all full steps
   (`Permutation` over steps) and returns a compact `GlobalOrder`.
   Both levels measure what they lay out: `StepBalance` (`order.balance`) of their full steps
   (per step the most loaded rank's cost over the mean rank's) against as many steps of the
   same rows in a seeded random order; the blocks' add up to `GlobalOrder.balance`, which the
   manifest's stats hold as ``step_balance``.
3. `GlobalOrder.plan_rows_at(out_start, out_stop, layouts)` — the plan rows of output rows
   [out_start, out_stop) (what one shard's writer needs), and its inverse
   `output_positions(plan_rows, layouts)` (what a worker routing a block's pieces needs).
   SHUFFLE and PLAN need no layouts (O(1) memory); BALANCED the layouts of the blocks queried.

Worked example (BALANCED, D = 2, b = 1; one block of 7 rows; costs by plan row)::

    costs:        r0 9   r1 1   r2 5   r3 8   r4 2   r5 4   r6 6
    sorted:       r0 9  r3 8  r6 6  r2 5  r5 4  r4 2  r1 1
    leftover:     1 row (7 % 2): the cheapest, r1
    steps:        [r0, r3]  [r6, r2]  [r5, r4]    (pairs of neighbours: max/mean 1.06, 1.09, 1.33)
    ranks:        shuffled inside each step: [r0, r3]  [r2, r6]  [r5, r4]
    output:       steps permuted by the seed (0), the incomplete step [r1] last:
                  r5 r4 | r0 r3 | r2 r6 | r1
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from functools import cached_property

import numpy as np

from seqpack.packer.config import enum_value
from seqpack.packer.order.balance import StepBalance
from seqpack.packer.order.cost import CostModel
from seqpack.packer.order.mix_steps import mixture_steps
from seqpack.packer.order.permute import Permutation

_ROW_SALT, _STEP_SALT, _RANK_SALT, _BALANCE_SALT = 0, 1, 2, 3
_TOLERANCE = 0.02  # balanced steps of drawn rows: every step's ranks within this of their mean
_SPREAD = 1.5  # ... and the steps' spread of mean segments per row within this of a random order


class OrderMode(enum.StrEnum):
    """How output rows are ordered (see the module docstring)."""

    SHUFFLE = "shuffle"
    PLAN = "plan"
    BALANCED = "balanced"


@dataclasses.dataclass(frozen=True)
class RowOrder:
    """The output order of packed rows; `to_dict` goes into the manifest as `row_order`."""

    mode: OrderMode | str = OrderMode.SHUFFLE
    seed: int = 0
    data_parallel: int | None = None  # D: ranks per step (BALANCED only)
    batch_size: int = 1  # b: rows per rank per step (BALANCED only)
    cost: CostModel = dataclasses.field(default_factory=CostModel)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", enum_value(OrderMode, "mode", self.mode))
        for name in ("seed", "batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | np.integer):
                raise ValueError(f"{name}={v!r} must be an int")
            object.__setattr__(self, name, int(v))
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed={self.seed} must be in [0, 2**63)")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size} must be >= 1")
        D = self.data_parallel
        if self.mode is OrderMode.BALANCED:
            if isinstance(D, bool) or not isinstance(D, int | np.integer) or D < 1:
                raise ValueError(f"data_parallel={D!r} must be an int >= 1 with mode='balanced' "
                                 "(the number of data-parallel ranks)")
            object.__setattr__(self, "data_parallel", int(D))
        elif D is not None or self.batch_size != 1:
            raise ValueError(f"data_parallel={D!r} and batch_size={self.batch_size} are for "
                             f"mode='balanced' only (mode={str(self.mode)!r})")
        if not isinstance(self.cost, CostModel):
            raise ValueError(f"cost={self.cost!r} must be a CostModel")

    def row_costs(self, row: object, length: object, num_rows: int) -> np.ndarray:
        """f64[num_rows]: what `block_layout` needs of a block's rows, from its pieces' rows and
        lengths: their costs under `cost` for BALANCED; zeros otherwise (no other mode looks
        at costs)."""
        if self.mode is not OrderMode.BALANCED:
            return np.zeros(num_rows)
        return self.cost.row_costs(row, length, num_rows)

    @property
    def step_rows(self) -> int:
        """Rows per step, D * b (1 unless BALANCED)."""
        return (self.data_parallel or 1) * self.batch_size

    def to_dict(self) -> dict:
        return {"mode": str(self.mode), "seed": self.seed, "data_parallel": self.data_parallel,
                "batch_size": self.batch_size, "cost": self.cost.to_dict()}

    @classmethod
    def from_dict(cls, d: Mapping) -> RowOrder:
        d = dict(d)
        unknown = set(d) - {"mode", "seed", "data_parallel", "batch_size", "cost"}
        if unknown:
            raise ValueError(f"unknown row_order fields {sorted(unknown)}")
        if "cost" in d:
            d["cost"] = CostModel.from_dict(d["cost"])
        return cls(**d)


# -- level 1: one block ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """One block's rows (local indices 0..num_rows-1) in output layout; see `block_layout`."""

    block: int
    num_rows: int
    rows: np.ndarray  # i32[f * D * b]: step q, rank r, slot i at (q * D + r) * b + i
    leftover: np.ndarray  # i32[m]: rows left for the global step (m < D * b)
    leftover_costs: np.ndarray  # f64[m]
    balance: StepBalance | None = None  # of the block's full steps (BALANCED)

    @property
    def num_steps(self) -> int:
        return int(self.rows.size)

    def summary(self) -> BlockLayout:
        """What the global step needs (no per-row arrays but the leftovers)."""
        return BlockLayout(self.block, self.num_rows, np.zeros(0, np.int32), self.leftover,
                           self.leftover_costs, self.balance)

    @cached_property
    def where(self) -> np.ndarray:
        """i32[num_rows]: position of each local row in `rows`, -1 for leftovers (built on the
        first `output_positions` query: 4 more bytes a row)."""
        out = np.full(self.num_rows, -1, np.int32 if self.num_rows < 2**31 else np.int64)
        out[self.rows] = np.arange(self.rows.size)
        return out


def _dealt(steps: np.ndarray, costs: np.ndarray, D: int, b: int) -> np.ndarray:
    """i64[F, D * b]: each step's rows (`steps`, [F, D * b]) in rank layout: by cost, dealt to
    the ranks in snake order (the layer of the D heaviest one each, the next layer the other
    way round, ...): for b = 2 each rank's heavier row meets a lighter one."""
    F = steps.shape[0]
    layers = np.take_along_axis(steps, np.argsort(-costs[steps], axis=1, kind="stable"), 1)
    layers = layers.reshape(F, b, D)
    layers[:, 1::2, :] = layers[:, 1::2, ::-1]
    return layers.transpose(0, 2, 1).reshape(F, D * b)


def _spread(steps: np.ndarray, key: np.ndarray) -> float:
    """The spread (std) over steps of their rows' mean `key` (segments per row, or cost)."""
    return float(key[steps].mean(axis=1).std()) if steps.size else 0.0


def _arrange(costs: np.ndarray, D: int, b: int, rng: np.random.Generator, *,
             segments: np.ndarray | None = None, random_rows: np.ndarray | None = None,
             units: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(rows in rank layout for the full steps, leftover rows) of rows with these costs.

    One row a rank (b = 1): the q-th D rows by cost make step q (rows of like cost share a step:
    the only way a step of one row per rank is even). Two or more a rank: steps are random draws
    of rows, each dealt to the ranks by cost (`_dealt`), but for the heaviest rows, which no
    random step could balance: they make steps of their own, as few as keep every random step's
    ranks within `_TOLERANCE` of their mean, and (given the rows' `segments`) no more than keep
    the steps' spread of mean segments per row within `_SPREAD` times that of `random_rows`'
    steps (a random order). Given a mixture's `units` (i64[n, K], per row and dataset), steps
    of two or more rows (and the leftover) are dealt by dataset share instead (`mix_steps`),
    then to the ranks by cost."""
    n, G = costs.size, D * b
    full = n // G
    if units is not None and G > 1:
        mixed, leftover = mixture_steps(units, G, rng)
        return _ranks(_dealt(mixed, costs, D, b), full, D, b, rng), leftover
    desc = np.argsort(-costs, kind="stable")
    # The cheapest rows stay for the global step: the sparse low tail (short last rows of the
    # plan) would make the spread of a full step widest.
    desc, leftover = desc[: full * G], desc[full * G :]
    if b == 1 or full == 0:
        steps = _dealt(desc.reshape(full, G), costs, D, b)
    else:
        draw = rng.permutation(full * G)  # the random steps' draw

        def layout(h: int) -> np.ndarray:  # the h heaviest steps grouped, the rest drawn
            rest = desc[h * G :]
            drawn = rest[draw[draw < rest.size]].reshape(full - h, G)
            return np.concatenate([_dealt(desc[: h * G].reshape(h, G), costs, D, b),
                                   _dealt(drawn, costs, D, b)])

        limit = np.inf  # without segment counts the spread is not measured: balance first
        key = np.zeros(n) if segments is None else np.asarray(segments, np.float64)
        if segments is not None:
            rand = rng.permutation(n) if random_rows is None else random_rows
            limit = _SPREAD * _spread(rand[: full * G].reshape(full, G), key)
        steps = layout(_heavy_steps(layout, full, costs, key, D, b, limit))
    return _ranks(steps, full, D, b, rng), leftover


def _ranks(steps: np.ndarray, full: int, D: int, b: int, rng: np.random.Generator
           ) -> np.ndarray:
    """The full steps' rows (rank layout) with the ranks shuffled inside each step, flat."""
    ranks = np.argsort(rng.random((full, D)), axis=1)
    steps = np.take_along_axis(steps.reshape(full, D, b), ranks[:, :, None], axis=1)
    return steps.reshape(-1)


def _heavy_steps(layout, full: int, costs: np.ndarray, key: np.ndarray, D: int, b: int,
                 limit: float) -> int:
    """How many of the heaviest steps to group (see `_arrange`): the fewest whose drawn steps
    all balance, but at most the most whose steps' spread stays within `limit`."""
    def balanced(h: int) -> bool:
        drawn = costs[layout(h)[h:]].reshape(full - h, D, b).sum(axis=2)
        mean = drawn.mean(axis=1)
        return bool((drawn.max(axis=1) <= (1 + _TOLERANCE) * mean).all())

    if balanced(0):
        return 0
    lo, hi = 0, full  # the most within the limit: lo is, hi is not (or is the whole)
    if _spread(layout(full), key) <= limit:
        lo = full
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _spread(layout(mid), key) <= limit else (lo, mid)
    if not balanced(lo):
        return lo
    fail, ok = 0, lo  # the fewest that balance: balanced(ok), not balanced(fail)
    while ok - fail > 1:
        mid = (fail + ok) // 2
        fail, ok = (fail, mid) if balanced(mid) else (mid, ok)
    return ok


def block_layout(costs: object, order: RowOrder, *, block: int = 0,
                 segments: object = None, units: object = None) -> BlockLayout:
    """Level 1: the layout of one block of plan rows with these costs (f64[n], local order);
    `segments` (i64[n], the rows' segment counts) keeps drawn steps random samples of the rows
    and is measured in the balance (`StepBalance.segments_spread`); a mixture's `units`
    (i64[n, K]: each row's units per dataset) make every step hold the block's shares."""
    costs = np.asarray(costs, np.float64)
    if costs.ndim != 1:
        raise ValueError(f"costs must be 1-D (one per row), got shape {costs.shape}")
    n = costs.size
    if segments is not None:
        segments = np.asarray(segments, np.int64)
        if segments.shape != costs.shape:
            raise ValueError(f"segments must hold one count per row ({n}), got shape "
                             f"{segments.shape}")
    if order.mode is not OrderMode.BALANCED:
        empty = np.zeros(0, np.int32)
        return BlockLayout(block, n, empty, empty, np.zeros(0))
    rng = np.random.default_rng([order.seed, _RANK_SALT, block])
    D, b = order.step_rows // order.batch_size, order.batch_size
    random_rows = _random_rows(n, [order.seed, block])
    rows, leftover = _arrange(costs, D, b, rng, segments=segments, random_rows=random_rows,
                              units=None if units is None else np.asarray(units, np.int64))
    balance = StepBalance.of(costs, rows, random_rows[: rows.size], D, b, segments=segments)
    return BlockLayout(block, n, rows.astype(np.int32), leftover.astype(np.int32),
                       costs[leftover], balance)


def _random_rows(n: int, key: list[int]) -> np.ndarray:
    """The same rows in a seeded random order: what the balance is measured against."""
    return np.random.default_rng([key[0], _BALANCE_SALT, *key[1:]]).permutation(n)


# -- level 2: every block ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GlobalOrder:
    """The compact global order: O(blocks + leftover rows); see the module docstring."""

    order: RowOrder
    num_rows: int
    row_base: np.ndarray  # i64[B + 1]: block j's plan rows are [row_base[j], row_base[j + 1])
    step_base: np.ndarray  # i64[B + 1]: block j's full steps, among all blocks' steps
    leftover_rows: np.ndarray  # i64[M]: plan rows of the leftover steps, in rank layout
    balance: StepBalance | None = None  # of every full step (BALANCED)

    @property
    def num_full_steps(self) -> int:
        """Full steps (D * b rows each), the last incomplete step not counted."""
        G = self.order.step_rows
        return int(self.step_base[-1]) + self.leftover_rows.size // G

    @cached_property
    def _steps(self) -> Permutation:
        return Permutation(self.num_full_steps, self.order.seed, _STEP_SALT)

    @cached_property
    def _rows(self) -> Permutation:
        return Permutation(self.num_rows, self.order.seed, _ROW_SALT)

    @cached_property
    def _leftover_sorted(self) -> tuple[np.ndarray, np.ndarray]:
        k = np.argsort(self.leftover_rows, kind="stable")
        return self.leftover_rows[k], k

    def plan_rows_at(self, out_start: int, out_stop: int,
                     layouts: Sequence[BlockLayout] | Mapping[int, BlockLayout] | None = None
                     ) -> np.ndarray:
        """i64[out_stop - out_start]: the plan row of each output row in [out_start, out_stop).
        BALANCED needs the layouts of the blocks those rows come from (indexed by block)."""
        if not 0 <= out_start <= out_stop <= self.num_rows:
            raise ValueError(f"output rows [{out_start}, {out_stop}) must lie in "
                             f"[0, {self.num_rows}]")
        out = np.arange(out_start, out_stop, dtype=np.int64)
        mode = self.order.mode
        if mode is OrderMode.PLAN:
            return out
        if mode is OrderMode.SHUFFLE:
            return self._rows(out)
        G = self.order.step_rows
        step, within = np.divmod(out, G)
        full = step < self.num_full_steps
        src_step = np.zeros_like(step)
        src_step[full] = self._steps(step[full])
        res = np.empty_like(out)
        blocks_steps = int(self.step_base[-1])
        in_block = full & (src_step < blocks_steps)
        if in_block.any():
            blk = np.searchsorted(self.step_base, src_step[in_block], side="right") - 1
            q = src_step[in_block] - self.step_base[blk]
            w = within[in_block]
            local = np.empty(blk.size, np.int64)
            for j in np.unique(blk).tolist():
                sel = blk == j
                local[sel] = _layout(layouts, j).rows[q[sel] * G + w[sel]]
            res[in_block] = self.row_base[blk] + local
        rest = ~in_block
        k = np.where(full[rest], src_step[rest] - blocks_steps, step[rest] - blocks_steps)
        res[rest] = self.leftover_rows[k * G + within[rest]]
        return res

    def output_positions(self, plan_rows: object,
                         layouts: Sequence[BlockLayout] | Mapping[int, BlockLayout] | None = None
                         ) -> np.ndarray:
        """i64: the output row of each plan row (the inverse of `plan_rows_at`)."""
        p = np.asarray(plan_rows, np.int64)
        if p.size and (p.min() < 0 or p.max() >= self.num_rows):
            raise ValueError(f"plan rows must lie in [0, {self.num_rows})")
        mode = self.order.mode
        if mode is OrderMode.PLAN:
            return p.copy()
        if mode is OrderMode.SHUFFLE:
            return self._rows.inverse(p)
        G = self.order.step_rows
        out = np.empty_like(p)
        blk = np.searchsorted(self.row_base, p, side="right") - 1
        pos = np.full(p.size, -1, np.int64)
        for j in np.unique(blk).tolist():
            sel = blk == j
            pos[sel] = _layout(layouts, j).where[p[sel] - self.row_base[j]].astype(np.int64)
        inb = pos >= 0
        step = self.step_base[blk[inb]] + pos[inb] // G
        out[inb] = self._steps.inverse(step) * G + pos[inb] % G
        if (~inb).any():
            keys, k = self._leftover_sorted
            at = k[np.searchsorted(keys, p[~inb])]
            lstep, w = np.divmod(at, G)
            lstep = lstep + int(self.step_base[-1])
            full = lstep < self.num_full_steps
            st = lstep.copy()
            st[full] = self._steps.inverse(lstep[full])
            out[~inb] = st * G + w
        return out


def _layout(layouts, j: int) -> BlockLayout:
    if layouts is None:
        raise ValueError("mode='balanced' needs the blocks' layouts (block_layout) to answer")
    lay = layouts[j]
    if lay.block != j:
        raise ValueError(f"the layout of block {lay.block} was given for block {j}")
    if lay.rows.size + lay.leftover.size != lay.num_rows:
        raise ValueError(f"block {j}: a summary() was given; pass block_layout's result")
    return lay


def global_order(summaries: Sequence[BlockLayout], order: RowOrder) -> GlobalOrder:
    """Level 2: the global order from every block's `summary()` (any order; blocks 0..B-1)."""
    summaries = sorted(summaries, key=lambda s: s.block)
    if [s.block for s in summaries] != list(range(len(summaries))):
        raise ValueError(f"summaries of blocks {[s.block for s in summaries]} must be of blocks "
                         f"0..{len(summaries) - 1}, each once")
    counts = np.array([s.num_rows for s in summaries], np.int64)
    row_base = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    G = order.step_rows
    steps = np.array([(s.num_rows - s.leftover.size) // G for s in summaries], np.int64)
    step_base = np.concatenate([[0], np.cumsum(steps)]).astype(np.int64)
    leftover_rows = np.zeros(0, np.int64)
    balance = None
    if order.mode is OrderMode.BALANCED and summaries:
        rows = np.concatenate([row_base[s.block] + s.leftover.astype(np.int64)
                               for s in summaries])
        costs = np.concatenate([s.leftover_costs for s in summaries])
        rng = np.random.default_rng([order.seed, _RANK_SALT, len(summaries)])
        D, b = order.data_parallel or 1, order.batch_size
        random_rows = _random_rows(costs.size, [order.seed, len(summaries)])
        full, tail = _arrange(costs, D, b, rng, random_rows=random_rows)
        leftover_rows = np.concatenate([rows[full], rows[np.sort(tail)]])
        balance = StepBalance.of(costs, full, random_rows[: full.size], D, b)
        for s in summaries:
            if s.balance is not None:
                balance = balance + s.balance
    return GlobalOrder(order, int(row_base[-1]), row_base, step_base, leftover_rows, balance)


def ordered(costs_per_block: Sequence[object], order: RowOrder,
            segments_per_block: Sequence[object] | None = None
            ) -> tuple[GlobalOrder, list[BlockLayout]]:
    """Both levels at once, for callers that hold every block's row costs (and segment counts:
    `block_layout`): the local runner, tests."""
    segments = segments_per_block or [None] * len(costs_per_block)
    layouts = [block_layout(c, order, block=j, segments=k)
               for j, (c, k) in enumerate(zip(costs_per_block, segments, strict=True))]
    return global_order([lay.summary() for lay in layouts], order), layouts
