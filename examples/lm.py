"""A decoder-only LM in flax (linen) whose step trains on packed rows, or on padded ones.

One model definition for benchmarks/train_step.py, the examples and the tests: pre-norm blocks
(RMSNorm, multi-head attention with rotary positions, gated SiLU MLP), f32 parameters cast to
the compute dtype, an untied output projection. What differs between the ways to train is
only how attention and the loss see the rows:

    attention="seqpack"   kernels.segment_attention on the rows' offsets / lengths: each
                          segment its own example, only the blocks its segments need
    attention="splash"    splash attention (`[B, H, L, D]`, 512 blocks) with segment ids:
                          MaxText's way on packed rows (a TPU); without ids
                          (`segment_ids=False`), plain causal attention over padded rows
    attention="masked"    MaxText's way on a GPU: a flash kernel masking the segments
                          (examples/masked.py)
    attention="cudnn"     cuDNN: packed rows through segment_attention(impl="cudnn"); padded
                          rows (`segment_ids=False`) with each row's sequence length
    attention="reference" the jnp reference (any backend; tests)
    loss="fused"          kernels.segment_linear_cross_entropy (no `[B, L, V]` logits)
    loss="materialized"   logits = hidden @ W, f32 log-softmax (MaxText's way)

RoPE: "half" rotates the halves of each head (x[:D/2], x[D/2:]), "interleaved" the even and
odd lanes (GPT-J's x[0::2], x[1::2]). Positions are the rows' positions, restarting at 0 in
every segment, so a packed step computes what the same examples padded one per row compute.
The batch (`make_batch`, and `bucket` / `padded_rows` for padded rows) is examples/lm_data.py's,
and the RMS norm examples/lm_layers.py's (shared with examples/tiny_lm.py); all are importable
from here as before.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from examples.lm_data import bucket as bucket  # noqa: F401  (public here: benchmarks, tests)
from examples.lm_data import make_batch
from examples.lm_data import padded_rows as padded_rows  # noqa: F401
from examples.lm_layers import rms_norm
from examples.masked import masked_attention
from examples.splash import splash_attention
from seqpack import kernels

ATTENTION = ("seqpack", "splash", "masked", "cudnn", "reference")
Params = dict  # flax's nested dict of f32 arrays: {"embed": ..., "block0": {"q": {"kernel": ...}}}


@dataclasses.dataclass(frozen=True)
class LMConfig:
    vocab: int = 32768
    dim: int = 1024
    heads: int = 8
    head_dim: int = 128
    mlp: int = 4096
    layers: int = 4
    rope: str = "half"  # "half" | "interleaved"
    rope_theta: float = 10_000.0
    dtype: str = "bfloat16"  # compute dtype; parameters stay f32
    attention: str = "seqpack"  # "seqpack" | "splash" | "masked" | "cudnn" | "reference"
    attention_layout: str = "blhd"  # what segment_attention is handed: "blhd" or "bhld"
    attention_block_sizes: kernels.AttentionBlockSizes | None = None
    segment_ids: bool = True  # splash: mask by segment (packed rows) or causal only (padded)
    loss: str = "fused"  # "fused" | "materialized"
    loss_logits_dtype: str | None = None  # fused: segment_linear_cross_entropy's logits_dtype
    interpret: bool = False  # Pallas kernels in interpret mode (CPU tests)

    def __post_init__(self) -> None:
        choices = {"rope": ("half", "interleaved"), "attention": ATTENTION,
                   "attention_layout": ("blhd", "bhld"), "loss": ("fused", "materialized")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {allowed}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (rotary positions)")


def rope(x: jax.Array, positions: jax.Array, cfg: LMConfig) -> jax.Array:
    """Rotary positions on x [B, L, N, D] at positions int[B, L] (cfg.rope: which lanes pair)."""
    half = cfg.head_dim // 2
    freq = cfg.rope_theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32)[:, :, None, None] * freq  # [B, L, 1, D/2]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x32 = x.astype(jnp.float32)
    if cfg.rope == "half":
        a, b = x32[..., :half], x32[..., half:]
        out = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    else:
        a, b = x32[..., 0::2], x32[..., 1::2]
        out = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(x.shape)
    return out.astype(x.dtype)


def attend(q, k, v, batch: dict, cfg: LMConfig) -> jax.Array:
    """Attention of q, k, v [B, L, N, D] (rotated) as cfg.attention says -> [B, L, N, D]."""
    heads_second = lambda t: t.transpose(0, 2, 1, 3)  # noqa: E731
    if cfg.attention == "splash":
        ids = batch["segment_ids"] if cfg.segment_ids else None
        return heads_second(splash_attention(*map(heads_second, (q, k, v)), ids,
                                             interpret=cfg.interpret))
    if cfg.attention == "reference":
        return kernels.reference.segment_attention(q, k, v, batch["offsets"], batch["lengths"])
    if cfg.attention == "masked":
        return masked_attention(q, k, v, batch["segment_ids"], interpret=cfg.interpret)
    if cfg.attention == "cudnn" and not cfg.segment_ids:  # padded rows: one sequence a row
        n = batch["lengths"][:, 0]
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=n,
                                            key_value_seq_lengths=n, implementation="cudnn")
    if cfg.attention == "cudnn":
        return kernels.segment_attention(q, k, v, batch["offsets"], batch["lengths"],
                                         impl="cudnn")
    schedule = batch.get("attention_schedule")  # LM.__call__'s, one for every layer
    if cfg.attention_layout == "bhld":
        return heads_second(kernels.segment_attention(
            *map(heads_second, (q, k, v)), batch["offsets"], batch["lengths"], layout="bhld",
            impl="auto", interpret=cfg.interpret, block_sizes=cfg.attention_block_sizes,
            schedule=schedule))
    return kernels.segment_attention(q, k, v, batch["offsets"], batch["lengths"],
                                     interpret=cfg.interpret,
                                     block_sizes=cfg.attention_block_sizes, schedule=schedule)


def attention_schedule(batch: dict, cfg: LMConfig, batch_size: int, seq_len: int):
    """segment_attention's block schedule for this batch, made once for all the layers (None
    where attention is not seqpack's, or its family takes none)."""
    if cfg.attention != "seqpack":
        return None
    shape = (batch_size, seq_len, cfg.heads, cfg.head_dim)
    if cfg.attention_layout == "bhld":
        shape = (batch_size, cfg.heads, seq_len, cfg.head_dim)
    qk = jax.ShapeDtypeStruct(shape, jnp.dtype(cfg.dtype))
    return kernels.segment_attention_schedule(
        qk, qk, batch["offsets"], batch["lengths"], layout=cfg.attention_layout,
        interpret=cfg.interpret, block_sizes=cfg.attention_block_sizes)


