"""Pipelines: an already-packed parent is refused (PackIterDataset, the drop-ins);
`make_training_pipeline` packs the feature its pack config names (an element without it is an
error naming the fix) and shuts down cleanly."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import grain
import numpy as np
import pytest

from seqpack.packer import PackConfig
from seqpack.pipelines import datasets
from seqpack.pipelines.errors import InputError
from tests.helpers.files import ROOT, random_seqs, write_parquet

PACKERS = {
    "PackIterDataset": lambda ds: datasets.PackIterDataset(ds, PackConfig(16, max_segments=8)),
    "FirstFit": lambda ds: datasets.FirstFitPackIterDataset(
        ds, length_struct={"tokens": 16}, num_packing_bins=4),
    "BestFit": lambda ds: datasets.BestFitPackIterDataset(
        ds, length_struct={"tokens": 16}, num_packing_bins=4),
    "grain FirstFit": lambda ds: grain.experimental.FirstFitPackIterDataset(
        ds, length_struct={"tokens": 16}, num_packing_bins=4),
}


def _examples():
    src = [{"tokens": np.arange(i % 7 + 1, dtype=np.int32)} for i in range(40)]
    return grain.MapDataset.source(src).to_iter_dataset()


@pytest.mark.parametrize("first", list(PACKERS))
@pytest.mark.parametrize("second", ["PackIterDataset", "FirstFit", "BestFit"])
def test_packing_a_packed_parent_is_refused(first, second):
    once = list(PACKERS[second](_examples()))
    assert max(int(r["tokens_segment_ids"].max()) for r in once) > 1  # real packing
    with pytest.raises(InputError, match="element 0 of the parent is already packed \\(it has "
                                         "'tokens_segment_ids'\\); pack once"):
        next(iter(PACKERS[second](PACKERS[first](_examples()))))


def _single_column_parquet(path, column):
    import pyarrow as pa
    import pyarrow.parquet as pq

    seqs = random_seqs(120, max_len=30, seed=4)
    pq.write_table(pa.table({column: pa.array(seqs, type=pa.list_(pa.int32()))}), path)
    return path, seqs


def test_training_pipeline_packs_the_feature_its_pack_config_names(tmp_path):
    path, seqs = _single_column_parquet(tmp_path / "ids.parquet", "input_ids")
    kw = dict(shuffle_seed=0, num_epochs=1,
              batch=datasets.Batching(4, drop_remainder=False, shard_index=0, shard_count=1))
    with pytest.raises(InputError, match=r"element 0 of the source lacks the packed feature "
                                         r"'tokens' \(its keys: \['input_ids'\]\); name the key "
                                         r"of the token ids in the pack config: "
                                         r"PackConfig\(\.\.\., feature='input_ids'\)"):
        datasets.make_training_pipeline(datasets.ParquetSource(path, column="input_ids"),
                                        pack=PackConfig(32), **kw)
    ds = datasets.make_training_pipeline(
        datasets.ParquetSource(path, column="input_ids"),
        pack=PackConfig(32, feature="input_ids"), **kw)
    batches = list(ds)
    assert {"input_ids", "input_ids_segment_lengths", "input_ids_segment_ids"} <= set(batches[0])
    got = sum(int(b["input_ids_segment_lengths"].sum()) for b in batches)
    assert got == sum(map(len, seqs))
    # Several columns and none named "tokens": the error says which feature to name.
    write_parquet(tmp_path / "two.parquet", seqs, column="input_ids")
    with pytest.raises(InputError, match=r"lacks the packed feature 'tokens' \(its keys: "
                                         r"\['id', 'input_ids'\]\); .*feature='input_ids'"):
        next(iter(datasets.make_training_pipeline(
            datasets.ParquetSource(tmp_path / "two.parquet", column="input_ids",
                                   extra_columns=["id"]),
            pack=PackConfig(32), **kw)))
    # The element's other keys are columns or dropped on purpose, as ever.
    with pytest.raises(InputError, match=r"element 0 of the parent holds \['id'\], which would "
                                         "not reach the rows"):
        next(iter(datasets.make_training_pipeline(
            datasets.ParquetSource(tmp_path / "two.parquet", column="input_ids",
                                   extra_columns=["id"]),
            pack=PackConfig(32, feature="input_ids"), **kw)))


_SCRIPT = """
import sys
from seqpack.packer import PackConfig
from seqpack.pipelines.datasets import Batching, ParquetSource, Prefetch, make_training_pipeline
if __name__ == "__main__":
    it = iter(make_training_pipeline(ParquetSource(sys.argv[1], column="input_ids"),
                                     pack=PackConfig(32, feature="input_ids"),
                                     batch=Batching(4, shard_index=0, shard_count=1),
                                     shuffle_seed=0, num_epochs=None,
                                     prefetch=Prefetch(worker_count=int(sys.argv[2]))))
    batch = next(it)           # a global holds the iterator (and the batch) at exit
    print(batch["input_ids"].shape)
"""


def _run_script(tmp_path, workers):
    path, _ = _single_column_parquet(tmp_path / "ids.parquet", "input_ids")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    return subprocess.run([sys.executable, str(script), str(path), str(workers)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_training_pipeline_exits_cleanly(tmp_path):
    # Before: "Exception ignored in: <function DatasetIterator.__del__ ...>" and a traceback.
    done = _run_script(tmp_path, 0)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(4, 32)"
    assert done.stderr == ""


@pytest.mark.slow
def test_training_pipeline_with_workers_exits_cleanly(tmp_path):
    done = _run_script(tmp_path, 1)
    assert done.returncode == 0, done.stderr
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr
