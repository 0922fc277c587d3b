"""Packed directories (what `seqpack pack` writes) for the tests of packed rows as a training
input: plain or balanced for D ranks of B rows, and each row's stored number from its batch."""

from __future__ import annotations

import numpy as np

from seqpack.packer import PackConfig
from seqpack.pipelines.datasets import Columns, PackedArrayRecordSource, PackIterDataset, Window
from seqpack.pipelines.datasets import SequentialIterDataset as Seq
from tests.helpers.pipelines import random_lengths, sft_corpus, sft_source, write_packed

L, S = 32, 8
D, B = 4, 2  # a dataset balanced for 4 ranks of 2 rows per step


def packed_dir(path, n: int = 120, *, row_order=None, shard_rows: int = 7, tail=None):
    """Rows of n SFT examples (labels column) packed to L / S, written to `path`; `tail`:
    whole steps of `tail[0]` rows, then tail[1] rows. Returns the rows as a reader yields them."""
    values, offsets, labels, mask = sft_corpus(random_lengths(np.random.default_rng(0), n,
                                                              high=L), seed=1)
    rows = list(PackIterDataset(Seq(sft_source(values, offsets, labels, mask)),
                                PackConfig(L, max_segments=S), window=Window(16),
                                columns=Columns(labels=["labels"], drop=["mask"])))
    if tail is not None:
        rows = rows[: (len(rows) // tail[0] - 1) * tail[0] + tail[1]]
    return write_packed(path, rows, seq_len=L, max_segments=S, shard_rows=shard_rows,
                        columns={"labels": -100}, row_order=row_order)


def balanced_dir(path):
    """A dataset balanced for D ranks of B rows per step, with a partial last step."""
    order = {"mode": "balanced", "seed": 0, "data_parallel": D, "batch_size": B,
             "cost_model": {"kind": "tokens"}}
    stored = packed_dir(path, n=200, row_order=order, tail=(D * B, 3))
    assert len(stored) % (D * B) == 3
    return stored, PackedArrayRecordSource(path)


def row_ids(stored):
    """Stored row number of each row of a batch, from its (unique) segment source indices."""
    index = {tuple(r["segment_source_index"].tolist()): i for i, r in enumerate(stored)}
    return lambda batch: [index[tuple(s)] for s in batch["segment_source_index"].tolist()]
