"""Every `--format` is one encoding of the same rows: the same plan, order and stats; the local
runner's bytes from the Beam steps; verify proves each lossless and refuses an edited shard;
resume finishes each; inspect, stats and the Grain source read each. Consumers' own readers
check the files in tests/test_formats_consumers.py."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.packer import pack_ragged
from seqpack.packer.contract import restore_derived
from seqpack.pipelines.formats import encodings
from seqpack.pipelines.formats.encodings import Layout
from seqpack.pipelines.formats.manifest import file_digest, signed
from seqpack.pipelines.offline import steps as beam_steps
from seqpack.pipelines.offline.runners import pack_to_dir
from seqpack.pipelines.offline.shards import read_shard
from seqpack.pipelines.offline.verify import read_row, verify
from tests.helpers.files import dir_bytes, invoke, write_jsonl
from tests.helpers.formats import COLUMNS, CONFIG, job, write_sft
from tests.helpers.pipelines import check_restore_every_step, stack

FORMATS = encodings.FORMATS
# the formats that store the tokens (index stores references: tests/test_index_format.py)
TOKEN_FORMATS = [f for f in FORMATS if not encodings.encoding(f).by_reference]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """Two SFT inputs packed once in every format: {format: output directory}, and the inputs."""
    tmp = tmp_path_factory.mktemp("formats")
    rng = np.random.default_rng(0)
    paths = [write_sft(tmp / f"in{i}.parquet", rng, 40) for i in range(2)]
    outs = {fmt: str(tmp / fmt) for fmt in FORMATS}
    for fmt, out in outs.items():
        pack_to_dir(job(paths, out, fmt, workers=1))
    return outs, paths


def manifest_of(out) -> dict:
    with open(f"{out}/manifest.json") as f:
        return json.load(f)


def rows_of(out: str) -> dict[str, np.ndarray]:
    """Every row of an output, as `read_shard` reads them back."""
    parts = [read_shard(out, name) for name in manifest_of(out)["shards"]]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def next_token_loss(rows) -> np.ndarray:
    """bool[R, L], segment by segment as Megatron-Bridge's `fill_packing_strategy` builds its
    loss mask: the example's per-token mask shifted one left, False on its last token."""
    k = CONFIG.keys()
    mask = (rows["labels"] != -100) & (rows["completion_mask"] != 0)
    out = np.zeros(mask.shape, bool)
    for r, s in zip(*np.nonzero(rows[k.segment_lengths])):
        a, n = rows[k.segment_offsets][r, s], rows[k.segment_lengths][r, s]
        out[r, a : a + n] = [*mask[r, a + 1 : a + n], False]
    return out


def test_every_format_holds_the_same_rows(packed):
    outs, _ = packed
    base = rows_of(outs["arrayrecord"])
    k = CONFIG.keys()
    contract = [*k.roles().values()]
    manifests = {f: manifest_of(o) for f, o in outs.items()}
    for fmt, out in outs.items():
        rows, m = rows_of(out), manifests[fmt]
        for key in contract:
            np.testing.assert_array_equal(rows[key], base[key], err_msg=f"{fmt} {key}")
        assert m["stats"] == manifests["arrayrecord"]["stats"], fmt
        assert m["shapes"] == manifests["arrayrecord"]["shapes"], fmt
        assert m.get("encoding") == (None if fmt == "arrayrecord" else fmt)
        assert all(n.endswith(encodings.encoding(fmt).suffix) for n in m["shards"])
    seg = base[k.segment_ids] > 0
    allowed = seg & (base["labels"] != -100) & (base["completion_mask"] != 0)
    hf, mega, table = rows_of(outs["hf"]), rows_of(outs["megatron"]), rows_of(outs["parquet"])
    np.testing.assert_array_equal(hf["labels"], np.where(allowed, base["labels"], -100))
    np.testing.assert_array_equal(hf["position_ids"], base[k.positions])
    np.testing.assert_array_equal(hf["completion_mask"], base["completion_mask"])
    np.testing.assert_array_equal(mega["loss_mask"], next_token_loss(base))
    for name in COLUMNS:
        np.testing.assert_array_equal(table[name], base[name])
    assert manifests["megatron"]["shapes"]["loss_tokens"] == int(mega["loss_mask"].sum())


