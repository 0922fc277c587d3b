"""Grain's own packing tests (grain's testing_util suites) run on the drop-ins.

`segment_metadata=False`: the rows must be exactly Grain's (same keys, same values).
With the metadata on, the rows must be Grain's plus segment lengths/offsets that agree with the
segment ids. Grain's tests construct the packer with `max_sequences_per_bin=None` (no segment
cap) unless a test sets one, so the uncapped case is covered throughout.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

testing_util = pytest.importorskip("grain._src.python.dataset.transformations.testing_util")

from seqpack.pipelines import datasets as pipelines  # noqa: E402


def _checked_without_metadata(row: dict) -> dict:
    """The drop-in's row with its segment lengths/offsets checked against the segment ids,
    then left out (what stays is compared with Grain's expected rows)."""
    for k in [k for k in row if k.endswith("_segment_lengths")]:
        f = k[: -len("_segment_lengths")]
        seg, lens, offs = row[f + "_segment_ids"], row[k], row[f + "_segment_offsets"]
        assert lens.dtype == np.int32 and offs.dtype == np.int32
        assert lens.ndim == 1 and lens.shape == offs.shape and int(seg.max()) <= lens.shape[0]
        for j in range(lens.shape[0]):
            where = np.flatnonzero(seg == j + 1)
            assert lens[j] == where.size, (f, j, lens, seg)
            if where.size:
                assert offs[j] == where[0] and where[-1] - where[0] + 1 == where.size
    return {k: v for k, v in row.items()
            if not k.endswith(("_segment_lengths", "_segment_offsets"))}


def _with_metadata(cls):
    def make(parent, **kwargs):
        return cls(parent, **kwargs).map(_checked_without_metadata)
    return make


class TestFirstFitExact(testing_util.BaseFirstFitPackIterDatasetTest):
    packer_cls = functools.partial(pipelines.FirstFitPackIterDataset, segment_metadata=False)


class TestBestFitExact(testing_util.BaseBestFitPackIterDatasetTest):
    packer_cls = functools.partial(pipelines.BestFitPackIterDataset, segment_metadata=False)


class TestFirstFitWithMetadata(testing_util.BaseFirstFitPackIterDatasetTest):
    packer_cls = staticmethod(_with_metadata(pipelines.FirstFitPackIterDataset))


class TestBestFitWithMetadata(testing_util.BaseBestFitPackIterDatasetTest):
    packer_cls = staticmethod(_with_metadata(pipelines.BestFitPackIterDataset))
