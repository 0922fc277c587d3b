"""kernels.loss_head_plan (kernels/fused/policy.py): the mode and chunk it returns around each
boundary (all logits fit, chunked, recompute below MIN_CHUNK_TOKENS), that
segment_linear_cross_entropy runs that plan, and its ValueErrors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.loss_head import jaxpr_values
from seqpack import kernels
from seqpack.kernels.fused import policy
from tests.helpers.kernels import metadata, random_array, run

Plan, Mode = kernels.LossHeadPlan, kernels.LossHeadMode
LEAST = policy.MIN_CHUNK_TOKENS  # 512
N, V = 5000, 1000
TOKEN = 4 * V  # bytes of one token's f32 logits


@pytest.mark.parametrize("budget,want", [
    (N * TOKEN, Plan(Mode.LOGITS, N, N * TOKEN)),  # all logits fit, exactly
    (N * TOKEN - 1, Plan(Mode.CHUNKED, 2560, 2560 * TOKEN)),  # 4992 fit: 2 x 2500, rounded up
    (4096 * TOKEN, Plan(Mode.CHUNKED, 2560, 2560 * TOKEN)),
    (LEAST * TOKEN, Plan(Mode.CHUNKED, 512, 512 * TOKEN)),  # 10 chunks of 500, rounded up
    (LEAST * TOKEN - 1, Plan(Mode.RECOMPUTE, None, None)),  # 384 fit: below the least chunk
    (1, Plan(Mode.RECOMPUTE, None, None)),
])
def test_auto_around_the_boundaries(budget, want):
    assert kernels.loss_head_plan(N, V, max_logits_bytes=budget) == want
    assert kernels.loss_head_plan(N, V, mode=Mode.AUTO, max_logits_bytes=budget) == want


def test_fewer_tokens_than_the_least_chunk():
    """N < MIN_CHUNK_TOKENS: all logits, or recompute (a chunk must then hold all tokens)."""
    assert kernels.loss_head_plan(300, V, max_logits_bytes=300 * TOKEN) == Plan(
        Mode.LOGITS, 300, 300 * TOKEN)
    assert kernels.loss_head_plan(300, V, max_logits_bytes=300 * TOKEN - 1) == Plan(
        Mode.RECOMPUTE, None, None)


def test_logits_dtype_sizes_the_budget():
    """bf16 logits: the same budget holds twice the tokens; logits_bytes counts 2 a logit."""
    plan = kernels.loss_head_plan(N, V, max_logits_bytes=N * TOKEN // 2, logits_dtype="bfloat16")
    assert plan == Plan(Mode.LOGITS, N, N * V * 2)
    plan = kernels.loss_head_plan(N, V, max_logits_bytes=N * TOKEN // 2,
                                  logits_dtype=jnp.float32)  # 2432 fit: 3 x 1667, rounded up
    assert plan == Plan(Mode.CHUNKED, 1792, 1792 * TOKEN)


def test_forced_modes():
    """"chunked" takes at least CHUNK_MULTIPLE tokens (its logits may pass a smaller budget);
    "logits" all tokens whatever the budget; "recompute" no chunk."""
    multiple = policy.CHUNK_MULTIPLE
    assert kernels.loss_head_plan(N, V, mode="chunked", max_logits_bytes=1) == Plan(
        Mode.CHUNKED, multiple, multiple * TOKEN)
    assert kernels.loss_head_plan(N, V, mode="chunked", max_logits_bytes=N * TOKEN) == Plan(
        Mode.CHUNKED, N, N * TOKEN)
    assert kernels.loss_head_plan(N, V, mode="logits", max_logits_bytes=1) == Plan(
        Mode.LOGITS, N, N * TOKEN)
    assert kernels.loss_head_plan(N, V, mode="recompute") == Plan(Mode.RECOMPUTE, None, None)


def test_without_a_budget_a_share_of_free_memory(monkeypatch):
    """No max_logits_bytes: BUDGET_SHARE of the free memory for held_bytes (12 for f32) a
    logit, read when the plan is taken."""
    free = 3 * 2048 * V * policy.held_bytes(4) // 2 + 64  # its two thirds hold 2048 tokens
    monkeypatch.setattr(policy, "free_device_bytes", lambda: free)
    assert kernels.loss_head_plan(2048, V) == Plan(Mode.LOGITS, 2048, 2048 * TOKEN)
    assert kernels.loss_head_plan(2049, V) == Plan(Mode.CHUNKED, 1152, 1152 * TOKEN)
    monkeypatch.setattr(policy, "free_device_bytes", lambda: free // 8)  # 256 tokens
    assert kernels.loss_head_plan(2048, V).mode is Mode.RECOMPUTE


@pytest.mark.parametrize("kind,knee", [("TPU v5 lite", 6415), ("NVIDIA H100 80GB HBM3", 7873),
                                       ("NVIDIA H200", 5495), ("cpu", None)])
def test_the_chips_knee(kind, knee):
    """K / KNEE_SHARE tokens, K = (4/3) peak / bandwidth: the cost model beside CHIPS."""
    assert policy.knee_tokens(kind) == knee


@pytest.mark.parametrize("n,want", [
    (65536, Plan(Mode.CHUNKED, 6016, 6016 * 128256 * 2)),  # 6400 fit: 11 chunks of 5,958
    (16384, Plan(Mode.CHUNKED, 5504, 5504 * 128256 * 2)),  # 3 chunks of 5,462
    (8192, Plan(Mode.CHUNKED, 4096, 4096 * 128256 * 2)),
    (6400, Plan(Mode.LOGITS, 6400, 6400 * 128256 * 2)),  # within the knee: all at once
])
def test_auto_takes_no_chunk_past_the_chips_knee(monkeypatch, n, want):
    """On a TPU v5e with memory to spare (80 GB), "auto" stops at the knee, 6,415 tokens: past
    it a larger chunk saves under 5% of the time and costs memory in proportion. A budget
    below the knee still rules; a chip not in CHIPS takes what the budget holds."""
    monkeypatch.setattr(policy, "free_device_bytes", lambda: 80 << 30)
    monkeypatch.setattr(policy, "device_kind", lambda: "TPU v5 lite")
    plan = functools.partial(kernels.loss_head_plan, vocab=128256, logits_dtype="bfloat16")
    assert plan(n) == want
    small = plan(n, max_logits_bytes=2048 * 128256 * 2)
    monkeypatch.setattr(policy, "device_kind", lambda: "cpu")
    assert plan(n, max_logits_bytes=2048 * 128256 * 2) == small
    assert plan(65536).chunk_tokens > 6016 * 4


@pytest.mark.parametrize("sizes,kw,match", [
    ((N, V), dict(mode="fast"), "mode='fast' is not known"),
    ((N, V), dict(max_logits_bytes=0), "max_logits_bytes=0 must be a positive"),
    ((N, V), dict(max_logits_bytes=-4096), "max_logits_bytes=-4096 must be a positive"),
    ((N, V), dict(logits_dtype="int32"), "logits_dtype=int32 must be float32"),
    ((-1, V), {}, "num_tokens=-1 must be >= 0"),
    ((N, 0), dict(mode="recompute"), "vocab=0 >= 1"),
])
def test_bad_options_raise(sizes, kw, match):
    with pytest.raises(ValueError, match=match):
        kernels.loss_head_plan(*sizes, **kw)


# -- segment_linear_cross_entropy runs the plan --------------------------------------------------

B, L, H, VOCAB = 2, 512, 32, 1000  # N = 1024 tokens
BLOCKS = kernels.LinearCrossEntropyBlockSizes(block_vocab=128)  # recompute holds [N, 128] blocks
ROW = 4 * VOCAB  # bytes of one token's f32 logits
CASES = [  # budget -> the plan auto takes
    (B * L * ROW, Plan(Mode.LOGITS, B * L, B * L * ROW)),
    (B * L * ROW - 1, Plan(Mode.CHUNKED, 512, 512 * ROW)),  # 896 fit: 2 chunks of 512
    (LEAST * ROW - 1, Plan(Mode.RECOMPUTE, None, None)),
]


@functools.cache
def _loss(mode: str, budget: int):
    """Jitted (hidden, weight, targets, offsets, lengths, w) -> the outputs and the gradients
    in hidden and weight of loss + sum(w * per_segment_loss) (both cotangents)."""

    def f(hidden, weight, targets, offsets, lengths, w):
        def objective(hidden, weight):
            out = kernels.segment_linear_cross_entropy(
                hidden, weight, targets, offsets, lengths, normalize="segments", z_loss=1e-3,
                mode=mode, max_logits_bytes=budget, block_sizes=BLOCKS)
            return out[0] + jnp.sum(w * out[1]), out

        grads, out = jax.grad(objective, (0, 1), has_aux=True)(hidden, weight)
        return (*out, *grads)

    return jax.jit(f)


def _inputs():
    rng = np.random.default_rng(60)
    offsets, lengths = metadata([[(0, 200), (200, 300), (500, 10)], [(0, 512)]], 4)
    return (random_array(rng, (B, L, H), jnp.float32),
            random_array(rng, (H, VOCAB), jnp.float32, 0.5),
            rng.integers(0, VOCAB, size=(B, L)).astype(np.int32), offsets, lengths,
            random_array(rng, offsets.shape, jnp.float32, 0.1))


@pytest.mark.parametrize("budget,want", CASES, ids=[p.mode.value for _, p in CASES])
def test_the_call_runs_the_plan(budget, want):
    """auto's outputs and gradients are, bit for bit, those of the mode the plan names (with
    the same budget, so the same chunk); and its traced program holds the plan's chunk of
    logits at most (all N x V for logits, C x V for chunked, less than the least chunk's for
    recompute)."""
    plan = kernels.loss_head_plan(B * L, VOCAB, max_logits_bytes=budget)
    assert plan == want
    args = _inputs()
    auto, planned = run(_loss("auto", budget), *args), run(_loss(plan.mode.value, budget), *args)
    for name, a, b in zip(("loss", "per_segment_loss", "tokens", "dhidden", "dweight"), auto,
                          planned):
        np.testing.assert_array_equal(a, b, err_msg=name)
    spec = [jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype) for a in args]
    jaxpr = _loss("auto", budget).trace(*spec).jaxpr
    largest = max(int(np.prod(shape)) for shape, _ in jaxpr_values(jaxpr))
    if plan.chunk_tokens is None:
        assert largest < LEAST * VOCAB
    else:
        assert largest == plan.chunk_tokens * VOCAB == plan.logits_bytes // 4


def test_the_call_reads_the_plan_of_free_memory(monkeypatch):
    """Without a budget the call's chunk is the plan's for the free memory when traced."""
    n, vocab, dim = 1536, 1000, 16
    free = 3 * 768 * vocab * policy.held_bytes(4) // 2 + 64  # its two thirds: 768 tokens
    monkeypatch.setattr(policy, "free_device_bytes", lambda: free)
    plan = kernels.loss_head_plan(n, vocab)
    assert plan == Plan(Mode.CHUNKED, 768, 768 * vocab * 4)
    spec = (jax.ShapeDtypeStruct((1, n, dim), jnp.float32),
            jax.ShapeDtypeStruct((dim, vocab), jnp.float32),
            jax.ShapeDtypeStruct((1, n), jnp.int32), jax.ShapeDtypeStruct((1, 3), jnp.int32),
            jax.ShapeDtypeStruct((1, 3), jnp.int32))

    def f(h, w, t, o, m):
        return kernels.segment_linear_cross_entropy(h, w, t, o, m)[0]

    jaxpr = jax.jit(jax.value_and_grad(f, (0, 1))).trace(*spec).jaxpr
    assert max(int(np.prod(shape)) for shape, _ in jaxpr_values(jaxpr)) == 768 * vocab
