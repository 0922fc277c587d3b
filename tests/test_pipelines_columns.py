"""Label / mask columns online: packed with the tokens' segment layout, their own pads and dtypes,
lengths checked, nothing a source holds dropped without an error (PackIterDataset, the drop-ins,
make_training_pipeline)."""

from __future__ import annotations

import grain.experimental as ge
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack import packer
from seqpack.packer import PackConfig
from seqpack.pipelines import datasets
from seqpack.pipelines.datasets import (
    ArraySource,
    Batching,
    Columns,
    PackIterDataset,
    SequentialIterDataset,
    Window,
)
from seqpack.pipelines.errors import InputError
from tests.helpers.pipelines import (
    assert_rows_equal,
    check_restore_every_step,
    random_lengths,
    sft_corpus,
    sft_source,
    stack,
)

PADS = {"labels": -100, "mask": 3}  # a mask pad that is not 0, to see it used


def check_columns(rows, values, columns: dict[str, np.ndarray], pads: dict[str, int]):
    """Each column holds its source slice at its feature's segments, its pad elsewhere (the
    slice found by the segment's unique tokens: token t sits at flat position t - 1)."""
    for r, row in enumerate(rows):
        real = row["tokens_segment_ids"] > 0
        for name, src in columns.items():
            assert row[name].dtype == src.dtype and row[name].shape == row["tokens"].shape
            assert f"{name}_segment_ids" not in row
            assert (row[name][~real] == pads[name]).all(), (r, name)
            for j in np.flatnonzero(row["tokens_segment_lengths"]):
                o, m = row["tokens_segment_offsets"][j], row["tokens_segment_lengths"][j]
                a = int(row["tokens"][o]) - 1
                np.testing.assert_array_equal(row[name][o : o + m], src[a : a + m])
                np.testing.assert_array_equal(row["tokens"][o : o + m], values[a : a + m])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=30), st.integers(4, 24),
       st.integers(1, 4), st.sampled_from(["truncate", "split", "drop"]), st.integers(1, 6),
       st.booleans())
def test_pack_iter_dataset_packs_columns_with_the_tokens(lengths, L, S, overflow, window,
                                                         shuffle):
    values, offsets, labels, mask = sft_corpus(lengths)
    ds = PackIterDataset(SequentialIterDataset(sft_source(values, offsets, labels, mask)),
                         PackConfig(L, max_segments=S, overflow=overflow),
                         window=Window(window, shuffle_rows=shuffle),
                         columns=Columns(labels={"labels": -100}, masks={"mask": 3}))
    rows = list(ds)
    if rows:
        packer.validate({k: v for k, v in stack(rows).items() if k not in PADS},
                        packer.PackConfig(L, max_segments=S, overflow=overflow))
    check_columns(rows, values, {"labels": labels, "mask": mask}, PADS)
    kept = sum(int(r["tokens_segment_lengths"].sum()) for r in rows)
    want = sum(min(n, L) if overflow == "truncate" else (0 if n > L and overflow == "drop"
                                                         else n) for n in lengths)
    assert kept == want


def test_pack_iter_dataset_columns_restore_and_defaults():
    values, offsets, labels, mask = sft_corpus(random_lengths(np.random.default_rng(1), 80,
                                                              high=40))
    src = SequentialIterDataset(sft_source(values, offsets, labels, mask))
    ds = PackIterDataset(src, PackConfig(64), window=Window(8),
                         columns=Columns(labels=["labels"], masks=["mask"]))  # pads -100, 0
    rows = check_restore_every_step(lambda: iter(ds))
    check_columns(rows, values, {"labels": labels, "mask": mask},
                  {"labels": -100, "mask": 0})


def test_pack_iter_dataset_column_errors():
    values, offsets, labels, mask = sft_corpus([3, 4, 5])
    src = SequentialIterDataset(sft_source(values, offsets, labels, mask))
    with pytest.raises(InputError, match=r"element 0 of the parent holds \['labels', 'mask'\], "
                                         r"which would not reach the rows"):
        list(PackIterDataset(src, PackConfig(16)))
    rows = list(PackIterDataset(src, PackConfig(16), columns=Columns(drop=["labels", "mask"])))
    assert set(rows[0]) == set(packer.PackConfig(16).keys().roles().values())
    short = ArraySource({"tokens": (values, offsets), "labels": (labels[1:], offsets - 1
                                                                 + (offsets == 0))},
                        value_columns=["labels"])
    with pytest.raises(InputError, match="example 0: column 'labels' has length 2 but the "
                                         "feature 'tokens' it is packed with has 3"):
        list(PackIterDataset(SequentialIterDataset(short), PackConfig(16),
                             columns=Columns(labels=["labels"])))
    with pytest.raises(InputError, match="'labels': token id -100 at position 0 is negative"):
        list(PackIterDataset(src, [PackConfig(16), PackConfig(16, feature="labels")],
                             columns=Columns(masks=["mask"])))
    u8 = ArraySource({"tokens": (values, offsets), "labels": (np.zeros(12, np.uint8), offsets)})
    with pytest.raises(ValueError, match="the pad of column 'labels'=-100 does not fit the "
                                         "rows' dtype uint8"):
        list(PackIterDataset(SequentialIterDataset(u8), PackConfig(16),
                             columns=Columns(labels=["labels"])))
    with pytest.raises(ValueError, match="column 'labels' is given twice"):
        PackIterDataset(src, PackConfig(16), columns=Columns(labels=["labels"],
                                                             meta=["labels"]))


