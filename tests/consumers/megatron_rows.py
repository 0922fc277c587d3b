"""`--format megatron` read as Megatron-Bridge reads it, without seqpack (its package does not
install here). Usage: megatron_rows.py OUT INPUT...

Written from NVIDIA-NeMo/Megatron-Bridge at 067f987df03b8355b03192d88d70f1709fedf51a:
`src/megatron/bridge/data/packing/parquet.py` (REQUIRED_COLUMNS, the documented schema,
`GPTSFTPackedParquetDataset.validate_row` copied as it is, `__getitem__`),
`src/megatron/bridge/data/packing/gpt_sft.py` (`collate_fn`'s tokens, labels and answer-only
`_build_loss_mask`), `src/megatron/bridge/data/packing/algorithms.py` (`fill_packing_strategy`'s
shifted loss mask, `create_packing_strategy`'s metadata) and `paths.py` (a directory is its
*.parquet files, sorted).
"""

from __future__ import annotations

import glob
import json
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq
from inputs import done, examples, loss, source

REQUIRED_COLUMNS = {"input_ids", "seq_start_id", "loss_mask"}


def validate_row(idx: int, input_ids: list, loss_mask: list, seq_start_id: list) -> None:
    # GPTSFTPackedParquetDataset.validate_row, as it is
    if len(loss_mask) != len(input_ids):
        raise ValueError(f"Row {idx}: loss_mask length ({len(loss_mask)}) != input_ids length ({len(input_ids)})")  # noqa: E501

    if not seq_start_id or seq_start_id[0] != 0:
        raise ValueError(
            f"Row {idx}: seq_start_id must start with 0, got {seq_start_id[:5] if seq_start_id else []}"  # noqa: E501
        )

    for i, start in enumerate(seq_start_id):
        if start >= len(input_ids):
            raise ValueError(f"Row {idx}: seq_start_id[{i}]={start} >= len(input_ids)={len(input_ids)}")  # noqa: E501
        if i > 0 and start < seq_start_id[i - 1]:
            raise ValueError(
                f"Row {idx}: seq_start_id is not non-decreasing at index {i}: {seq_start_id[i - 1]} > {start}"  # noqa: E501
            )


out, paths = sys.argv[1], sys.argv[2:]
ex = examples(paths)
manifest = json.load(open(os.path.join(out, "manifest.json")))
pack_size = manifest["seq_len"]
files = sorted({*glob.glob(os.path.join(out, "*.parquet")), *glob.glob(os.path.join(out, "*.pq"))})
assert [os.path.basename(p) for p in files] == manifest["shards"], files
assert all(p.endswith(".idx.parquet") for p in files)
packed_seq_lens, all_seq_lens, bins, seen = [], [], [], []
for path in files:
    schema = pq.read_schema(path)
    assert REQUIRED_COLUMNS <= set(schema.names), schema.names
    assert schema.field("input_ids").type == pa.list_(pa.int32())
    assert schema.field("seq_start_id").type == pa.list_(pa.int32())
    assert schema.field("loss_mask").type == pa.list_(pa.int8())
    pf = pq.ParquetFile(path)
    for g in range(pf.metadata.num_row_groups):  # __getitem__: a row group, then .as_py()
        table = pf.read_row_group(g, columns=["input_ids", "seq_start_id", "loss_mask",
                                              "segment_source_index", "segment_source_start"])
        for r in range(table.num_rows):
            input_ids, seq_start_id, loss_mask = (table.column(k)[r].as_py() for k in (
                "input_ids", "seq_start_id", "loss_mask"))
            index, start = (table.column(k)[r].as_py() for k in ("segment_source_index",
                                                                "segment_source_start"))
            validate_row(len(bins), input_ids, loss_mask, seq_start_id)
            seq_boundaries = seq_start_id + [len(input_ids)]
            lens = [b - a for a, b in zip(seq_boundaries[:-1], seq_boundaries[1:])]
            for i, (a, b) in enumerate(zip(seq_boundaries[:-1], seq_boundaries[1:])):
                m = b - a
                tokens = source(ex, index[i], start[i], m, "input_ids")
                assert input_ids[a:b] == tokens.tolist(), (path, r, i)
                # fill_packing_strategy: the example's mask rolled by one, False on its last
                mask = loss(ex, index[i], start[i], m).tolist()
                assert loss_mask[a:b] == [int(x) for x in mask[1:] + [False]], (path, r, i)
                # collate_fn: tokens [a, b - 1), labels [a + 1, b), answer-only loss mask
                # loss_mask[a : b - 1]: label j (token a + 1 + j) trains iff that token takes
                # loss in its example
                labels = input_ids[a + 1 : b]
                assert labels == tokens[1:].tolist()
                assert loss_mask[a : b - 1] == [int(x) for x in mask[1:]]
                seen.append((index[i], start[i], m))
            all_seq_lens += [n - 1 for n in lens]  # create_hist: len(input_ids) - 1
            packed_seq_lens.append(sum(n - 1 for n in lens))
            bins.append(len(lens))
assert max(packed_seq_lens) <= pack_size
covered = {}
for i, s, m in sorted(seen):
    assert covered.get(i, 0) == s, ("a piece missing or twice", i, s)
    covered[i] = s + m
assert all(covered.get(i, 0) == len(e["input_ids"]) for i, e in enumerate(ex))
# create_packing_strategy's metadata; pad_cu_seqlens reads a list of such dicts
metadata = json.load(open(os.path.join(out, f"{pack_size}_metadata.jsonl")))
assert isinstance(metadata, list) and len(metadata) == 1, metadata
want = {
    "dataset_max_seqlen": max(all_seq_lens),
    "max_samples_per_bin": max(bins),
    "packing_factor": round(len(all_seq_lens) / len(packed_seq_lens), 2),
    "packing_efficiency": round(sum(packed_seq_lens) / len(packed_seq_lens) / pack_size * 100, 2),
    "pack_size": pack_size,
    "min_packed_seqlen": min(packed_seq_lens),
}
assert metadata[0] == want, (metadata[0], want)
done(f"{len(bins)} rows, {len(seen)} segments")
