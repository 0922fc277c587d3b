"""Offline mixtures (`seqpack pack --mix`): which examples of each dataset a run packs, and
how often, so that each dataset gets its weight of the units (tokens, loss tokens, examples).

A mixture is one more kind of input to the same job: its datasets' inputs are the job's inputs
(dataset after dataset), and the selection turns their example lengths into the *mixed
stream*, the examples the job plans, each a reference to a corpus example (a repeated one is
referenced more than once). The plan is made on the stream's lengths; each piece then names its
corpus example, so reading, routing and writing tokens are as without a mixture. Per dataset d
of weight w_d holding A_d units::

    no mix_tokens     T = min_d A_d / w_d: the binding dataset whole, no repetition
    mix_tokens=N      T = N; dataset d is repeated t_d / A_d times, refused past max_repetition
    target            t_d = w_d * T: e_d = floor(t_d / A_d) whole epochs (each in a seeded
                      order), then a seeded sample whose units come nearest t_d - e_d * A_d
                      (exact within one example)

Runs select with `hashed` (its steps run on a cluster's workers, nothing per example in one
place); a manifest whose `mixture` names no `selection` was made with `legacy` (one place),
which verify still recomputes. Every block of the plan holds the mixture; the rows are then
shuffled as ever (`--row-order`). Rows carry `segment_dataset_id` and the example's index
within its dataset (`dataset_columns`); the manifest's `mixture` records the spec and what each
dataset gave.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from seqpack.pipelines.errors import one_line
from seqpack.pipelines.offline.mixture import hashed, legacy
from seqpack.pipelines.offline.mixture.spec import (
    DEFAULT_MAX_REPETITION,
    UNITS,
    MixSpec,
    Selection,
    corpus_index,
    corpus_sources,
    firsts_of,
    loss_columns_of,
    loss_count,
    piece_units,
    spec_of,
    units_of,
)
from seqpack.pipelines.offline.mixture.stats import shares, step_shares, table

__all__ = [
    "DEFAULT_MAX_REPETITION", "UNITS", "MixSpec", "Selection", "corpus_index", "corpus_sources",
    "example_times", "firsts_of", "hashed", "is_hashed", "legacy", "loss_columns_of",
    "loss_count", "piece_units", "plan_problems", "record_problems", "select_inputs", "shares",
    "spec_of", "step_shares", "table", "takes", "units_of",
]

select_inputs = hashed.select_inputs


def example_times(record: Mapping | None, lengths: Sequence[np.ndarray],
                  loss_counts: Sequence[np.ndarray | None], packed: Sequence[int] | None = None
                  ) -> tuple[np.ndarray, list[str]]:
    """How often a run takes each corpus example (i64[n]: once each without a mixture, a
    read-only view of one 1 that takes no memory), and what differs from the manifest's
    `mixture` record (its `inputs` paths aside: verify may read the inputs elsewhere), the
    selection made again from the inputs' lengths (and loss counts). A hashed mixture's takes
    come from its record, the examples numbered as packed (`packed`: each input's examples
    then; None: as now); a legacy one's from the selection made again."""
    total = sum(int(np.asarray(x).size) for x in lengths)
    once = np.broadcast_to(np.ones(1, np.int64), (total,))
    if not record:
        return once, []
    spec = spec_of(record)
    sizes = [int(np.asarray(x).size) for x in lengths]
    if is_hashed(record):
        times = np.concatenate([np.zeros(0, np.int64), *(
            takes(record, sizes if packed is None else packed, i, n)
            for i, n in enumerate(sizes))])
        try:
            made = hashed.plan_inputs(spec, hashed.inputs_of(spec, lengths, loss_counts))
        except ValueError as e:
            return times, plan_problems(one_line(e), record)
        return times, record_problems(made.record, record)
    try:
        selection = legacy.select_inputs(spec, lengths, loss_counts)
    except ValueError as e:
        return once, plan_problems(one_line(e), record)
    return np.bincount(selection.ref, minlength=total).astype(np.int64), record_problems(
        selection.record, record)


def record_problems(made: Mapping, record: Mapping) -> list[str]:
    """What differs between a mixture's record `made` from the inputs and the manifest's (its
    `inputs` paths aside: verify may read the inputs elsewhere); the first three."""
    problems = []
    for got, want in zip(made["datasets"], record["datasets"]):
        for key, value in got.items():
            if key != "inputs" and want.get(key) != value:
                problems.append(f"mixture dataset {got['name']!r}: the manifest records {key}="
                                f"{want.get(key)}, the inputs give {value}")
    return problems[:3]


def plan_problems(mix: hashed.MixPlan | str | None, record: Mapping) -> list[str]:
    """`record_problems` of a hashed mixture's plan made by a runner's steps (a str: why the
    inputs give none)."""
    if isinstance(mix, hashed.MixPlan):
        return record_problems(mix.record, record)
    return [f"the inputs no longer give the manifest's mixture: {mix}"]


def is_hashed(record: Mapping | None) -> bool:
    """Whether a manifest's `mixture` was selected by `hashed` (else by `legacy`, or none)."""
    return bool(record) and record.get("selection") == hashed.NAME  # type: ignore[union-attr]


def takes(record: Mapping | None, counts: Sequence[int], index: int, n: int | None = None
          ) -> np.ndarray | None:
    """How often a run takes each of the first `n` (None: all) examples of input `index` (i64),
    from a hashed mixture's record alone, numbered as packed (`counts`: each input's examples
    then); None for any other run."""
    if not is_hashed(record):
        return None
    assert record is not None
    spec = spec_of(record)
    d, first, _ = hashed.places_of(spec, counts).of(index)
    return hashed.plan_of(record).times(spec.seed, d, first, int(counts[index] if n is None
                                                                 else n))
