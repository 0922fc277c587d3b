"""The Python snippets of README.md and of the docs/ pages run as written and do what they say.

Each ```python block runs in a fresh namespace holding only the context below (the names a
snippet takes from its surroundings, as its page says), in a directory holding `train.jsonl`;
then the check matched by a call the snippet makes asserts what its text claims. A new snippet
needs a check here: an unmatched block fails. (```py blocks are shown, not run: signatures,
before and after.)

Context: `source` (random-access, `{"inputs": ids, "targets": ids}` examples), `L`, `batch_size`;
for the mixture snippets `chat_source` / `math_source` and `sources` (two datasets), and a
mixture's `batch` with `logits` and `targets`;
for the kernels snippet `logits` `[B, L, V]`, `targets` `[B, L]`, `batch` (packed rows) and
`next_token_in_same_segment` `[B, L]`; for the fine-tuning snippet `sft.parquet` (tokens and
labels, -100 on prompts) and `model` (batch -> logits); for the packed-input snippet `packed/`
(a packed directory with a labels column).
"""

from __future__ import annotations

import json
import pathlib
import re

import grain
import numpy as np
import pytest

from seqpack import packer
from seqpack.pipelines import datasets

ROOT = pathlib.Path(__file__).resolve().parents[1]
# (docs/contract.md's snippets are tests/test_docs_contract.py's)
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md")
                                     if p.name != "contract.md")]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
L, BATCH = 64, 4


def _blocks() -> list[str]:
    return [b for page in PAGES for b in BLOCK.findall(page.read_text(encoding="utf-8"))]


def _named_blocks() -> list[tuple[str, str]]:
    """(page:n, block) of every snippet, for the test ids."""
    return [(f"{page.relative_to(ROOT)}:{k}", b) for page in PAGES
            for k, b in enumerate(BLOCK.findall(page.read_text(encoding="utf-8")))]


