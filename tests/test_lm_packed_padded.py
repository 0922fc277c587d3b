"""Packed learns what padded learns: one step of examples/lm.py on packed rows computes the same
loss and the same gradient of every parameter as one step on the same examples padded one per
row (segment-aware attention, positions restarting per segment, loss per counted token, -100
labels), f32 on CPU. Tolerance: rtol 2e-5 / atol 2e-6 (f32 sums in another order)."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from examples import lm
from seqpack import packer
from seqpack.kernels.gpu import cudnn
from tests.helpers import cudnn as stand_in

L = 64
TOL = dict(rtol=2e-5, atol=2e-6)
MODEL = dict(vocab=97, dim=32, heads=2, head_dim=16, mlp=64, layers=2, dtype="float32")


def _examples(seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Token arrays of lengths 1..L (one of exactly L) and, per example, which positions keep
    their next-token label (False: -100, like a prompt)."""
    rng = np.random.default_rng(seed)
    lengths = [L, 1, 2, *rng.integers(3, L, 9).tolist()]
    tokens = [rng.integers(0, MODEL["vocab"], n).astype(np.int32) for n in lengths]
    keep = [rng.random(n) < 0.7 for n in lengths]
    return tokens, keep


def _labelled(batch: dict, keep_rows: np.ndarray) -> dict:
    return {**batch, "targets": np.where(keep_rows, np.asarray(batch["targets"]), -100)}


def _packed(tokens, keep) -> dict:
    rows = packer.pack(tokens, packer.PackConfig(L, max_segments=8))
    b = lm.make_batch(rows["tokens"], rows["tokens_segment_ids"], rows["tokens_positions"],
                      rows["tokens_segment_offsets"], rows["tokens_segment_lengths"])
    keep_rows = np.zeros(rows["tokens"].shape, bool)
    for r, s in zip(*np.nonzero(rows["tokens_segment_lengths"])):
        i, off = rows["segment_source_index"][r, s], rows["tokens_segment_offsets"][r, s]
        keep_rows[r, off:off + len(tokens[i])] = keep[i]
    return _labelled(b, keep_rows)


def _padded(tokens, keep) -> dict:
    n = len(tokens)
    tok, ids, pos = (np.zeros((n, L), np.int32) for _ in range(3))
    keep_rows = np.zeros((n, L), bool)
    for r, t in enumerate(tokens):
        tok[r, :t.size], ids[r, :t.size], pos[r, :t.size] = t, 1, np.arange(t.size)
        keep_rows[r, :t.size] = keep[r]
    lengths = np.array([[t.size] for t in tokens], np.int32)
    b = lm.make_batch(tok, ids, pos, np.zeros((n, 1), np.int32), lengths)
    return _labelled(b, keep_rows)


@pytest.mark.parametrize("packed_cfg", [pytest.param(dict(attention="reference",
                                                          loss="materialized"),
                                                     marks=pytest.mark.slow),
                                        pytest.param(dict(attention="seqpack", loss="fused",
                                                          interpret=True),
                                                     marks=pytest.mark.slow),
                                        pytest.param(dict(attention="reference",
                                                          loss="materialized", rope="interleaved"),
                                                     marks=pytest.mark.slow),
                                        pytest.param(dict(attention="masked",
                                                          loss="materialized", interpret=True),
                                                     marks=pytest.mark.slow)])
