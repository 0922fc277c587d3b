"""HF `datasets` as input: `save_to_disk` directories and `.arrow` files (the IPC stream HF
writes, and the IPC file format), told by their content too, with several columns, locally and
on object storage; and `--format` outputs written to object storage."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pytest

from seqpack.pipelines.errors import InputError
from seqpack.pipelines.formats.inputs import ReadOptions, expand_inputs, read_corpus
from seqpack.pipelines.offline.verify import verify
from tests.helpers.cloud import gcs, gcs_server, s3, s3_server  # noqa: F401
from tests.helpers.files import invoke
from tests.helpers.formats import write_sft

OPTIONS = ReadOptions(column="input_ids", extra_columns=("labels", "completion_mask"))


def sft_table(tmp_path, seed: int, n: int) -> pa.Table:
    """n SFT examples (`tests.helpers.formats.write_sft`) as an Arrow table."""
    import pyarrow.parquet as pq

    return pq.read_table(write_sft(tmp_path / f"sft{seed}.parquet", np.random.default_rng(seed),
                                   n))


def write_ipc(path, table: pa.Table, *, stream: bool, batch_rows: int = 7) -> str:
    with pa.OSFile(str(path), "wb") as sink:
        new = pa.ipc.new_stream if stream else pa.ipc.new_file
        with new(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=batch_rows):
                writer.write_batch(batch)
    return str(path)


def save_to_disk(path, table: pa.Table, shards: int = 2) -> str:
    """A directory as HF datasets' `Dataset.save_to_disk` writes it."""
    datasets = pytest.importorskip("datasets")
    datasets.Dataset(table).save_to_disk(str(path), num_shards=shards)
    return str(path)


def corpus_rows(table: pa.Table) -> list[list[int]]:
    return table.column("input_ids").to_pylist()


def test_save_to_disk_reads_as_its_shards_in_order(tmp_path):
    table = sft_table(tmp_path, 0, 50)
    d = save_to_disk(tmp_path / "ds", table, shards=3)
    files = expand_inputs([d])
    state = json.loads(open(os.path.join(d, "state.json")).read())
    assert files == [os.path.join(d, f["filename"]) for f in state["_data_files"]]
    corpus = read_corpus(files, OPTIONS)
    want = corpus_rows(table)
    assert np.diff(corpus.offsets).tolist() == [len(x) for x in want]
    assert corpus.values.tolist() == sum(want, [])
    assert corpus.extra_values["labels"].tolist() == sum(table.column("labels").to_pylist(), [])
    assert [f["format"] for f in corpus.files] == ["arrow"] * 3


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("name", ["x.arrow", "noext"])
def test_arrow_files_by_name_or_content(tmp_path, stream, name):
    table = sft_table(tmp_path, 1, 30)
    path = write_ipc(tmp_path / name, table, stream=stream)
    corpus = read_corpus([path], OPTIONS)
    assert corpus.values.tolist() == sum(corpus_rows(table), [])
    assert corpus.files[0]["format"] == "arrow"


def test_a_dataset_dict_names_its_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    table = sft_table(tmp_path, 2, 10)
    datasets.DatasetDict({"train": datasets.Dataset(table),
                          "test": datasets.Dataset(table)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(InputError, match=r"HF DatasetDict \(splits \['train', 'test'\]\).*"
                                         r"dd/train"):
        expand_inputs([str(tmp_path / "dd")])


def test_bad_arrow_records_are_named(tmp_path):
    ids = pa.array([[1, 2], None, [3]], pa.list_(pa.int32()))
    path = write_ipc(tmp_path / "bad.arrow", pa.table({"input_ids": ids}), stream=True)
    with pytest.raises(InputError, match=r"bad.arrow record 1: column 'input_ids' is null"):
        read_corpus([path], ReadOptions(column="input_ids"))
    with pytest.raises(InputError, match=r"bad.arrow: column 'tokens' is missing"):
        read_corpus([path], ReadOptions())
    (tmp_path / "cut.arrow").write_bytes(open(path, "rb").read()[:40])
    with pytest.raises(InputError, match="cut.arrow"):
        read_corpus([str(tmp_path / "cut.arrow")], ReadOptions(column="input_ids"))


def test_pack_a_save_to_disk_dataset_from_the_cli(tmp_path):
    table = sft_table(tmp_path, 3, 40)
    d = save_to_disk(tmp_path / "ds", table)
    out = tmp_path / "out"
    invoke("pack", d, "-o", out, "--column", "input_ids", "--column", "labels", "--seq-len", 64,
           "--overflow", "split", "--format", "hf")
    assert verify(str(out)).ok


@pytest.fixture(params=["gs", "s3"])
def store(request):
    return request.getfixturevalue("gcs" if request.param == "gs" else "s3")


@pytest.mark.slow
def test_a_remote_dataset_packed_to_a_remote_output(store, tmp_path):
    """A save_to_disk directory on object storage, packed as Parquet onto object storage: the
    bytes of the local run, verified, read by the Grain source and read back by pyarrow."""
    from seqpack.pipelines.datasets import PackedSource

    table = sft_table(tmp_path, 4, 60)
    d = save_to_disk(tmp_path / "ds", table)
    base = store.upload(d, store.url("ds")) + "/"
    args = ["--column", "input_ids", "--column", "labels", "--seq-len", 48, "--overflow",
            "split", "--format", "parquet", "--shard-rows", 4, "--workers", 1]
    invoke("pack", d, "-o", tmp_path / "local", *args)
    invoke("pack", base, "-o", store.url("out/"), *args)
    assert verify(store.url("out/")).ok
    local = tmp_path / "local"
    fetched = tmp_path / "fetched"
    fetched.mkdir()
    for name in sorted(os.listdir(local)):
        if name != "manifest.json":  # its inputs' paths differ
            store.fs.get_file(store.url(f"out/{name}").split("://", 1)[1], str(fetched / name))
            assert (fetched / name).read_bytes() == (local / name).read_bytes(), name
    rows = PackedSource(store.url("out/"), cache_dir=tmp_path / "cache")
    assert len(rows) == json.loads((local / "manifest.json").read_text())["num_rows"]
    assert rows[len(rows) - 1]["input_ids"].shape == (48,)
    shutil.rmtree(tmp_path / "cache")
