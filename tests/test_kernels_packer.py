"""Kernels on real packed rows from the packer: the row contract holds end to end."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqpack import kernels
from seqpack.kernels import reference
from tests.helpers.kernels import CE_BLOCKS, GATHER_BLOCKS, INTERPRET, SEG_BLOCKS, run

SEQ_LEN, MAX_SEGMENTS, VOCAB = 128, 8, 300


@jax.jit
def _pallas(tokens, offsets, lengths, logits):
    x = tokens.astype(jnp.float32)
    seg = dict(impl="pallas", interpret=INTERPRET, block_sizes=SEG_BLOCKS)
    ce = functools.partial(kernels.segment_cross_entropy, impl="pallas", interpret=INTERPRET,
                           block_sizes=CE_BLOCKS, normalize="segments")
    loss_fn = lambda lg: ce(lg, tokens, offsets, lengths)[0]
    return (
        kernels.segment_sum(x, offsets, lengths, **seg),
        kernels.segment_max(x, offsets, lengths, **seg),
        kernels.segment_gather(x, offsets, lengths, position="last", impl="pallas",
                               interpret=INTERPRET, block_sizes=GATHER_BLOCKS),
        *jax.value_and_grad(loss_fn)(logits),
    )


@jax.jit
def _reference(tokens, offsets, lengths, logits):
    loss_fn = lambda lg: reference.segment_cross_entropy(lg, tokens, offsets, lengths,
                                                         normalize="segments")[0]
    return jax.value_and_grad(loss_fn)(logits)


@pytest.mark.slow
def test_packed_rows_from_packer():
    from seqpack.packer import PackConfig, pack

    rng = np.random.default_rng(0)
    examples = [rng.integers(0, VOCAB, size=int(n)).astype(np.int32)
                for n in rng.integers(1, 70, size=24)]
    batch = pack(examples, PackConfig(seq_len=SEQ_LEN, max_segments=MAX_SEGMENTS,
                                      segment_alignment=8))
    tokens = batch["tokens"]
    offsets = batch["tokens_segment_offsets"]
    lengths = batch["tokens_segment_lengths"]
    source = batch["segment_source_index"]
    assert offsets.shape == lengths.shape == (tokens.shape[0], MAX_SEGMENTS)
    kernels.validate_segments(offsets, lengths, seq_len=SEQ_LEN)
    slot = np.asarray(reference.segment_index(offsets, lengths, SEQ_LEN))
    np.testing.assert_array_equal(np.where(slot < MAX_SEGMENTS, slot + 1, 0),
                                  batch["tokens_segment_ids"])

    logits = rng.normal(size=(*tokens.shape, VOCAB)).astype(np.float32)
    total, top, last, loss, dlogits = run(_pallas, tokens, offsets, lengths, logits)
    for (r, j), src in np.ndenumerate(source):
        if src < 0:
            assert lengths[r, j] == 0 and total[r, j] == 0 and last[r, j] == 0
            continue
        example = examples[src]  # no overflow policy: every example is one whole segment
        assert total[r, j] == example.sum()
        assert top[r, j] == example.max()
        assert last[r, j] == example[-1]
    ref_loss, ref_dlogits = run(_reference, tokens, offsets, lengths, logits)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(dlogits, ref_dlogits, rtol=1e-5,
                               atol=1e-5 * np.abs(ref_dlogits).max())
    assert np.all(dlogits[slot == MAX_SEGMENTS] == 0.0)