def test_packed_step_equals_padded_step(packed_cfg):
    """The packed step's loss and gradients equal the padded step's (the reference attention),
    for each way of attending ("masked": MaxText's GPU kernel, interpreted)."""
    tokens, keep = _examples()
    packed, padded = _packed(tokens, keep), _padded(tokens, keep)
    assert packed["tokens"].shape[0] < padded["tokens"].shape[0]  # really packed
    assert int((packed["targets"] >= 0).sum()) == int((padded["targets"] >= 0).sum())
    rope = packed_cfg.get("rope", "half")
    cfg_packed = lm.LMConfig(**MODEL, **packed_cfg)
    cfg_padded = lm.LMConfig(**MODEL, attention="reference", loss="materialized", rope=rope)
    params = lm.init_params(jax.random.key(0), cfg_packed)
    loss_p, grads_p = lm.value_and_grad(cfg_packed)(params, packed)
    loss_q, grads_q = lm.value_and_grad(cfg_padded)(params, padded)
    np.testing.assert_allclose(float(loss_p), float(loss_q), **TOL)
    named = lambda tree: dict(jax.tree_util.tree_leaves_with_path(tree))  # noqa: E731
    named_p, named_q = named(grads_p), named(grads_q)
    assert named_p.keys() == named_q.keys() == named(params).keys()
    assert len(named_p) == 3 + 9 * MODEL["layers"]  # embed, out_norm, unembed; 9 a block
    for path, grad in named_p.items():
        np.testing.assert_allclose(np.asarray(grad), np.asarray(named_q[path]),
                                   err_msg=jax.tree_util.keystr(path), **TOL)


@pytest.mark.slow
def test_cudnn_attention_step_equals_the_reference_step(monkeypatch):
    """attention="cudnn" (bfloat16: cuDNN's dtypes) on packed rows, the family run on
    tests/helpers/cudnn.py's stand-in: the reference step's loss and gradients, to bf16."""
    stand_in.install(monkeypatch, cudnn)
    tokens, keep = _examples()
    packed = _packed(tokens, keep)
    model = {**MODEL, "dtype": "bfloat16"}
    params = lm.init_params(jax.random.key(0), lm.LMConfig(**model))
    got, want = (lm.value_and_grad(lm.LMConfig(**model, attention=a, loss="materialized"))(
        params, packed) for a in ("cudnn", "reference"))
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-2)
    for a, b in zip(jax.tree_util.tree_leaves(got[1]), jax.tree_util.tree_leaves(want[1])):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=5e-2, atol=5e-2 * np.abs(b).max())


@pytest.mark.parametrize("attention", ["seqpack", "masked", "cudnn"])
def test_the_gpu_step_lowers_for_cuda(monkeypatch, attention):
    """The training step of each GPU way, lowered for CUDA on a (patched) GPU backend without a
    GPU: seqpack's own kernels ("auto" takes the Triton family) forward and backward; every
    Triton module verifies (tests.helpers.kernels.lower_cuda), MaxText's masked
    kernel's included; cuDNN's step is cuDNN's custom calls and no Triton."""
    from jax._src.cudnn import fused_attention_stablehlo as fused

    from tests.helpers.kernels import lower_cuda

    tokens, keep = _examples()
    packed = _packed(tokens, keep)
    model = {**MODEL, "dtype": "bfloat16", "vocab": 128, "head_dim": 64}
    cfg = lm.LMConfig(**model, attention=attention)
    params = lm.init_params(jax.random.key(0), cfg)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for name, value in (("check_cudnn_version", lambda: 91000),
                        ("check_compute_capability", lambda capability: True),
                        ("is_cuda_compute_capability_equal", lambda capability: False)):
        monkeypatch.setattr(fused, name, value)
    monkeypatch.setattr(cudnn, "requires", lambda: None)
    text = lower_cuda(lm.value_and_grad(cfg), params, packed)
    kernels_named = re.findall(r'name = "(\w+_gpu)"', text)
    if attention == "seqpack":
        assert {"segment_attention_fwd_gpu", "segment_attention_dq_gpu",
                "segment_attention_dkv_gpu"} <= set(kernels_named), kernels_named
    elif attention == "masked":
        assert "xla.gpu.triton" in text and not any("segment_attention" in k
                                                    for k in kernels_named)
    else:
        assert set(re.findall(r"__cudnn\$\w+", text)) == {"__cudnn$fmhaSoftmax",
                                                          "__cudnn$fmhaSoftmaxBackward"}
        assert not any("attention" in k for k in kernels_named)
