"""Packing does not change the math: packed rows give each document's loss and the gradients
of examples trained one by one (each alone in a padded row), for both loss normalizations."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from examples.tiny_lm import ModelConfig, init_params, loss_fn
from seqpack.packer import PackConfig, pack

pytestmark = pytest.mark.slow  # trains / compiles a model: seconds per case

CFG = ModelConfig(vocab=61, dim=32, heads=2, layers=2, mlp=64, max_len=32)


def _examples(seed=0, n=11):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG.vocab, int(m)).astype(np.int32) for m in rng.integers(1, 22, n)]


@pytest.mark.parametrize("normalize", ["tokens", "segments"])
def test_packed_equals_one_by_one(normalize):
    examples = _examples()
    params = init_params(jax.random.key(0), CFG)
    packed = pack(examples, PackConfig(32, max_segments=6))
    assert packed["tokens"].shape[0] < len(examples)  # really packed: several docs per row
    alone = pack(examples, PackConfig(32, max_segments=1))  # one example per padded row
    assert alone["tokens"].shape[0] == len(examples)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (lp, (seg_p, cnt_p)), gp = grad_fn(params, packed, CFG, normalize=normalize)
    (lu, (seg_u, cnt_u)), gu = grad_fn(params, alone, CFG, normalize=normalize)

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

    def causal_only(segment_ids):
        L = segment_ids.shape[-1]
        return jnp.broadcast_to(jnp.tril(jnp.ones((L, L), bool)), (segment_ids.shape[0], 1, L, L))

    monkeypatch.setattr(lm, "attention_mask", causal_only)
    _, (seg_p, _) = loss_fn(params, packed, CFG)
    src = packed["segment_source_index"]
    later = [(r, j) for (r, j), e in np.ndenumerate(src) if e >= 0 and j > 0]
    assert later, "some document must follow another in its row"
    diffs = [abs(float(seg_p[r, j]) - float(seg_u[src[r, j], 0])) for r, j in later]
    assert max(diffs) > 1e-3