def _dense(features: int, fan_in: int, cfg: LMConfig, name: str) -> nn.Dense:
    """A bias-free projection: f32 kernel ~ N(0, 1 / fan_in), computed in cfg.dtype."""
    return nn.Dense(features, use_bias=False, dtype=jnp.dtype(cfg.dtype),
                    param_dtype=jnp.float32, kernel_init=nn.initializers.normal(fan_in ** -0.5),
                    name=name)


class RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.param("scale", nn.initializers.ones, (x.shape[-1],),
                                       jnp.float32))


class Block(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then x + gated SiLU MLP(norm(x))."""

    cfg: LMConfig

    @nn.compact
    def __call__(self, x: jax.Array, batch: dict) -> jax.Array:
        cfg = self.cfg
        bsz, seq_len, _ = x.shape
        inner = cfg.heads * cfg.head_dim
        h = RMSNorm(name="norm1")(x)
        heads = lambda t: t.reshape(bsz, seq_len, cfg.heads, cfg.head_dim)  # noqa: E731
        q = rope(heads(_dense(inner, cfg.dim, cfg, "q")(h)), batch["positions"], cfg)
        k = rope(heads(_dense(inner, cfg.dim, cfg, "k")(h)), batch["positions"], cfg)
        v = heads(_dense(inner, cfg.dim, cfg, "v")(h))
        o = attend(q, k, v, batch, cfg).reshape(bsz, seq_len, inner)
        x = x + _dense(cfg.dim, inner, cfg, "o")(o)
        h = RMSNorm(name="norm2")(x)
        gate = jax.nn.silu(_dense(cfg.mlp, cfg.dim, cfg, "gate")(h))
        up = _dense(cfg.mlp, cfg.dim, cfg, "up")(h)
        return x + _dense(cfg.dim, cfg.mlp, cfg, "down")(gate * up)


class LM(nn.Module):
    """The decoder: __call__(batch) -> (mean loss, per-segment loss sums f32[B, S], per-segment
    counted tokens i32[B, S]); per-dataset losses are reductions of the last two
    (`kernels.segment_dataset_loss`); unused, they cost nothing under jit."""

    cfg: LMConfig

    @nn.compact
    def __call__(self, batch: dict) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg = self.cfg
        dt = jnp.dtype(cfg.dtype)
        embed = self.param("embed", nn.initializers.normal(0.02), (cfg.vocab, cfg.dim),
                           jnp.float32)
        x = embed.astype(dt)[batch["tokens"]]  # a gather (nn.Embed's take adds bounds checks)
        layers = {**batch, "attention_schedule": attention_schedule(batch, cfg, *x.shape[:2])}
        for i in range(cfg.layers):
            x = Block(cfg, name=f"block{i}")(x, layers)
        x = RMSNorm(name="out_norm")(x)
        w = self.param("unembed", nn.initializers.normal(cfg.dim ** -0.5),
                       (cfg.dim, cfg.vocab), jnp.float32).astype(dt)
        return _loss_head(x, w, batch, cfg)


def _loss_head(x, w, batch: dict, cfg: LMConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    targets = batch["targets"]
    if cfg.loss == "fused":
        return kernels.segment_linear_cross_entropy(
            x, w, targets, batch["offsets"], batch["lengths"], interpret=cfg.interpret,
            logits_dtype=cfg.loss_logits_dtype)
    logits = (x @ w).astype(jnp.float32)
    counted = targets >= 0
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, jnp.where(counted, targets, 0)[..., None], -1)[..., 0]
    per_token = jnp.where(counted, lse - picked, 0.0)
    loss = jnp.sum(per_token) / jnp.maximum(jnp.sum(counted), 1)
    per_segment = functools.partial(kernels.reference.segment_sum,
                                    segment_offsets=batch["offsets"],
                                    segment_lengths=batch["lengths"])
    return loss, per_segment(per_token), per_segment(counted.astype(jnp.int32))


@functools.partial(jax.jit, static_argnums=1)
def init_params(key: jax.Array, cfg: LMConfig) -> Params:
    """The model's parameters (a nested dict of f32 arrays); they do not depend on how attention
    and the loss are computed, so a two-token batch through the references makes them."""
    tiny = make_batch(jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2), jnp.int32),
                      jnp.arange(2)[None], jnp.zeros((1, 1), jnp.int32),
                      jnp.full((1, 1), 2, jnp.int32))
    plain = dataclasses.replace(cfg, attention="reference", loss="materialized", interpret=False)
    return LM(plain).init(key, tiny)["params"]


def losses(p: Params, batch: dict, cfg: LMConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(loss_fn's mean loss, per-segment loss sums, per-segment counted tokens): LM.__call__."""
    return LM(cfg).apply({"params": p}, batch)


def loss_fn(p: Params, batch: dict, cfg: LMConfig) -> jax.Array:
    """Mean next-token loss over the counted tokens (targets >= 0; -100 is not counted)."""
    return losses(p, batch, cfg)[0]


def param_count(p: Params) -> int:
    return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(p))


def value_and_grad(cfg: LMConfig):
    """jit(value_and_grad(loss_fn)) for this configuration: (params, batch) -> (loss, grads)."""
    return jax.jit(jax.value_and_grad(functools.partial(loss_fn, cfg=cfg)))
