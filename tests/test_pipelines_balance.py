"""Balance(ranks=N) online: each host batch's N equal slices carry near-equal cost; the batch keeps
its rows (only their order changes) and resume stays exact."""

from __future__ import annotations

import numpy as np
import pytest

from seqpack.packer import PackConfig
from seqpack.packer.order import CostModel
from seqpack.pipelines.datasets import (
    ArraySource,
    Balance,
    BalanceRanks,
    Batching,
    Prefetch,
    Window,
    make_training_pipeline,
)
from seqpack.pipelines.datasets.balance import row_costs
from tests.helpers.pipelines import check_restore_every_step, unique_corpus

N, B = 4, 16  # 4 local devices, 4 rows each


def _source(n: int = 2500):
    rng = np.random.default_rng(0)  # long documents and short turns: costs far apart
    lengths = np.exp(rng.uniform(0, np.log(1024), n)).astype(np.int64)
    return ArraySource.from_ragged(*unique_corpus(lengths))


def _kw(**over):
    return {**dict(pack=PackConfig(1024, max_segments=64), shuffle_seed=1, num_epochs=1,
                   batch=Batching(B, shard_index=0, shard_count=1), window=Window(256)), **over}


def _max_over_mean(batch, model) -> float:
    per = row_costs(model, batch["tokens_segment_lengths"]).reshape(N, -1).sum(1)
    return float(per.max() / per.mean())


def test_two_heavy_rows_go_to_different_slices():
    lengths = np.zeros((4, 3), np.int32)
    lengths[:2] = 300  # rows 0 and 1: three long segments each; rows 2 and 3: one short one
    lengths[2:, 0] = 30
    out = BalanceRanks(2, cost_model=CostModel())({"tokens_segment_lengths": lengths,
                                                   "row": np.arange(4)})
    assert sorted(out["row"].tolist()) == [0, 1, 2, 3]
    assert sorted(int(r) < 2 for r in out["row"][:2]) == [False, True]  # one heavy per slice


def test_balanced_batches_hold_the_same_rows_with_near_equal_slices():
    src, model = _source(), CostModel(d_model=16)  # k = 192: attention dominates at L = 1024
    plain = list(make_training_pipeline(src, **_kw()))
    balanced = list(make_training_pipeline(src, **_kw(balance=Balance(ranks=N, cost=model))))
    assert len(plain) == len(balanced) > 10
    for p, b in zip(plain, balanced, strict=True):
        key = lambda batch: sorted(map(tuple, batch["segment_source_index"].tolist()))
        assert key(p) == key(b)  # the same rows, reordered within the batch
    before = np.mean([_max_over_mean(b, model) for b in plain])
    after = np.mean([_max_over_mean(b, model) for b in balanced])
    assert before > 1.1 and after < 1.03, (before, after)  # measured: 1.20 -> 1.01


def test_balanced_pipeline_resumes_exactly():
    src = _source(300)
    make = lambda: iter(make_training_pipeline(src, **_kw(balance=Balance(ranks=N), num_epochs=2,
                                                          prefetch=Prefetch(buffer_size=0))))
    check_restore_every_step(make, max_rows=8)


def test_balance_ranks_must_divide_the_batch():
    with pytest.raises(ValueError, match=r"Balance\(ranks=3\) must be a divisor of "
                                         "batch_size=16"):
        make_training_pipeline(_source(10), **_kw(balance=Balance(ranks=3)))


def test_balance_is_checked_and_names_the_field():
    with pytest.raises(ValueError, match="ranks=0 must be an int >= 1"):
        Balance(ranks=0)
    with pytest.raises(ValueError, match="ranks=True must be an int >= 1"):
        Balance(ranks=True)
    with pytest.raises(ValueError, match="cost='tokens' must be a CostModel"):
        Balance(cost="tokens")
    with pytest.raises(ValueError, match="steps=1 must be a bool or None"):
        Balance(steps=1)
    with pytest.raises(ValueError, match="balance=4 must be a Balance"):
        make_training_pipeline(_source(10), **_kw(balance=4))
    assert Balance() == Balance(ranks=None, cost=None, steps=None)