def test_shapes_are_the_rows(packed):
    outs, _ = packed
    rows = rows_of(outs["arrayrecord"])
    k = CONFIG.keys()
    lengths = rows[k.segment_lengths]
    nseg, used = (lengths > 0).sum(1), lengths.sum(1)
    shapes = manifest_of(outs["arrayrecord"])["shapes"]
    assert shapes == {"max_row_segments": int(nseg.max()), "longest_segment": int(lengths.max()),
                      "shortest_row": int(used.min()),
                      "min_row_next_tokens": int((used - nseg).min()),
                      "loss_tokens": int(next_token_loss(rows).sum())}


@pytest.mark.parametrize("fmt", FORMATS)
def test_verify_proves_every_format(packed, fmt):
    out = packed[0][fmt]
    report = verify(out)
    assert report.ok, report.violations
    assert report.tokens_checked == manifest_of(out)["inputs"]["num_tokens"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_beam_steps_write_the_local_bytes(tmp_path, packed, fmt):
    paths = packed[1]
    pack_to_dir(job(paths, tmp_path / "local", fmt, block_size=23, workers=1))
    steps_job = job(paths, tmp_path / "steps", fmt, block_size=23)
    scans = [beam_steps.scan_file(i, p, steps_job.read_options) for i, p in enumerate(paths)]
    summary, jobs = beam_steps.plan_in_process(scans, steps_job)
    assert summary is not None
    by_shard: dict[int, list] = {}
    for file_job in jobs[::-1]:
        for shard, part in beam_steps.route_file(file_job, steps_job.read_options,
                                                 summary.shard_rows, summary.row_dtype,
                                                 plan_only=steps_job.plan_only):
            by_shard.setdefault(shard, []).append(part)
    written = [(s, *beam_steps.write_shard_parts(s, parts[::-1], summary, steps_job.output,
                                                  CONFIG, write_options=steps_job.write_options))
               for s, parts in sorted(by_shard.items(), reverse=True)]
    beam_steps.finish_job(written, summary, steps_job.output)
    assert dir_bytes(tmp_path / "steps") == dir_bytes(tmp_path / "local")


def rewrite(out, name: str, rows: dict[str, np.ndarray], fmt: str) -> None:
    """Writes `rows` as shard `name` in its format and re-signs the manifest: a damage the
    digests cannot show, only the rows."""
    manifest = json.loads((out / "manifest.json").read_text())
    encoding = encodings.encoding(fmt)
    layout = Layout(CONFIG, tuple(manifest["columns"]))
    encoding.write(str(out / name), rows, layout)
    i = manifest["shards"].index(name)
    manifest["shard_bytes"][i], manifest["shard_sha256"][i] = file_digest(str(out / name))
    (out / "manifest.json").write_text(json.dumps(signed(manifest)))


@pytest.mark.parametrize("fmt,edit", [(f, "bytes") for f in FORMATS] + [
    (f, e) for f in TOKEN_FORMATS for e in ("token", "labels")])
def test_verify_refuses_an_edited_shard(tmp_path, packed, fmt, edit):
    out = tmp_path / fmt
    shutil.copytree(packed[0][fmt], out)
    name = json.loads((out / "manifest.json").read_text())["shards"][1]
    if edit == "bytes":
        data = bytearray((out / name).read_bytes())
        data[len(data) // 2] ^= 0x40
        (out / name).write_bytes(bytes(data))
        want = "size or sha256 differs"
    else:
        rows = {k: v.copy() for k, v in read_shard(str(out), name).items()}
        rows.update(read_shard(packed[0]["parquet"], name.replace(".idx.", ".").replace(
            ".arrayrecord", ".parquet")))  # every column, as the writer has them
        rows = {k: v.copy() for k, v in rows.items()}
        k = CONFIG.keys()
        if edit == "token":
            rows[k.values][0, 1] += 1
            want = "input_ids"
        else:  # a label the run trains on, then none: each format shows it its own way
            r, j = np.argwhere((rows["labels"] != -100) & (rows["completion_mask"] != 0)
                               & (rows[k.positions] > 0))[0]
            rows["labels"][r, j] = -100
            want = {"arrayrecord": "labels", "parquet": "labels", "hf": "labels",
                    "megatron": "loss_mask"}[fmt]
        rewrite(out, name, rows, fmt)
    report = verify(str(out))
    assert not report.ok
    assert any(name in v and want in v for v in report.violations), report.violations


@pytest.mark.parametrize("fmt", ["parquet", "megatron"])
def test_an_interrupted_run_resumes_to_the_same_bytes(tmp_path, packed, monkeypatch, fmt):
    paths, outs = packed[1], packed[0]
    encoding = encodings.encoding(fmt)
    real, calls = encoding.write, []

    def failing(path, batch, layout):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(path, batch, layout)

    monkeypatch.setattr(encoding, "write", failing)
    out = tmp_path / "out"
    with pytest.raises(Exception, match="No space left"):
        pack_to_dir(job(paths, out, fmt, workers=1))
    assert not (out / "manifest.json").exists()
    monkeypatch.setattr(encoding, "write", real)
    pack_to_dir(job(paths, out, fmt, workers=1, existing="resume"))
    assert dir_bytes(out) == dir_bytes(outs[fmt])  # kept shards' loss tokens read back


def test_unpadded_formats_refuse_aligned_segments(tmp_path, packed):
    result = invoke("pack", packed[1][0], "-o", tmp_path / "x", "--column", "input_ids",
                    "--format", "hf", "--segment-alignment", 4, ok=False)
    assert result.exit_code == 2
    assert "--format hf writes unpadded rows" in result.output
    assert "--segment-alignment 4" in result.output and not (tmp_path / "x").exists()
    for fmt in ("hf", "megatron"):  # context parallelism pads each segment to 2C
        result = invoke("pack", packed[1][0], "-o", tmp_path / "y", "--column", "input_ids",
                        "--format", fmt, "--context-parallel", 2, ok=False)
        assert result.exit_code == 2 and f"--format {fmt} writes unpadded rows" in result.output
        assert "--context-parallel 2" in result.output and not (tmp_path / "y").exists()


@pytest.mark.parametrize("fmt", FORMATS)
def test_inspect_and_stats_read_every_format(packed, fmt):
    out = packed[0][fmt]
    shown = invoke("inspect", out, "--row", -1, "--count", 8).output
    assert "input_ids_segment_lengths" in shown and "input_ids_positions" in shown
    assert {"hf": "position_ids", "megatron": "loss_mask"}.get(fmt, "labels") in shown
    row = json.loads(invoke("inspect", out, "--row", 3, "--json").output)
    base = json.loads(invoke("inspect", packed[0]["arrayrecord"], "--row", 3, "--json").output)
    assert row["input_ids"] == base["input_ids"]
    stats = invoke("stats", out).output
    assert "efficiency" in stats and f"format {fmt}" in stats.splitlines()[0]
    with open(os.path.join(out, "manifest.json")) as f:
        shapes = json.load(f)
    shown_shapes = stats.splitlines()[-1]
    assert shown_shapes.startswith("static shapes") and all(
        f"{k.replace('_', ' ')} {v:,}" in shown_shapes for k, v in shapes["shapes"].items())
    assert json.loads(invoke("stats", out, "--json").output)["shapes"] == shapes["shapes"]


def test_the_grain_source_reads_parquet_rows_with_exact_resume(packed):
    from seqpack.pipelines.datasets import PackedSource, make_training_pipeline

    table, base = PackedSource(packed[0]["parquet"]), PackedSource(packed[0]["arrayrecord"])
    assert len(table) == len(base)
    for i in range(len(base)):
        got, want = table[i], base[i]
        assert sorted(got) == sorted(want)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
    make = lambda: iter(make_training_pipeline(table, batch=3, shuffle_seed=1, num_epochs=2))
    check_restore_every_step(make, max_rows=12)



def test_every_format_trains_with_the_same_loss_tokens(packed):
    """The training pipeline counts the same loss tokens from every format's rows; Megatron's
    rows hold only the shifted loss_mask: refused by name unless the caller says to count it."""
    from seqpack.pipelines.datasets import Columns, PackedSource, make_training_pipeline

    def counts(fmt, **kw):
        ds = make_training_pipeline(PackedSource(packed[0][fmt]), batch=2, shuffle_seed=0,
                                    num_epochs=1, **kw)
        return np.concatenate([b["loss_tokens"] for b in ds])

    want = counts("arrayrecord")
    assert want.sum() > 0
    for fmt in TOKEN_FORMATS:
        if fmt != "megatron":
            np.testing.assert_array_equal(counts(fmt), want, err_msg=fmt)
    with pytest.raises(ValueError, match=r"\(megatron format\).*'labels'.*loss_mask"):
        counts("megatron")
    got = counts("megatron", columns=Columns(masks=["loss_mask"], next_token_loss=False))
    np.testing.assert_array_equal(got, want)

LAYOUT = Layout(CONFIG, ({"name": "labels", "source": "labels", "dtype": "<i4", "pad": -100,
                          "role": "labels"},
                         {"name": "completion_mask", "source": "completion_mask",
                          "dtype": "<i4", "pad": 0, "role": "mask"},
                         {"name": "weights", "source": "weights", "dtype": "<i2", "pad": 0,
                          "role": "values"}))


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(0, 60), min_size=1, max_size=30).filter(any),
       seed=st.integers(0, 99),
       fmt=st.sampled_from(TOKEN_FORMATS))