def _grain_columns(seed: int, n: int = 150):
    lengths = random_lengths(np.random.default_rng(seed), n, high=64)
    values, offsets, labels, mask = sft_corpus(lengths, seed)
    values = values % 1000
    return SequentialIterDataset(sft_source(values, offsets, labels.astype(np.int32), mask,
                                            ignored=np.arange(n))), (values, offsets, labels,
                                                                     mask)


@pytest.mark.parametrize("ours_cls,grain_cls", [
    (datasets.FirstFitPackIterDataset, ge.FirstFitPackIterDataset),
    (datasets.BestFitPackIterDataset, ge.BestFitPackIterDataset)], ids=["first", "best"])
@pytest.mark.parametrize("seed", [0, 1])
def test_dropins_pack_columns_as_grain_packs_meta_features(ours_cls, grain_cls, seed):
    ds, _ = _grain_columns(seed)
    kw = dict(num_packing_bins=6, seed=seed, max_sequences_per_bin=8 if seed else None)
    ours = list(ours_cls(ds, length_struct={"tokens": 64},
                         columns=Columns(labels={"labels": -100}, masks={"mask": 3}), **kw))
    theirs = list(grain_cls(ds, length_struct={"tokens": 64, "labels": 64, "mask": 64},
                            meta_features=["labels", "mask"],
                            padding_struct={"tokens": 0, "labels": -100, "mask": 3}, **kw))
    assert_rows_equal(ours, theirs, keys=set(theirs[0]))
    assert "labels_segment_ids" not in ours[0] and ours[0]["labels"].dtype == np.int32
    real = np.stack([r["tokens_segment_ids"] for r in ours]) > 0
    assert (np.stack([r["labels"] for r in ours])[~real] == -100).all()
    make = lambda: iter(ours_cls(ds, length_struct={"tokens": 64},
                                 columns=Columns(labels=["labels"]), **kw))
    check_restore_every_step(make, max_rows=12)


def test_dropin_column_errors_and_negative_values_as_grain():
    values, offsets, labels, mask = sft_corpus([3, 4, 5])
    short = ArraySource({"tokens": (values, offsets),
                         "labels": (labels[:-1], np.minimum(offsets, 11))},
                        value_columns=["labels"])
    with pytest.raises(InputError, match="parent element 2: column 'labels' has length 4 but "
                                         "the feature 'tokens' it is packed with has 5"):
        list(datasets.FirstFitPackIterDataset(SequentialIterDataset(short),
                                              length_struct={"tokens": 16}, num_packing_bins=2,
                                              columns=Columns(labels=["labels"])))
    src = SequentialIterDataset(sft_source(values, offsets, labels, mask))
    rows = list(datasets.BestFitPackIterDataset(src, length_struct={"tokens": 16, "labels": 16},
                                                num_packing_bins=2))  # as Grain packs them
    assert min(int(r["labels"].min()) for r in rows) == -100
    with pytest.raises(ValueError, match="the column must not be one"):
        datasets.FirstFitPackIterDataset(src, length_struct={"tokens": 16, "labels": 16},
                                         num_packing_bins=2, columns=Columns(labels=["labels"]))


def _parquet(path, lengths, *, with_labels=True):
    import pyarrow as pa
    import pyarrow.parquet as pq

    values, offsets, labels, _ = sft_corpus(lengths, 4)
    cols = {"tokens": pa.array([values[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])],
                               type=pa.list_(pa.int32()))}
    if with_labels:
        cols["labels"] = pa.array([labels[a:b].tolist() for a, b in zip(offsets[:-1],
                                                                         offsets[1:])],
                                  type=pa.list_(pa.int64()))
    pq.write_table(pa.table(cols), path, row_group_size=50)
    return values, offsets, labels


def test_training_pipeline_packs_labels_and_refuses_to_drop_them(tmp_path):
    lengths = random_lengths(np.random.default_rng(3), 120, high=60)
    values, offsets, labels = _parquet(tmp_path / "sft.parquet", lengths)
    src = datasets.ParquetSource(tmp_path / "sft.parquet", extra_columns=["labels"])
    kw = dict(pack=PackConfig(64), shuffle_seed=0, num_epochs=1,
              batch=Batching(4, drop_remainder=False, shard_index=0, shard_count=1))
    with pytest.raises(InputError, match=r"holds \['labels'\], which would not reach the rows"):
        next(iter(datasets.make_training_pipeline(src, **kw)))
    batches = list(datasets.make_training_pipeline(src, columns=Columns(labels={"labels": -100}),
                                                   **kw))
    rows = [{k: v[i] for k, v in b.items()} for b in batches for i in range(len(b["tokens"]))]
    check_columns(rows, values, {"labels": labels}, {"labels": -100})
    assert sorted(int(e) for r in rows for e in r["segment_source_index"] if e >= 0) \
        == list(range(120))
    assert all(b["loss_tokens"].dtype == np.int32 and b["loss_tokens"].shape == (4,)
               for b in batches[:-1])
    dropped = list(datasets.make_training_pipeline(src, columns=Columns(drop=["labels"]), **kw))
    assert "labels" not in dropped[0] and "loss_tokens" in dropped[0]


