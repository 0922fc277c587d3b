"""Packing does not change the math: packed rows give each document's loss and the gradients
of examples trained one by one (each alone in a padded row), for both loss normalizations, with
the model's attention from kernels.segment_attention: its jnp reference (impl="auto" on CPU) and
both Pallas families in interpret mode, whose schedule skips the blocks other documents hold."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from examples.tiny_lm import ModelConfig, init_params, loss_fn
from seqpack import kernels
from seqpack.packer import PackConfig, pack
from tests.helpers.kernels import INTERPRET

pytestmark = pytest.mark.slow  # trains / compiles a model: seconds per case

CFG = ModelConfig(vocab=61, dim=32, heads=2, layers=2, mlp=64, max_len=32)
# GPU tiles of 16 tokens: a packed row of 32 is two query blocks, and the pair (1, 0) is skipped
# wherever no document crosses token 16. The TPU kernels' blocks are 128 (one block per row).
ATTENTION = {
    "reference": CFG,
    "pallas_gpu": dataclasses.replace(CFG, attention_impl="pallas_gpu", attention_interpret=True,
                                      attention_block_sizes=kernels.GpuAttentionBlockSizes(
                                          16, 16, 16, 16)),
    "pallas_tpu": dataclasses.replace(CFG, attention_impl="pallas_tpu",
                                      attention_interpret=INTERPRET),
}


def _examples(seed=0, n=11):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG.vocab, int(m)).astype(np.int32) for m in rng.integers(1, 22, n)]


@pytest.mark.parametrize(("normalize", "attention"), [
    ("tokens", "reference"), ("segments", "reference"), ("tokens", "pallas_gpu"),
    ("segments", "pallas_tpu")])
def test_packed_equals_one_by_one(normalize, attention):
    cfg = ATTENTION[attention]
    examples = _examples()
    params = init_params(jax.random.key(0), CFG)
    packed = pack(examples, PackConfig(32, max_segments=6))
    assert packed["tokens"].shape[0] < len(examples)  # really packed: several docs per row
    alone = pack(examples, PackConfig(32, max_segments=1))  # one example per padded row
    assert alone["tokens"].shape[0] == len(examples)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (lp, (seg_p, cnt_p)), gp = grad_fn(params, packed, cfg, normalize=normalize)
    (lu, (seg_u, cnt_u)), gu = grad_fn(params, alone, cfg, normalize=normalize)

    # Per-document losses and token counts agree document by document.
    src_p = packed["segment_source_index"]
    src_u = alone["segment_source_index"][:, 0]
    doc_p = {int(e): (float(seg_p[r, j]), int(cnt_p[r, j]))
             for (r, j), e in np.ndenumerate(src_p) if e >= 0}
    doc_u = {int(e): (float(seg_u[r, 0]), int(cnt_u[r, 0])) for r, e in enumerate(src_u)}
    assert doc_p.keys() == doc_u.keys() == set(range(len(examples)))
    for e in doc_p:
        assert doc_p[e][1] == doc_u[e][1] == len(examples[e]) - 1
        np.testing.assert_allclose(doc_p[e][0], doc_u[e][0], rtol=2e-5, atol=1e-5)
    np.testing.assert_allclose(lp, lu, rtol=2e-5, atol=1e-6)
    for k in gp:
        np.testing.assert_allclose(gp[k], gu[k], rtol=1e-4, atol=2e-6, err_msg=k)


def test_rows_with_only_segment_ids_give_the_same_losses():
    """Rows as Grain's packers write them (segment ids, no offsets / lengths): the model derives
    the metadata with kernels.segment_metadata and gets the same per-segment losses."""
    examples = _examples(2)
    params = init_params(jax.random.key(2), CFG)
    packed = pack(examples, PackConfig(32, max_segments=6))
    grain_style = {k: v for k, v in packed.items() if not k.endswith(("_offsets", "_lengths"))}
    loss, (seg, _) = loss_fn(params, packed, CFG)
    loss_ids, (seg_ids, _) = loss_fn(params, grain_style, dataclasses.replace(CFG, max_segments=6))
    np.testing.assert_allclose(loss_ids, loss, rtol=1e-6)
    np.testing.assert_allclose(seg_ids, seg, rtol=1e-6, atol=1e-6)


def test_cross_contamination_would_be_caught(monkeypatch):
    # The check above is not vacuous: with attention allowed across documents (causal only),
    # the packed per-document losses no longer match the one-by-one losses.
    import jax.numpy as jnp

    import examples.tiny_lm as lm

    examples = _examples(1)
    params = init_params(jax.random.key(1), CFG)
    packed = pack(examples, PackConfig(32, max_segments=6))
    alone = pack(examples, PackConfig(32, max_segments=1))
    _, (seg_u, _) = loss_fn(params, alone, CFG)
    real = lm.attention

    def causal_only(q, k, v, offsets, lengths, cfg):  # one "segment" spanning each whole row
        whole = jnp.full((q.shape[0], 1), q.shape[1], jnp.int32)
        return real(q, k, v, jnp.zeros_like(whole), whole, cfg)

    monkeypatch.setattr(lm, "attention", causal_only)
    _, (seg_p, _) = loss_fn(params, packed, CFG)
    src = packed["segment_source_index"]
    later = [(r, j) for (r, j), e in np.ndenumerate(src) if e >= 0 and j > 0]
    assert later, "some document must follow another in its row"
    diffs = [abs(float(seg_p[r, j]) - float(seg_u[src[r, j], 0])) for r, j in later]
    assert max(diffs) > 1e-3


def test_sft_micro_batches_give_the_unpacked_per_token_mean():
    """Labels packed with the tokens (SFT: -100 on the prompt), `loss_tokens` from the training
    pipeline: a batch cut into micro-batches, each summing its loss and divided by the whole
    batch's loss_tokens, gives the per-token mean (and gradient) of the examples unpacked."""
    import grain

    from examples.tiny_lm import _split
    from examples.train_tiny_lm import sft_corpus
    from seqpack.packer import PackConfig
    from seqpack.pipelines.datasets import Batching, Columns, Prefetch, make_training_pipeline

    rng = np.random.default_rng(3)
    examples = [rng.integers(1, CFG.vocab, int(m)).astype(np.int32)
                for m in rng.integers(3, 20, 16)]
    for e in examples:  # a "newline" ends each prompt
        e[int(rng.integers(0, e.size - 1))] = ord("\n") % CFG.vocab
    cfg = dataclasses.replace(CFG, vocab=max(CFG.vocab, ord("\n") + 1))
    rows = sft_corpus(examples)
    ds = make_training_pipeline(grain.MapDataset.source(rows),
                                pack=PackConfig(32, max_segments=6),
                                batch=Batching(4, shard_index=0, shard_count=1), shuffle_seed=0,
                                num_epochs=1, columns=Columns(labels={"labels": -100}),
                                prefetch=Prefetch(buffer_size=0))
    batch = next(iter(ds))
    params = init_params(jax.random.key(1), cfg)
    summed = lambda p, b: loss_fn(p, b, cfg, normalize="none", labels="labels")[0]  # noqa: E731
    grad = jax.value_and_grad(summed)
    total = float(batch["loss_tokens"].sum())
    # one denominator for every part: the whole batch's loss tokens
    parts = [grad(params, part) for part in _split(batch, 2)]
    loss = sum(float(v) for v, _ in parts) / total
    grads = {k: sum(g[k] for _, g in parts) / total for k in params}
    # the examples this batch holds, unpacked: one per padded row, per-token mean
    docs = [(batch["tokens"][r, a : a + n], batch["labels"][r, a : a + n])
            for (r, j), n in np.ndenumerate(batch["tokens_segment_lengths"]) if n > 0
            for a in [batch["tokens_segment_offsets"][r, j]]]
    assert len(docs) > batch["tokens"].shape[0]  # really packed
    alone = pack([t for t, _ in docs], PackConfig(32, max_segments=1))
    alone["labels"] = np.full_like(alone["tokens"], -100)
    for r, i in enumerate(alone["segment_source_index"][:, 0]):
        alone["labels"][r, : docs[i][1].size] = docs[i][1]
    (want, (_, count)), want_g = jax.value_and_grad(loss_fn, has_aux=True)(
        params, alone, cfg, normalize="tokens", labels="labels")
    assert int(count.sum()) == total  # loss_tokens counts what the loss counts
    np.testing.assert_allclose(loss, float(want), rtol=1e-5)
    for k in params:
        np.testing.assert_allclose(grads[k], want_g[k], rtol=1e-4, atol=2e-6, err_msg=k)


def test_the_example_trains_on_sft_data_with_micro_batches():
    from examples.train_tiny_lm import stdlib_corpus, train

    cfg = ModelConfig(dim=32, heads=2, layers=1, mlp=64, max_len=64)
    losses = train(6, seq_len=64, batch_size=4, model=cfg, examples=stdlib_corpus(200),
                   sft=True, micro_batches=2)
    assert len(losses) == 6 and all(np.isfinite(losses)) and losses[-1] < losses[0]