def test_each_encoding_reads_back_what_it_wrote(tmp_path_factory, lengths, seed, fmt):
    """Any rows (a shard holds one at least): `read(write(rows))` gives the contract keys,
    the verbatim columns and the derived ones back, and its loss mask is the writer's."""
    rng = np.random.default_rng(seed)
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    batch = pack_ragged(rng.integers(0, 70_000, offsets[-1]).astype(np.int32), offsets, CONFIG)
    seg = batch[CONFIG.keys().segment_ids] > 0
    batch["labels"] = np.where(seg & (rng.random(seg.shape) < 0.7),
                               batch["input_ids"], -100).astype(np.int32)
    batch["completion_mask"] = (seg & (rng.random(seg.shape) < 0.8)).astype(np.int32)
    batch["weights"] = np.where(seg, rng.integers(-5, 5, seg.shape), 0).astype(np.int16)
    encoding = encodings.encoding(fmt)
    path = str(tmp_path_factory.mktemp("enc") / f"s{encoding.suffix}")
    stored = batch if encoding.wants_derived(LAYOUT) else {
        k: v for k, v in batch.items() if k not in CONFIG.keys().derived}
    encoding.write(path, stored, LAYOUT)
    got = restore_derived(encoding.read(path, LAYOUT, num_rows=seg.shape[0]))
    for key in [*CONFIG.keys().roles().values(), *encoding.verbatim(LAYOUT)]:
        np.testing.assert_array_equal(got[key], batch[key], err_msg=key)
    for key, want in encoding.derived(batch, LAYOUT).items():
        np.testing.assert_array_equal(got[key], want, err_msg=key)
    loss = encodings.loss_positions(batch, LAYOUT)
    np.testing.assert_array_equal(encoding.loss_mask(got, LAYOUT), loss)
    reader = encoding.reader(path, LAYOUT)
    j = int(rng.integers(0, seg.shape[0]))
    one = restore_derived(reader.row(j))
    reader.close()
    assert all(np.array_equal(one[key], got[key][j]) for key in one)
    assert stack([one])[CONFIG.feature].shape == (1, CONFIG.seq_len)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["parquet", "megatron", "index"])
