"""SFT inputs and pack jobs shared by the format tests (tests/test_formats*.py)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from seqpack.packer import PackConfig
from seqpack.pipelines.formats.inputs import ReadOptions
from seqpack.pipelines.offline import PackJob, WriteOptions

CONFIG = PackConfig(40, max_segments=5, overflow="split", feature="input_ids")
COLUMNS = ("labels", "completion_mask")


def write_sft(path, rng: np.random.Generator, n: int, max_len: int = 55) -> str:
    """Parquet with `input_ids`, `labels` (-100 on a prompt prefix) and `completion_mask`."""
    tokens, labels, masks = [], [], []
    for m in rng.integers(0, max_len + 1, n).tolist():
        t = rng.integers(0, 500, m)
        prompt = int(rng.integers(0, m + 1))
        tokens.append(t.tolist())
        labels.append(np.where(np.arange(m) < prompt, -100, t).tolist())
        masks.append((rng.random(m) < 0.8).astype(int).tolist())
    pq.write_table(pa.table({"input_ids": pa.array(tokens, pa.list_(pa.int32())),
                             "labels": pa.array(labels, pa.list_(pa.int32())),
                             "completion_mask": pa.array(masks, pa.list_(pa.int8()))}), path)
    return str(path)


def job(paths, out, fmt: str, **kw) -> PackJob:
    return PackJob(paths, out, CONFIG,
                   read_options=ReadOptions(column="input_ids", extra_columns=COLUMNS),
                   write_options=WriteOptions(shard_rows=6, format=fmt), **kw)
