"""loss_tokens: counts what kernels.segment_cross_entropy counts, so a per-token mean over a global
batch split across hosts and micro-batches equals the unpacked one."""

from __future__ import annotations

import numpy as np
import pytest

from seqpack.packer import PackConfig
from seqpack.pipelines import datasets
from seqpack.pipelines.datasets import ArraySource, Batching, Columns, LossTokens
from tests.helpers.pipelines import random_lengths

jnp = pytest.importorskip("jax.numpy")
from seqpack import kernels  # noqa: E402

V = 17  # vocabulary


def test_worked_example():
    row = {"tokens_segment_ids": np.array([1, 1, 1, 2, 2, 0]),
           "labels": np.array([-100, 12, 13, -100, 22, -100]),
           "mask": np.array([0, 1, 1, 0, 1, 0])}
    assert LossTokens(labels="labels").mask(row).tolist() == [1, 1, 0, 1, 0, 0]
    assert LossTokens(labels="labels").count(row) == 3
    assert LossTokens(labels=("labels",), next_token=False).count(row) == 3  # 12 13 22
    assert LossTokens(masks=("mask",), next_token=False).count(row) == 3
    assert LossTokens().count(row) == 3  # next tokens inside segments: 2 + 1
    assert LossTokens(next_token=False).count(row) == 5  # every real token
    batch = {k: np.stack([v, v]) for k, v in row.items()}
    out = LossTokens(labels="labels")(batch)
    assert out["loss_tokens"].tolist() == [3, 3] and out["loss_tokens"].dtype == np.int32


def _sft(n: int, seed: int):
    """Examples with HF-style labels: the tokens, -100 on a prompt of random length."""
    rng = np.random.default_rng(seed)
    lengths = random_lengths(rng, n, high=40) + 1
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = rng.integers(0, V, int(offsets[-1])).astype(np.int32)
    labels = tokens.astype(np.int64)
    for a, b in zip(offsets[:-1], offsets[1:]):
        labels[a : a + int(rng.integers(1, b - a + 1))] = -100
    return tokens, labels, offsets


def _token_losses(table, tokens, targets):
    """Cross-entropy of logits table[token] against the target, per position (numpy)."""
    logits = table[tokens]
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]


def _rows(v, n):
    """v with zero rows appended up to n rows (an empty row: no segment, no loss token); one
    shape for every micro-batch, so the kernel compiles once."""
    return np.concatenate([v, np.zeros((n - len(v), *v.shape[1:]), v.dtype)])


def _next_token_mask(seg, labels):
    """The mask a causal LM builds (examples/tiny_lm.py), restricted to labelled targets."""
    nxt = np.concatenate([seg[:, 1:], np.zeros_like(seg[:, :1])], axis=1)
    lab = np.concatenate([labels[:, 1:], np.full_like(labels[:, :1], -100)], axis=1)
    return (seg > 0) & (nxt == seg) & (lab != -100)


def test_packed_per_token_mean_over_hosts_and_micro_batches_equals_the_unpacked_one():
    tokens, labels, offsets = _sft(90, seed=1)
    table = np.random.default_rng(2).normal(size=(V, V)).astype(np.float32)
    total = count = 0.0  # unpacked: example by example
    for a, b in zip(offsets[:-1], offsets[1:]):
        keep = labels[a + 1 : b] != -100
        total += _token_losses(table, tokens[a : b - 1], tokens[a + 1 : b])[keep].sum()
        count += keep.sum()
    src = ArraySource({"tokens": (tokens, offsets), "labels": (labels, offsets)},
                      value_columns=["labels"])
    loss_sum, loss_tokens, micro_means = 0.0, 0, []
    for host in range(2):  # the global batch: 2 hosts x micro-batches of 2 rows
        for batch in datasets.make_training_pipeline(
                src, pack=PackConfig(64, max_segments=8), shuffle_seed=3, num_epochs=1,
                batch=Batching(4, drop_remainder=False, shard_index=host, shard_count=2),
                columns=Columns(labels=["labels"])):
            for m in range(0, len(batch["tokens"]), 2):
                micro = {k: _rows(v[m : m + 2], 2) for k, v in batch.items()}
                seg = micro["tokens_segment_ids"]
                mask = _next_token_mask(seg, micro["labels"])
                targets = np.concatenate([micro["tokens"][:, 1:], 0 * micro["tokens"][:, :1]], 1)
                _, per_seg, per_seg_tokens = kernels.segment_cross_entropy(
                    jnp.asarray(table[micro["tokens"]]), jnp.asarray(targets),
                    jnp.asarray(micro["tokens_segment_offsets"]),
                    jnp.asarray(micro["tokens_segment_lengths"]), normalize="none",
                    loss_mask=jnp.asarray(mask))
                np.testing.assert_array_equal(np.asarray(per_seg_tokens).sum(1),
                                              micro["loss_tokens"])  # what the kernel counts
                loss_sum += float(np.asarray(per_seg).sum())
                loss_tokens += int(micro["loss_tokens"].sum())
                micro_means.append(float(np.asarray(per_seg).sum()) / max(
                    1, int(micro["loss_tokens"].sum())))
    assert loss_tokens == count
    np.testing.assert_allclose(loss_sum / loss_tokens, total / count, rtol=1e-5)
    # The mean of per-micro-batch means is not the per-token mean: the count is what fixes it.
    assert abs(np.mean(micro_means) - total / count) > 1e-4


def test_loss_tokens_of_aligned_labels_and_masks_match_the_kernel():
    tokens, labels, offsets = _sft(40, seed=4)
    mask = (labels != -100).astype(np.int8)
    src = ArraySource({"tokens": (tokens, offsets), "labels": (labels, offsets),
                       "mask": (mask, offsets)}, value_columns=["labels", "mask"])
    batch = next(iter(datasets.make_training_pipeline(
        src, pack=PackConfig(64, max_segments=8), shuffle_seed=0, num_epochs=1,
        batch=Batching(2, shard_index=0, shard_count=1),
        columns=Columns(masks=["mask"], drop=["labels"], next_token_loss=False))))
    _, _, per_seg_tokens = kernels.segment_cross_entropy(
        jnp.zeros((2, 64, V)), jnp.zeros((2, 64), jnp.int32),
        jnp.asarray(batch["tokens_segment_offsets"]),
        jnp.asarray(batch["tokens_segment_lengths"]), loss_mask=jnp.asarray(batch["mask"]))
    np.testing.assert_array_equal(np.asarray(per_seg_tokens).sum(1), batch["loss_tokens"])
    assert 0 < batch["loss_tokens"].sum() < batch["tokens_segment_lengths"].sum()
