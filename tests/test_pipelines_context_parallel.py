"""Context parallelism in the training pipeline and the offline job: rows packed with
context_parallel=C (online, or `seqpack pack --context-parallel C` with C in the manifest), and
`Batching(context_parallel=C)` batches in the load-balanced layout, every [B, L] array permuted
alike and the [B, S] metadata left global."""

from __future__ import annotations

import json

import grain
import numpy as np
import pytest

from seqpack import packer
from seqpack.packer import PackConfig
from seqpack.pipelines.datasets import (
    Batching,
    Columns,
    ContextParallelLayout,
    PackedArrayRecordSource,
    Prefetch,
    make_training_pipeline,
)
from tests.helpers.pipelines import random_lengths, sft_corpus

L, S = 64, 8


def _examples(n=60, seed=0):
    values, offsets, labels, _ = sft_corpus(random_lengths(np.random.default_rng(seed), n,
                                                           high=40), seed=seed)
    return [{"tokens": values[a:b], "labels": labels[a:b]}
            for a, b in zip(offsets[:-1], offsets[1:])]


def _batches(source, *, context_parallel=None, pack=None, n=3, layout="te"):
    ds = make_training_pipeline(
        source, pack=pack, batch=Batching(4, shard_index=0, shard_count=1,
                                          context_parallel=context_parallel,
                                          context_parallel_layout=layout),
        shuffle_seed=3, num_epochs=1, columns=Columns(labels=["labels"]),
        prefetch=Prefetch(buffer_size=0))
    return [b for _, b in zip(range(n), ds)]


def _unpermuted(batch, C, layout="te"):
    order = packer.context_parallel_order(batch["tokens_segment_offsets"],
                                          batch["tokens_segment_lengths"], seq_len=L,
                                          context_parallel=C, layout=layout)
    back = np.argsort(order, axis=1)
    return {k: np.take_along_axis(v, back, axis=1) if v.ndim == 2 and v.shape[1] == L else v
            for k, v in batch.items()}


@pytest.mark.parametrize("C, layout", [(2, "te"), (4, "te"), (4, "rotated"), (4, "balanced")])
def test_batches_come_in_the_layout_of_rows_packed_for_it(C, layout):
    source = grain.MapDataset.source(_examples())
    got = _batches(source, context_parallel=C, pack=PackConfig(L, max_segments=S),
                   layout=layout)
    # the same rows as packing with context_parallel=C and no layout: permuted alike
    plain = _batches(source, pack=PackConfig(L, max_segments=S, context_parallel=C))
    assert len(got) == len(plain) == 3
    for b, p in zip(got, plain):
        if layout == "balanced":  # the order itself, for the kernels (no twin on device)
            order = b.pop("tokens_row_positions")
            np.testing.assert_array_equal(order, packer.context_parallel_order(
                b["tokens_segment_offsets"], b["tokens_segment_lengths"], seq_len=L,
                context_parallel=C, layout=layout))
        assert set(b) == set(p)
        for k in ("tokens_segment_offsets", "tokens_segment_lengths", "segment_source_index",
                  "loss_tokens"):
            np.testing.assert_array_equal(b[k], p[k])  # metadata stays global
        back = _unpermuted(b, C, layout)
        for k in ("tokens", "tokens_segment_ids", "tokens_positions", "labels"):
            np.testing.assert_array_equal(back[k], p[k], err_msg=k)
        packer.validate({k: v for k, v in back.items() if k != "labels" and k != "loss_tokens"},
                        PackConfig(L, max_segments=S, context_parallel=C))
        # rank r's slice: its chunks of every span, in row order (positions rise per segment)
        ids, pos = b["tokens_segment_ids"], b["tokens_positions"]
        for r in range(C):
            sl = slice(r * L // C, (r + 1) * L // C)
            for row_ids, row_pos in zip(ids[:, sl], pos[:, sl]):
                for seg in set(row_ids.tolist()) - {0}:
                    assert np.all(np.diff(row_pos[row_ids == seg]) > 0)


def test_the_layout_is_refused_for_rows_not_aligned_to_it():
    source = grain.MapDataset.source(_examples())
    with pytest.raises(ValueError, match=r"Batching\(context_parallel=4\) needs rows .* 2 x 4"):
        _batches(source, context_parallel=4, pack=PackConfig(L, max_segments=S,
                                                             context_parallel=1))
    with pytest.raises(ValueError, match="context_parallel=0"):
        Batching(4, context_parallel=0)
    with pytest.raises(ValueError, match="context_parallel_layout='thd' must be one of"):
        Batching(4, context_parallel=2, context_parallel_layout="thd")
    # rows packed for 4 ranks serve 2 (spans of multiples of 8 are multiples of 4)
    assert _batches(source, context_parallel=2, n=1,
                    pack=PackConfig(L, max_segments=S, context_parallel=4))


def test_the_layout_map_keeps_per_slot_arrays_when_s_equals_l():
    rows = packer.pack([np.arange(1, 6), np.arange(1, 4)],
                       PackConfig(8, max_segments=8, context_parallel=2))
    out = ContextParallelLayout(2)(rows)
    np.testing.assert_array_equal(out["tokens_segment_offsets"], rows["tokens_segment_offsets"])
    np.testing.assert_array_equal(out["segment_source_index"], rows["segment_source_index"])
    assert not np.array_equal(out["tokens"], rows["tokens"])
    rows["segment_dataset_id"] = np.arange(8, dtype=np.int32)[None].repeat(len(rows["tokens"]), 0)
    rows["other_segment_lengths"] = rows["tokens_segment_lengths"] + 1  # a second feature's
    out = ContextParallelLayout(2)(rows)  # a mixture's per-slot dataset ids stay per slot
    for key in ("segment_dataset_id", "other_segment_lengths"):
        np.testing.assert_array_equal(out[key], rows[key])


def _pack_dir(tmp_path, C):
    from seqpack.pipelines.formats.inputs import ReadOptions
    from seqpack.pipelines.offline import PackJob
    from seqpack.pipelines.offline import pack as run

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"tokens": e["tokens"].tolist(),
                                       "labels": e["labels"].tolist()}) + "\n"
                           for e in _examples(80, seed=1)))
    out = tmp_path / f"out{C}"
    job = PackJob([str(src)], str(out), PackConfig(L, max_segments=S, context_parallel=C),
                  read_options=ReadOptions(column="tokens", extra_columns=("labels",)),
                  workers=1, roles={"labels": "labels"})
    return out, run(job)


