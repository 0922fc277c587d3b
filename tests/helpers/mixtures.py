"""Mixtures of datasets whose tokens name them: each token says its dataset, example and
position, so every packed row can be checked against the references it carries
(tests/test_pipelines_mixture*.py)."""

from __future__ import annotations

from collections import Counter

import numpy as np

from seqpack.packer import PackConfig
from seqpack.pipelines.datasets import ArraySource, PackIterDataset, Window
from tests.helpers.pipelines import random_lengths, sft_corpus, sft_source

NAMES = ("a", "b", "c")


def named_sources(ns=(60, 30), highs=(12, 72), seed=0, sft=False):
    """Datasets whose tokens name them: dataset d's example i holds (d + 1) * 10**6 + i * 1000
    + position (so a row's tokens can be checked against the reference they carry)."""
    rng = np.random.default_rng(seed)
    out = {}
    for d, (n, high) in enumerate(zip(ns, highs)):
        lengths = random_lengths(rng, n, high=high)
        offsets = np.concatenate(([0], np.cumsum(lengths)))
        ex = np.repeat(np.arange(n), lengths)
        values = (d + 1) * 10**6 + ex * 1000 + (np.arange(offsets[-1]) - offsets[ex])
        if sft:
            _, _, labels, mask = sft_corpus(lengths, seed=seed + d)
            out[NAMES[d]] = sft_source(values, offsets, labels, mask)
        else:
            out[NAMES[d]] = ArraySource.from_ragged(values, offsets)
    return out


def checked_segments(rows):
    """(dataset, index, start, length) of every used slot, checked against the row's tokens."""
    out = []
    for r in rows:
        for j, (d, i, s, n, o) in enumerate(zip(
                r["segment_dataset_id"], r["segment_source_index"], r["segment_source_start"],
                r["tokens_segment_lengths"], r["tokens_segment_offsets"])):
            if n == 0:
                assert d == -1 and i == -1, (j, d, i)
                continue
            want = (d + 1) * 10**6 + i * 1000 + s + np.arange(n)
            np.testing.assert_array_equal(r["tokens"][o:o + n], want)
            out.append((int(d), int(i), int(s), int(n)))
    return out


def packed_tokens(rows):
    """(dataset, index) -> tokens packed of it."""
    c: Counter = Counter()
    for d, i, _, n in checked_segments(rows):
        c[(d, i)] += n
    return c


def example_lengths(sources):
    return {(d, i): len(src[i]["tokens"]) for d, src in enumerate(sources.values())
            for i in range(len(src))}


def packing(mix, L=128, window=16):
    return PackIterDataset(mix, PackConfig(L, max_segments=8, overflow="split"),
                           window=Window(window, window_rows=4))
