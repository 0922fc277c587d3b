"""Rows leave the online packer in an unbiased order by default: within every window, a row's
segment count is uncorrelated with when it is emitted (the planner's order runs from one-segment
rows to many-segment rows); make_training_pipeline packs that way too."""

from __future__ import annotations

import numpy as np
import pytest

from seqpack.packer import PackConfig
from seqpack.pipelines.datasets import (
    ArraySource,
    Batching,
    PackIterDataset,
    Window,
    make_training_pipeline,
)
from tests.helpers.pipelines import iter_source, unique_corpus


def _wide_corpus(n: int = 6000):
    rng = np.random.default_rng(0)  # lengths from 1 to 512: log-uniform
    lengths = np.exp(rng.uniform(0, np.log(512), n)).astype(np.int64)
    return unique_corpus(lengths)


def _ranks(x) -> np.ndarray:
    """Ranks of x, tied values sharing their mean rank."""
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    return (np.cumsum(counts) - (counts - 1) / 2)[inverse]


def _per_window_corr(ds) -> float:
    """Spearman correlation, over all rows, of a row's segment count with its relative place in
    the rows its window emitted (0 first, 1 last)."""
    it, groups = iter(ds), {}
    for row in it:
        groups.setdefault(it.counters["examples_read"], []).append(
            int((row["tokens_segment_lengths"] > 0).sum()))
    place = np.concatenate([np.arange(len(g)) / (len(g) - 1) for g in groups.values()
                            if len(g) > 1])
    segments = np.concatenate([g for g in groups.values() if len(g) > 1])
    return float(np.corrcoef(_ranks(place), _ranks(segments))[0, 1])


@pytest.mark.parametrize("shuffle_rows", [None, False])
def test_default_row_order_is_uncorrelated_with_the_row_index(shuffle_rows):
    values, offsets = _wide_corpus()
    kw = {} if shuffle_rows is None else {"shuffle_rows": shuffle_rows}
    corr = _per_window_corr(PackIterDataset(iter_source(values, offsets),
                                            PackConfig(512, max_segments=64),
                                            window=Window(256, **kw)))
    if shuffle_rows is None:  # the default
        assert abs(corr) < 0.12, corr  # about 1000 rows: chance alone stays near 0.03
    else:
        assert corr > 0.5, corr  # the planner's sawtooth, which the default removes


def test_training_pipeline_shuffles_rows_by_default():
    values, offsets = _wide_corpus(600)
    src = ArraySource.from_ragged(values, offsets)
    kw = dict(pack=PackConfig(512), shuffle_seed=3, num_epochs=1,
              batch=Batching(1, drop_remainder=False, shard_index=0, shard_count=1))
    seq = lambda **o: [b["segment_source_index"][0].tolist() for b in
                       make_training_pipeline(src, **kw, window=Window(128, **o))]
    default, planner = seq(), seq(shuffle_rows=False)
    assert default == seq(shuffle_rows=True) and default != planner
    assert sorted(default) == sorted(planner)  # the same rows, in another order