def test_two_workers_and_the_beam_job_write_the_same_bytes(tmp_path, packed, fmt):
    from seqpack.pipelines.offline.runners import pack_beam

    paths, want = packed[1], dir_bytes(packed[0][fmt])
    pack_to_dir(job(paths, tmp_path / "two", fmt, workers=2))
    assert dir_bytes(tmp_path / "two") == want
    pack_beam(job(paths, tmp_path / "beam", fmt, workers=2), quiet=True)
    assert dir_bytes(tmp_path / "beam") == want
    assert verify(str(tmp_path / "beam"), workers=2).ok


def test_an_id_the_format_cannot_store_is_refused_before_anything_is_written(tmp_path):
    """Megatron-Bridge's input_ids are int32: an input id past it is named by file and
    example when the inputs are read, with no output left (the other formats store it)."""
    path = write_jsonl(tmp_path / "big.jsonl", [[1, 2], [3], [4, 2**40, 5], [6, 2**33]])
    result = invoke("pack", path, "-o", tmp_path / "meg", "--seq-len", 8, "--format",
                    "megatron", ok=False)
    assert result.exit_code == 2, result.output
    assert f"{path}: example 2 (counting from 0) holds token id {2**40}, more than the megatron " \
        "format stores (2147483647)" in result.output
    assert not (tmp_path / "meg").exists()
    invoke("pack", path, "-o", tmp_path / "pq", "--seq-len", 8, "--format", "parquet")
    assert verify(str(tmp_path / "pq")).ok


