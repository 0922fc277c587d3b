"""`--format parquet` read as any Parquet consumer reads it: pyarrow, pandas, DuckDB (and HF
`datasets` with `--datasets`, Spark SQL with `--spark`), without seqpack. Usage:
parquet_rows.py OUT INPUT... [--datasets] [--spark]

Every row is checked against the row contract and every segment against its source example.
"""

from __future__ import annotations

import glob
import json
import os
import sys

import numpy as np
import pyarrow.parquet as pq
from inputs import done, examples, source

out, rest = sys.argv[1], sys.argv[2:]
use_datasets, use_spark = "--datasets" in rest, "--spark" in rest
ex = examples([p for p in rest if not p.startswith("--")])
manifest = json.load(open(os.path.join(out, "manifest.json")))
L, S, f = manifest["seq_len"], manifest["max_segments"], manifest["feature"]
files = sorted(glob.glob(os.path.join(out, "*.parquet")))
assert [os.path.basename(p) for p in files] == manifest["shards"], files
table = pq.read_table(files)  # pyarrow: every shard as one table
rows = table.to_pydict()
n = table.num_rows
assert n == manifest["num_rows"], (n, manifest["num_rows"])
seen = []
for r in range(n):
    tokens, seg, pos = (np.array(rows[k][r]) for k in (f, f"{f}_segment_ids", f"{f}_positions"))
    lengths, offsets = np.array(rows[f"{f}_segment_lengths"][r]), np.array(
        rows[f"{f}_segment_offsets"][r])
    index, start = rows["segment_source_index"][r], rows["segment_source_start"][r]
    assert tokens.shape == seg.shape == pos.shape == (L,) and lengths.shape == (S,)
    labels = np.array(rows["labels"][r])
    used = np.zeros(L, bool)
    for j in np.flatnonzero(lengths):
        a, m = int(offsets[j]), int(lengths[j])
        assert (seg[a : a + m] == j + 1).all() and (pos[a : a + m] == np.arange(m)).all()
        assert (tokens[a : a + m] == source(ex, index[j], start[j], m, "input_ids")).all()
        assert (labels[a : a + m] == source(ex, index[j], start[j], m, "labels")).all()
        used[a : a + m] = True
        seen.append((index[j], start[j], m))
    assert (seg[~used] == 0).all() and (labels[~used] == -100).all()
covered = {}
for i, s, m in sorted(seen):
    assert covered.get(i, 0) == s, ("a piece missing or twice", i, s)
    covered[i] = s + m
assert all(covered.get(i, 0) == len(e["input_ids"]) for i, e in enumerate(ex))

import duckdb  # noqa: E402
import pandas as pd  # noqa: E402

frame = pd.read_parquet(files)
assert len(frame) == n and list(frame[f].iloc[0]) == rows[f][0]
got = duckdb.connect().execute(f"select count(*), sum(list_sum({f}_segment_lengths)) from "
                               f"read_parquet({files!r})").fetchall()
assert got == [(n, sum(len(e["input_ids"]) for e in ex))], got
if use_datasets:
    import datasets  # noqa: E402

    ds = datasets.load_dataset("parquet", data_files=files, split="train")
    assert len(ds) == n and ds[n - 1][f] == rows[f][n - 1]
if use_spark:
    from pyspark.sql import SparkSession  # noqa: E402
    from pyspark.sql import functions as F  # noqa: E402

    spark = SparkSession.builder.master("local[1]").appName("parquet_rows").getOrCreate()
    try:
        df = spark.read.parquet(*files)
        total = df.select(F.aggregate(f"{f}_segment_lengths", F.lit(0),
                                      lambda a, x: a + x).alias("t")).agg(F.sum("t")).first()[0]
        assert df.count() == n and total == sum(len(e["input_ids"]) for e in ex), total
        first = df.where(F.element_at(f"{f}_segment_offsets", 1) == 0).first()
        assert len(first[f]) == L and len(first[f"{f}_segment_lengths"]) == S
    finally:
        spark.stop()
done(f"{n} rows, {len(seen)} segments")