def _source():
    rng = np.random.default_rng(0)
    return [{"inputs": rng.integers(1, 500, int(rng.integers(1, L // 3))).astype(np.int32),
             "targets": rng.integers(1, 500, int(rng.integers(1, L // 3))).astype(np.int32)}
            for _ in range(300)]


def _segments(row, feature="tokens"):
    lens, offs = row[f"{feature}_segment_lengths"], row[f"{feature}_segment_offsets"]
    return [row[feature][o : o + n].tolist() for o, n in zip(offs, lens, strict=True) if n]


def check_packer(ns):
    batch, values, offsets = ns["batch"], ns["values"], ns["offsets"]
    assert batch["tokens"].shape == (1, 2048)  # three short examples: one row
    want = sorted(values[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:]))
    assert sorted(_segments({k: v[0] for k, v in batch.items()})) == want


def check_dropin(ns):
    ours = next(iter(ns["ds"]))
    parent = grain.MapDataset.source(_source()).shuffle(seed=0).repeat(None).to_iter_dataset()
    theirs = next(iter(grain.experimental.FirstFitPackIterDataset(
        parent, length_struct={"inputs": L, "targets": L}, num_packing_bins=BATCH).batch(BATCH)))
    for k in theirs:  # "identical rows"
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)
    assert ours["inputs_segment_lengths"].shape[0] == BATCH  # "+ *_segment_lengths/offsets"
    assert ours["inputs_segment_ids"].max() > 1  # packed once: several segments per row


def check_pack_iter_dataset(ns):
    b = next(iter(ns["ds"]))
    assert b["inputs"].shape == (BATCH, L) and b["targets_segment_lengths"].shape == (BATCH, 64)
    assert b["inputs_segment_ids"].max() > 1


def check_training_pipeline(ns):
    assert ns["batch"]["tokens"].shape == (8, 2048)
    packer.validate({k: v for k, v in ns["batch"].items()}, packer.PackConfig(2048))
    _resumes(ns["it"], ns["state"])


def _resumes(it, state):
    after = next(it)
    it.set_state(state)  # "exact resume"
    again = next(it)
    for k in after:
        np.testing.assert_array_equal(after[k], again[k], err_msg=k)


def check_fine_tuning(ns):
    batch, mask = ns["batch"], ns["mask"]
    real = batch["tokens_segment_ids"] > 0
    assert (batch["labels"][~real] == -100).all() and (batch["labels"][real] == -100).any()
    assert "labels_segment_ids" not in batch
    np.testing.assert_array_equal(batch["loss_tokens"], mask.sum(1))
    assert 0 < batch["loss_tokens"].sum() < real.sum()  # prompts take no loss
    assert np.isclose(float(ns["loss"]), float(np.asarray(ns["per_segment_loss"]).sum())
                      / batch["loss_tokens"].sum())


def check_packed_input(ns):
    batch = ns["batch"]
    assert batch["tokens"].shape == (8, L) and batch["tokens_segment_lengths"].shape == (8, 8)
    assert {"labels", "loss_tokens", "tokens_segment_ids"} <= set(batch)  # every column
    it = ns["it"]
    state = it.get_state()
    _resumes(it, state)


def check_kernels(ns):
    loss, per_segment, tokens = ns["loss"], ns["per_segment_loss"], ns["per_segment_tokens"]
    assert np.isfinite(float(loss)) and float(loss) > 0
    assert int(np.asarray(tokens).sum()) == int(np.asarray(ns["next_token_in_same_segment"]).sum())
    assert np.asarray(per_segment).shape == ns["batch"]["tokens_segment_lengths"].shape


def check_segment_metadata(ns):
    batch = ns["batch"]
    np.testing.assert_array_equal(np.asarray(ns["lengths"]), batch["inputs_segment_lengths"])
    np.testing.assert_array_equal(np.asarray(ns["offsets"]), batch["inputs_segment_offsets"])


def _mixture_sources(n=(1500, 300), means=(60, 400), seed=4):
    """Two datasets whose tokens name them: dataset d's tokens are d * 1000 + (0..999)."""
    rng = np.random.default_rng(seed)
    return [grain.MapDataset.source(
        [{"tokens": (d * 1000 + rng.integers(0, 1000, max(1, int(rng.exponential(m))))
                     ).astype(np.int32)} for _ in range(k)])
        for d, (k, m) in enumerate(zip(n, means))]


def _dataset_tokens(batch) -> np.ndarray:
    ids, lens = batch["segment_dataset_id"], batch["tokens_segment_lengths"]
    return np.array([lens[ids == d].sum() for d in (0, 1)])


def check_mixture(ns):
    batch = ns["batch"]
    assert batch["segment_dataset_id"].shape == batch["tokens_segment_lengths"].shape
    assert set(np.unique(batch["segment_dataset_id"])) <= {-1, 0, 1}
    for r in range(batch["tokens"].shape[0]):  # each segment's tokens are its dataset's
        for d, o, n in zip(batch["segment_dataset_id"][r], batch["tokens_segment_offsets"][r],
                           batch["tokens_segment_lengths"][r]):
            assert n == 0 or (batch["tokens"][r, o:o + n] // 1000 == d).all()
    share = _dataset_tokens(batch) / _dataset_tokens(batch).sum()
    assert abs(share[1] - 0.7) < 0.1, share  # "weights ... in tokens", in one batch


def check_schedule(ns):
    it = iter(ns["mix"])
    web = code = 0
    for _ in range(300):
        e = next(it)["tokens"]
        web, code = (web + len(e), code) if e[0] < 1000 else (web, code + len(e))
    assert abs(web / (web + code) - 0.9) < 0.05  # the first stage's weights


def check_dataset_loss(ns):
    ids = ns["batch"]["segment_dataset_id"]
    per_seg, tokens = np.asarray(ns["per_segment_loss"]), np.asarray(ns["per_segment_tokens"])
    want = [per_seg[ids == d].sum() / max(tokens[ids == d].sum(), 1) for d in (0, 1)]
    np.testing.assert_allclose(np.asarray(ns["per_dataset"]), want, rtol=1e-5)


CHECKS = {
    'Mixture({"chat"': check_mixture,
    "schedule=[(0,": check_schedule,
    "kernels.segment_dataset_loss(": check_dataset_loss,
    "segment_metadata(": check_segment_metadata,
    "pack_ragged(": check_packer,
    "datasets.FirstFitPackIterDataset(": check_dropin,
    "datasets.PackIterDataset(": check_pack_iter_dataset,
    "datasets.JsonlSource(": check_training_pipeline,
    "datasets.LossTokens(": check_fine_tuning,
    "datasets.PackedArrayRecordSource(": check_packed_input,
    "loss_mask=next_token_in_same_segment": check_kernels,
}


def _context(block: str) -> dict:
    ns: dict = {"L": L, "batch_size": BATCH, "source": _source()}
    if 'Mixture({"chat"' in block:
        ns["chat_source"], ns["math_source"] = _mixture_sources(n=(6000, 1200))
    if "schedule=[(0," in block:
        ns["sources"] = dict(zip(("web", "code"), _mixture_sources()))
    if "kernels.segment_dataset_loss(" in block:
        import jax

        chat, math = _mixture_sources(n=(40, 10))
        mix = datasets.Mixture({"chat": chat, "math": math}, weights={"chat": 1, "math": 1})
        rows = next(iter(datasets.PackIterDataset(mix, packer.PackConfig(L, max_segments=8,
                                                                          overflow="split"))))
        seg = rows["tokens_segment_ids"][None]
        ns["batch"] = {k: v[None] for k, v in rows.items()}
        ns["logits"] = jax.random.normal(jax.random.key(0), (*seg.shape, 32))
        ns["targets"] = np.roll(ns["batch"]["tokens"], -1, axis=1) % 32
    if "segment_metadata(" in block:  # a Grain-style batch: [B, L] segment ids under "inputs"
        ns["batch"] = packer.pack([np.arange(1, n) for n in (20, 7, 30, 12, 25, 60)],
                                  packer.PackConfig(L, max_segments=64, feature="inputs"))
    if "datasets.LossTokens(" in block:
        _sft_parquet("sft.parquet")
        ns["model"] = _model
    if "datasets.PackedArrayRecordSource(" in block:
        _packed_dir("packed")
    if "loss_mask=next_token_in_same_segment" in block:
        import jax

        rows = packer.pack([np.arange(1, n) for n in (20, 7, 30, 12, 25)],
                           packer.PackConfig(L, max_segments=8))
        seg = rows["tokens_segment_ids"]
        ns["batch"] = rows
        ns["logits"] = jax.random.normal(jax.random.key(0), (*seg.shape, 32))
        ns["targets"] = np.roll(rows["tokens"], -1, axis=1) % 32
        ns["next_token_in_same_segment"] = (seg > 0) & (seg == np.roll(seg, -1, axis=1))
        ns["next_token_in_same_segment"][:, -1] = False
    return ns


def _sft_parquet(path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(2)
    tokens = [rng.integers(0, 32, int(rng.integers(2, 30))).tolist() for _ in range(60)]
    labels = [[-100] * int(rng.integers(1, len(t))) + t[len(t) // 2 :] for t in tokens]
    labels = [lab[: len(t)] + t[len(lab) :] for lab, t in zip(labels, tokens)]
    pq.write_table(pa.table({"tokens": tokens, "labels": labels}), path)


def _model(batch):
    """Random logits [B, L, 32] for a batch (the fine-tuning snippet's model)."""
    import jax

    return jax.random.normal(jax.random.key(0), (*batch["tokens"].shape, 32))


def _packed_dir(path):
    import os

    from tests.helpers.pipelines import sft_corpus, sft_source, write_packed

    os.makedirs(path)
    values, offsets, labels, mask = sft_corpus(np.random.default_rng(3).integers(1, L, 200))
    rows = list(datasets.PackIterDataset(
        datasets.SequentialIterDataset(sft_source(values, offsets, labels, mask)),
        packer.PackConfig(L, max_segments=8),
        columns=datasets.Columns(labels=["labels"], drop=["mask"])))
    write_packed(path, rows, seq_len=L, max_segments=8, shard_rows=16,
                 columns={"labels": -100}, roles={"labels": "labels"})  # as seqpack pack does


@pytest.fixture
def in_data_dir(tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    with open(tmp_path / "train.jsonl", "w") as f:
        for _ in range(200):
            f.write(json.dumps({"tokens": rng.integers(0, 999, int(rng.integers(1, 300))).tolist()})
                    + "\n")
    monkeypatch.chdir(tmp_path)


def test_every_snippet_has_a_check_and_every_check_a_snippet():
    blocks = _blocks()
    for block in blocks:
        assert sum(call in block for call in CHECKS) == 1, block
    assert all(any(call in b for b in blocks) for call in CHECKS)


@pytest.mark.parametrize("where,block", _named_blocks(), ids=[w for w, _ in _named_blocks()])
def test_snippet_runs_and_does_what_it_says(where, block, in_data_dir):
    (call,) = [c for c in CHECKS if c in block]
    ns = _context(block)
    exec(compile(block, f"{where} snippet", "exec"), ns)  # noqa: S102 - our own docs
    CHECKS[call](ns)


def test_the_grain_snippet_with_its_before_line_live_refuses_to_pack_twice(in_data_dir):
    from seqpack.pipelines.errors import InputError

    (block,) = [b for b in _blocks() if "datasets.FirstFitPackIterDataset(" in b]
    live = re.sub(r"^# before: ", "", block, flags=re.M)  # Grain's packer, then seqpack's
    live = re.sub(r"^#( +num_packing_bins)", r" \1", live, flags=re.M)
    assert live.count("FirstFitPackIterDataset(") == 2 and "# before" not in live
    ns = _context(live)
    exec(compile(live, "README.md snippet, both packers live", "exec"), ns)  # noqa: S102
    with pytest.raises(InputError, match="already packed"):  # before: every row one segment
        next(iter(ns["ds"]))