def test_a_pad_the_format_cannot_store_is_refused_before_anything_is_written(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [[1, 2], [3]])
    result = invoke("pack", path, "-o", tmp_path / "meg", "--seq-len", 8, "--format",
                    "megatron", "--pad-id", 2**31, ok=False)
    # Before: refused while a shard was written, naming its temporary file as holding a
    # "token id", and leaving an intent that only --overwrite cleared.
    assert result.exit_code == 2, result.output
    assert f"--pad-id {2**31} is more than the megatron format stores (2147483647): pass a " \
        "smaller one" in result.output
    assert not (tmp_path / "meg").exists()
    for fmt in ("parquet", "arrayrecord"):  # other formats widen the rows (before: float64)
        invoke("pack", path, "-o", tmp_path / fmt, "--seq-len", 8, "--format", fmt,
               "--pad-id", 5 * 10**9)
        assert verify(str(tmp_path / fmt)).ok
        assert read_row(str(tmp_path / fmt), 0)[0]["tokens"].dtype == np.int64


def test_a_shard_of_another_format_given_alone_says_to_pass_its_directory(packed):
    from seqpack.pipelines.datasets import PackedSource
    from seqpack.pipelines.errors import InputError

    for fmt in ("parquet", "index"):
        shard = os.path.join(packed[0][fmt], manifest_of(packed[0][fmt])["shards"][0])
        with pytest.raises(InputError, match=rf"{shard}: a {fmt} shard is read through its "
                                             "output directory .*pass the directory"):
            PackedSource(shard)


def test_hf_rows_of_a_labels_column_named_otherwise_train_with_its_loss_tokens(tmp_path):
    """TRL's rows name their labels `labels` whatever the input called them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from seqpack.pipelines.datasets import PackedSource, make_training_pipeline

    rng = np.random.default_rng(1)
    ids = [rng.integers(0, 500, rng.integers(2, 60)).tolist() for _ in range(40)]
    labels = [[t if rng.random() < 0.6 else -100 for t in x] for x in ids]
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"input_ids": ids, "answer_labels": labels}), src)
    totals = {}
    for fmt in ("arrayrecord", "hf"):
        out = tmp_path / fmt
        invoke("pack", src, "-o", out, "--column", "input_ids", "--column", "answer_labels",
               "--seq-len", 128, "--format", fmt, "--workers", 1)
        ds = make_training_pipeline(PackedSource(str(out)), batch=1, shuffle_seed=0,
                                    num_epochs=1)
        totals[fmt] = sum(int(b["loss_tokens"].sum()) for b in ds)
    assert totals["hf"] == totals["arrayrecord"] > 0


def test_a_flipped_byte_in_a_parquet_shard_is_refused_when_read(packed, tmp_path):
    """Parquet shards carry a CRC per page and the reader checks it: a flipped byte in the
    pages is an InputError naming the shard, never other tokens (before: 34 of 40 flips in
    an uncompressed shard read back as other values without a word)."""
    from seqpack.pipelines.datasets import PackedSource
    from seqpack.pipelines.errors import InputError

    out = tmp_path / "copy"
    shutil.copytree(packed[0]["parquet"], out)
    shard = out / manifest_of(out)["shards"][0]
    good = shard.read_bytes()
    source = PackedSource(str(out))
    want = [source[j] for j in range(len(source))]
    changed = 0
    for pos in np.linspace(8, len(good) // 2, 24).astype(int).tolist():  # pages, not footer
        bad = bytearray(good)
        bad[pos] ^= 0x10
        shard.write_bytes(bytes(bad))
        try:
            got = [s for j in range(len(want)) for s in [PackedSource(str(out))[j]]]
        except InputError as e:
            assert str(shard) in str(e), (pos, e)
            changed += 1
            continue
        for a, b in zip(got, want):
            for k in b:
                np.testing.assert_array_equal(a[k], b[k], err_msg=f"byte {pos}")
    assert changed >= 20  # a flip in a page's header may leave every value as it was