def test_offline_rows_record_c_and_feed_the_layout(tmp_path):
    out, manifest = _pack_dir(tmp_path, 2)
    assert manifest.context_parallel == 2
    assert json.loads((out / "manifest.json").read_text())["config"]["context_parallel"] == 2
    source = PackedArrayRecordSource(str(out))
    got = _batches(source, context_parallel=2, n=2)
    plain = _batches(source, n=2)
    for b, p in zip(got, plain):
        back = _unpermuted(b, 2)
        for k in ("tokens", "tokens_segment_ids", "tokens_positions", "labels"):
            np.testing.assert_array_equal(back[k], p[k], err_msg=k)
    with pytest.raises(ValueError, match=r"not the packed rows \(context_parallel=2\)"):
        _batches(source, context_parallel=4)


def test_several_features_share_context_parallel():
    from seqpack.pipelines.datasets import PackIterDataset
    from tests.helpers.pipelines import iter_source, unique_corpus

    ds = iter_source(*unique_corpus([3, 4]))
    with pytest.raises(ValueError, match="pack: context_parallel=2 for feature 'b' but "
                                         "context_parallel=None for 'a'"):
        PackIterDataset(ds, [PackConfig(8, feature="a"),
                             PackConfig(16, feature="b", context_parallel=2)])


def test_cli_takes_context_parallel(tmp_path):
    from click.testing import CliRunner

    from seqpack.cli import seqpack

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"tokens": e["tokens"].tolist()}) + "\n"
                           for e in _examples(40)))
    runner = CliRunner()
    bad = runner.invoke(seqpack, ["pack", str(src), "-o", str(tmp_path / "o"), "--seq-len", "18",
                                  "--context-parallel", "2"])
    assert bad.exit_code == 2
    assert "--seq-len 18 must be a multiple of 4 (2 x --context-parallel 2)" in bad.output
    ok = runner.invoke(seqpack, ["pack", str(src), "-o", str(tmp_path / "o"), "--seq-len", "64",
                                 "--context-parallel", "2"])
    assert ok.exit_code == 0, ok.output
    assert "for 2 context-parallel ranks" in ok.output
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert manifest["config"]["context_parallel"] == 2
    dry = runner.invoke(seqpack, ["stats", str(src), "--seq-len", "64", "--context-parallel", "4",
                                  "--json"])
    assert dry.exit_code == 0, dry.output
