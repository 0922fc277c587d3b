"""The Grain reader of packed rows refuses what `seqpack pack` did not finish or what is not
consistent: no manifest (an interrupted run), a shard listed twice, a shard that is not the
manifest's (record count, not ArrayRecord), a corrupt record (InputError naming shard + record)."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from seqpack.pipelines.datasets import ArrayRecordSource, PackedArrayRecordSource
from seqpack.pipelines.errors import InputError
from seqpack.pipelines.formats.manifest import INTENT, MANIFEST, signed
from tests.helpers.files import invoke, random_seqs, write_jsonl


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("packed")
    src = write_jsonl(tmp / "in.jsonl", random_seqs(300, max_len=60, seed=3))
    invoke("pack", src, "-o", tmp / "out", "--seq-len", "64", "--shard-rows", "100")
    return tmp / "out"


def _copy(packed, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name in os.listdir(packed):
        (out / name).write_bytes((packed / name).read_bytes())
    return out


def _shards(out):
    return sorted(n for n in os.listdir(out) if n.endswith(".arrayrecord"))


def test_an_interrupted_output_is_refused_with_the_clis_message(packed, tmp_path):
    out = _copy(packed, tmp_path)
    manifest = json.loads((out / MANIFEST).read_text())
    (out / MANIFEST).unlink()
    # What the CLI says for the same directory (stats reads the manifest the same way).
    cli = invoke("stats", out, ok=False)
    assert cli.exit_code == 2
    message = cli.output.strip().removeprefix("Error: ")
    for make in (PackedArrayRecordSource, ArrayRecordSource):
        if make is ArrayRecordSource:  # raw records: refused only with a pack's intent file
            for k in ("shard_num_rows", "stats", "example_length_histogram"):
                manifest.pop(k)
            (out / INTENT).write_text(json.dumps(manifest))
        with pytest.raises(InputError, match=re.escape(message)):
            make(out)
    assert "--resume" in message


def test_a_shard_listed_twice_is_refused(packed, tmp_path):
    out = _copy(packed, tmp_path)
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["shards"][1] = manifest["shards"][0]
    manifest["shard_num_rows"][1] = manifest["shard_num_rows"][0]
    (out / MANIFEST).write_text(json.dumps(signed(manifest)))
    with pytest.raises(InputError, match=f"shard '{manifest['shards'][0]}' is listed twice"):
        PackedArrayRecordSource(out)


def test_a_corrupt_record_names_shard_and_record(packed, tmp_path):
    out = _copy(packed, tmp_path)
    shard = out / _shards(out)[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    src = PackedArrayRecordSource(out)
    with pytest.raises(InputError, match=rf"{shard}: corrupt shard, cannot read record (\d+)"):
        for i in range(len(src)):
            src[i]
    assert src[0]["tokens"].shape == (64,)  # records before the damage still read


@pytest.mark.parametrize("content, error", [
    (b"", r"0 bytes, the manifest says \d+; the shard is damaged or replaced"),
    (os.urandom(70000), r"70000 bytes, the manifest says \d+; the shard is damaged or replaced"),
])
def test_a_shard_that_is_not_the_manifests_is_refused(packed, tmp_path, content, error):
    out = _copy(packed, tmp_path)
    shard = out / _shards(out)[0]
    shard.write_bytes(content)  # before: read as 0 records, i.e. rows silently missing
    with pytest.raises(InputError, match=f"{shard}: {error}"):
        PackedArrayRecordSource(out)


def test_the_intact_output_reads_every_row(packed):
    src = PackedArrayRecordSource(packed)
    manifest = json.loads((packed / MANIFEST).read_text())
    assert len(src) == manifest["num_rows"]
    assert np.all(src[len(src) - 1]["tokens_segment_lengths"] >= 0)