def test_grain_drops_what_the_dropins_drop():
    """The drop-ins keep Grain's contract for keys outside length_struct (left out), so they
    stay drop-ins; the columns arguments are how labels get in."""
    ds, _ = _grain_columns(5, n=20)
    row = next(iter(datasets.FirstFitPackIterDataset(ds, length_struct={"tokens": 64},
                                                     num_packing_bins=2)))
    theirs = next(iter(ge.FirstFitPackIterDataset(ds, length_struct={"tokens": 64},
                                                  num_packing_bins=2)))
    assert set(theirs) <= set(row) and "labels" not in row and "ignored" not in row


def test_columns_ride_on_the_feature_named_with_several_packed_features():
    rng = np.random.default_rng(6)
    li, lt = random_lengths(rng, 60, high=20), random_lengths(rng, 60, high=10)
    vi, oi, _, _ = sft_corpus(li)
    vt, ot, labels, _ = sft_corpus(lt, seed=2)
    src = ArraySource({"inputs": (vi, oi), "targets": (vt, ot), "labels": (labels, ot)},
                      value_columns=["labels"])
    rows = list(PackIterDataset(SequentialIterDataset(src),
                                [PackConfig(32, feature="inputs"),
                                 PackConfig(16, feature="targets")],
                                window=Window(8),
                                columns=Columns(labels={"labels": ("targets", -7)})))
    for row in rows:
        real = row["targets_segment_ids"] > 0
        assert (row["labels"][~real] == -7).all() and row["labels"].shape == (16,)
        for j in np.flatnonzero(row["targets_segment_lengths"]):
            o, m = row["targets_segment_offsets"][j], row["targets_segment_lengths"][j]
            a = int(row["targets"][o]) - 1
            np.testing.assert_array_equal(row["labels"][o : o + m], labels[a : a + m])
    assert sum(int(r["targets_segment_lengths"].sum()) for r in rows) == lt.sum()


def test_columns_are_checked_and_name_the_field():
    from seqpack.pipelines.datasets.columns import Column, Role

    with pytest.raises(ValueError, match="labels='labels' must be a list of names or a dict"):
        Columns(labels="labels")
    with pytest.raises(ValueError, match=r"masks\['mask'\]: pad='x' must be an int"):
        Columns(masks={"mask": "x"})
    with pytest.raises(ValueError, match=r"labels\['labels'\]: pad=True must be an int"):
        Columns(labels={"labels": ("tokens", True)})
    with pytest.raises(ValueError, match="drop='labels' must be a list of names"):
        Columns(drop="labels")
    with pytest.raises(ValueError, match="next_token_loss=1 must be a bool"):
        Columns(next_token_loss=1)
    with pytest.raises(ValueError, match=r"column 'x' is given twice \(labels and masks\)"):
        Columns(labels=["x"], masks={"x": 0})
    spec = {"mask": 3}
    c = Columns(labels=["labels"], masks=spec, meta={"w": "inputs"}, drop=["id"])
    spec["other"] = 0  # a Columns keeps its own copy
    assert c.names() == ("labels", "mask", "w") and c.explicit_pads() == {"mask"}
    assert c.drop == ("id",) and c.labels == ("labels",) and c.masks == {"mask": 3}
    assert c.of(("tokens", "inputs")) == (Column("labels", "tokens", -100, Role.LABELS),
                                         Column("mask", "tokens", 3, Role.MASK),
                                         Column("w", "inputs", 0, Role.VALUES))
    with pytest.raises(ValueError, match=r"Columns.meta: column 'w' -> feature 'inputs': the "
                                         "feature must be a packed feature"):
        c.of(("tokens",))


def test_dropins_refuse_what_grain_decides():
    ds, _ = _grain_columns(7, n=10)
    kw = dict(length_struct={"tokens": 64}, num_packing_bins=2)
    with pytest.raises(ValueError, match=r"Columns\(meta=\('mask',\)\): the drop-ins pack other "
                                         "per-token values as Grain does"):
        datasets.FirstFitPackIterDataset(ds, columns=Columns(meta=["mask"]), **kw)
    with pytest.raises(ValueError, match=r"Columns\(drop=\('ignored',\)\): the drop-ins leave "
                                         "out every key outside length_struct"):
        datasets.BestFitPackIterDataset(ds, columns=Columns(drop=["ignored"]), **kw)
    with pytest.raises(ValueError, match=r"columns=\['labels'\] must be a Columns"):
        datasets.BestFitPackIterDataset(ds, columns=["labels"], **kw)
