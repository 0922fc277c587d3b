"""A tiny decoder-only transformer in plain JAX that trains on packed rows.

Each packed segment is its own example: attention is causal *within* a segment (segment ids),
positions restart per segment (the packed rows' positions), and the loss comes from
`kernels.segment_cross_entropy` with next-token targets that never cross a segment boundary.
Parameters are a flat dict of arrays; the optimizer is a small Adam, so the example needs
nothing beyond jax and numpy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from seqpack import kernels


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int = 256
    dim: int = 128
    heads: int = 4
    layers: int = 4
    mlp: int = 512
    max_len: int = 256  # positions are < max_len (the packed seq_len)


def init_params(key: jax.Array, cfg: ModelConfig) -> dict[str, jax.Array]:
    keys = iter(jax.random.split(key, 4 + 4 * cfg.layers))
    normal = lambda shape, scale: scale * jax.random.normal(next(keys), shape, jnp.float32)  # noqa: E731
    p = {
        "embed": normal((cfg.vocab, cfg.dim), 0.02),
        "pos_embed": normal((cfg.max_len, cfg.dim), 0.02),
        "out_norm": jnp.ones((cfg.dim,), jnp.float32),
    }
    for i in range(cfg.layers):
        p[f"l{i}.norm1"] = jnp.ones((cfg.dim,), jnp.float32)
        p[f"l{i}.norm2"] = jnp.ones((cfg.dim,), jnp.float32)
        p[f"l{i}.qkv"] = normal((cfg.dim, 3 * cfg.dim), cfg.dim**-0.5)
        p[f"l{i}.proj"] = normal((cfg.dim, cfg.dim), cfg.dim**-0.5 / (2 * cfg.layers) ** 0.5)
        p[f"l{i}.up"] = normal((cfg.dim, cfg.mlp), cfg.dim**-0.5)
        p[f"l{i}.down"] = normal((cfg.mlp, cfg.dim), cfg.mlp**-0.5 / (2 * cfg.layers) ** 0.5)
    return p


def _rms_norm(x: jax.Array, w: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * w


def attention_mask(segment_ids: jax.Array) -> jax.Array:  # i32[B, L] -> bool[B, 1, L, L]
    """Causal within a segment; a padding token sees only itself (keeps softmax finite)."""
    L = segment_ids.shape[-1]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    causal = jnp.tril(jnp.ones((L, L), bool))
    real = (segment_ids > 0)[:, :, None]
    eye = jnp.eye(L, dtype=bool)
    return ((same & causal & real) | eye)[:, None]


def forward(
    params: dict[str, jax.Array],
    tokens: jax.Array,  # i32[B, L]
    segment_ids: jax.Array,  # i32[B, L]
    positions: jax.Array,  # i32[B, L]
    cfg: ModelConfig,
) -> jax.Array:  # f32[B, L, V]
    B, L = tokens.shape
    hd = cfg.dim // cfg.heads
    x = params["embed"][tokens] + params["pos_embed"][positions]
    mask = attention_mask(segment_ids)
    for i in range(cfg.layers):
        h = _rms_norm(x, params[f"l{i}.norm1"])
        q, k, v = jnp.split(h @ params[f"l{i}.qkv"], 3, axis=-1)
        q, k, v = (t.reshape(B, L, cfg.heads, hd).transpose(0, 2, 1, 3) for t in (q, k, v))
        scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) * hd**-0.5
        scores = jnp.where(mask, scores, -jnp.inf)
        att = jax.nn.softmax(scores, axis=-1)
        o = jnp.einsum("bhqk,bhkd->bhqd", att, v).transpose(0, 2, 1, 3).reshape(B, L, cfg.dim)
        x = x + o @ params[f"l{i}.proj"]
        h = _rms_norm(x, params[f"l{i}.norm2"])
        x = x + jax.nn.gelu(h @ params[f"l{i}.up"]) @ params[f"l{i}.down"]
    x = _rms_norm(x, params["out_norm"])
    return x @ params["embed"].T


def next_token_targets(tokens: jax.Array, segment_ids: jax.Array):
    """Targets = the next token; counted only where the next token is in the same segment."""
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    nxt = jnp.concatenate([segment_ids[:, 1:], jnp.zeros_like(segment_ids[:, :1])], axis=1)
    return targets, (segment_ids > 0) & (nxt == segment_ids)


def loss_fn(params, batch: dict, cfg: ModelConfig, *, normalize: str = "tokens",
            feature: str = "tokens"):
    """(loss, (per_segment_loss [B, S], per_segment_tokens [B, S])) for a packed batch."""
    tokens = jnp.asarray(batch[feature], jnp.int32)
    seg = jnp.asarray(batch[f"{feature}_segment_ids"])
    logits = forward(params, tokens, seg, jnp.asarray(batch[f"{feature}_positions"]), cfg)
    targets, mask = next_token_targets(tokens, seg)
    loss, per_seg, count = kernels.segment_cross_entropy(
        logits, targets, jnp.asarray(batch[f"{feature}_segment_offsets"]),
        jnp.asarray(batch[f"{feature}_segment_lengths"]), normalize=normalize, loss_mask=mask,
    )
    return loss, (per_seg, count)


# -- a small Adam ----------------------------------------------------------------------------
def adam_init(params):
    zeros = {k: jnp.zeros_like(v) for k, v in params.items()}
    return {"m": zeros, "v": dict(zeros), "t": jnp.zeros((), jnp.int32)}


def adam_update(params, grads, state, *, lr=3e-3, b1=0.9, b2=0.98, eps=1e-9):
    t = state["t"] + 1
    m = {k: b1 * state["m"][k] + (1 - b1) * g for k, g in grads.items()}
    v = {k: b2 * state["v"][k] + (1 - b2) * g * g for k, g in grads.items()}
    c1, c2 = 1 - b1 ** t.astype(jnp.float32), 1 - b2 ** t.astype(jnp.float32)
    new = {k: p - lr * (m[k] / c1) / (jnp.sqrt(v[k] / c2) + eps) for k, p in params.items()}
    return new, {"m": m, "v": v, "t": t}


def make_train_step(cfg: ModelConfig, *, normalize: str = "tokens", lr: float = 3e-3):
    @jax.jit
    def step(params, opt_state, batch):
        (loss, (_, count)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, batch, cfg, normalize=normalize)
        params, opt_state = adam_update(params, grads, opt_state, lr=lr)
        return params, opt_state, loss, count.sum()

    return step


def flatten_state(params, opt_state) -> dict[str, np.ndarray]:
    out = {f"p/{k}": np.asarray(v) for k, v in params.items()}
    out |= {f"m/{k}": np.asarray(v) for k, v in opt_state["m"].items()}
    out |= {f"v/{k}": np.asarray(v) for k, v in opt_state["v"].items()}
    out["t"] = np.asarray(opt_state["t"])
    return out


def unflatten_state(arrays) -> tuple[dict, dict]:
    pick = lambda pre: {k[2:]: jnp.asarray(arrays[k]) for k in arrays if k.startswith(pre)}  # noqa: E731
    return pick("p/"), {"m": pick("m/"), "v": pick("v/"), "t": jnp.asarray(arrays["t"])}
