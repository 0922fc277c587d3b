"""A decoder-only LM in plain JAX whose step trains on packed rows, or on padded ones.

One model definition for benchmarks/train_step.py, the examples and the tests: pre-norm blocks
(RMSNorm, multi-head attention with rotary positions, gated SiLU MLP), f32 parameters cast to
the compute dtype, an untied output projection. What differs between the ways to train is
only how attention and the loss see the rows:

    attention="seqpack"   kernels.segment_attention on the rows' offsets / lengths: each
                          segment its own example, only the blocks its segments need
    attention="splash"    splash attention (`[B, H, L, D]`, 512 blocks) with segment ids:
                          MaxText's way on packed rows; without ids (`segment_ids=False`),
                          plain causal attention over padded rows
    attention="reference" the jnp reference (any backend; tests)
    loss="fused"          kernels.segment_linear_cross_entropy (no `[B, L, V]` logits)
    loss="materialized"   logits = hidden @ W, f32 log-softmax (MaxText's way)

RoPE: "half" rotates the halves of each head (x[:D/2], x[D/2:]), "interleaved" the even and
odd lanes (GPT-J's x[0::2], x[1::2]). Positions are the rows' positions, restarting at 0 in
every segment, so a packed step computes what the same examples padded one per row compute.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from seqpack import kernels

Params = dict[str, jax.Array]


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
    attention: str = "seqpack"  # "seqpack" | "splash" | "reference"
    attention_layout: str = "blhd"  # what segment_attention is handed: "blhd" or "bhld"
    attention_block_sizes: kernels.AttentionBlockSizes | None = None
    segment_ids: bool = True  # splash: mask by segment (packed rows) or causal only (padded)
    loss: str = "fused"  # "fused" | "materialized"
    interpret: bool = False  # Pallas kernels in interpret mode (CPU tests)

    def __post_init__(self) -> None:
        choices = {"rope": ("half", "interleaved"), "attention": ("seqpack", "splash", "reference"),
                   "attention_layout": ("blhd", "bhld"), "loss": ("fused", "materialized")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {allowed}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (rotary positions)")


def init_params(key: jax.Array, cfg: LMConfig) -> Params:
    keys = iter(jax.random.split(key, 2 + 7 * cfg.layers))
    normal = lambda shape, fan_in: (fan_in ** -0.5) * jax.random.normal(  # noqa: E731
        next(keys), shape, jnp.float32)
    inner = cfg.heads * cfg.head_dim
    p = {"embed": normal((cfg.vocab, cfg.dim), 1.0) * 0.02,
         "out_norm": jnp.ones((cfg.dim,), jnp.float32),
         "unembed": normal((cfg.dim, cfg.vocab), cfg.dim)}
    for i in range(cfg.layers):
        p[f"l{i}.norm1"] = jnp.ones((cfg.dim,), jnp.float32)
        p[f"l{i}.norm2"] = jnp.ones((cfg.dim,), jnp.float32)
        for name in ("q", "k", "v"):
            p[f"l{i}.{name}"] = normal((cfg.dim, inner), cfg.dim)
        p[f"l{i}.o"] = normal((inner, cfg.dim), inner)
        p[f"l{i}.gate"] = normal((cfg.dim, cfg.mlp), cfg.dim)
        p[f"l{i}.up"] = normal((cfg.dim, cfg.mlp), cfg.dim)
        p[f"l{i}.down"] = normal((cfg.mlp, cfg.dim), cfg.mlp)
    return p


def _rms_norm(x: jax.Array, w: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (y * w).astype(x.dtype)


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


def splash_attention(q, k, v, segment_ids=None, *, interpret: bool = False) -> jax.Array:
    """MaxText's attention: splash on q, k, v [B, H, L, D] (grouped key / value heads repeated),
    causal, 512 blocks (MaxText's sa_block_* defaults), masked by segment_ids i32[B, L] when
    given (packed rows), causal alone without (padded rows); scale D^-0.5 on q."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    heads, seq_len = q.shape[1], q.shape[2]
    if heads != k.shape[1]:
        k, v = (jnp.repeat(x, heads // k.shape[1], axis=1) for x in (k, v))
    block = min(512, seq_len)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                              block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                              block_q_dq=block, block_kv_dq=block)
    mask = splash.MultiHeadMask([splash.CausalMask((seq_len, seq_len))] * heads)
    kernel = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                    interpret=interpret)
    q = q * q.shape[-1] ** -0.5
    if segment_ids is None:
        return jax.vmap(kernel)(q, k, v)
    return jax.vmap(kernel)(q, k, v, splash.SegmentIds(segment_ids, segment_ids))


def attention(x, p: Params, i: int, batch: dict, cfg: LMConfig) -> jax.Array:
    bsz, seq_len, _ = x.shape
    dt = jnp.dtype(cfg.dtype)
    proj = lambda name: (x @ p[f"l{i}.{name}"].astype(dt)).reshape(  # noqa: E731
        bsz, seq_len, cfg.heads, cfg.head_dim)
    q = rope(proj("q"), batch["positions"], cfg)
    k = rope(proj("k"), batch["positions"], cfg)
    v = proj("v")
    heads_second = lambda t: t.transpose(0, 2, 1, 3)  # noqa: E731
    if cfg.attention == "splash":
        ids = batch["segment_ids"] if cfg.segment_ids else None
        o = heads_second(splash_attention(*map(heads_second, (q, k, v)), ids,
                                          interpret=cfg.interpret))
    elif cfg.attention == "reference":
        o = kernels.reference.segment_attention(q, k, v, batch["offsets"], batch["lengths"])
    elif cfg.attention_layout == "bhld":
        o = heads_second(kernels.segment_attention(
            *map(heads_second, (q, k, v)), batch["offsets"], batch["lengths"], layout="bhld",
            impl="auto", interpret=cfg.interpret, block_sizes=cfg.attention_block_sizes))
    else:
        o = kernels.segment_attention(q, k, v, batch["offsets"], batch["lengths"],
                                      interpret=cfg.interpret,
                                      block_sizes=cfg.attention_block_sizes)
    return o.reshape(bsz, seq_len, -1) @ p[f"l{i}.o"].astype(dt)


def hidden_states(p: Params, batch: dict, cfg: LMConfig) -> jax.Array:  # [B, L, dim]
    dt = jnp.dtype(cfg.dtype)
    x = p["embed"].astype(dt)[batch["tokens"]]
    for i in range(cfg.layers):
        x = x + attention(_rms_norm(x, p[f"l{i}.norm1"]), p, i, batch, cfg)
        h = _rms_norm(x, p[f"l{i}.norm2"])
        gate = jax.nn.silu(h @ p[f"l{i}.gate"].astype(dt))
        x = x + (gate * (h @ p[f"l{i}.up"].astype(dt))) @ p[f"l{i}.down"].astype(dt)
    return _rms_norm(x, p["out_norm"])


def loss_fn(p: Params, batch: dict, cfg: LMConfig) -> jax.Array:
    """Mean next-token loss over the counted tokens (targets >= 0; -100 is not counted)."""
    return losses(p, batch, cfg)[0]


def losses(p: Params, batch: dict, cfg: LMConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(loss_fn's mean loss, per-segment loss sums f32[B, S], per-segment counted tokens
    i32[B, S]): per-dataset losses are reductions of the last two
    (`kernels.segment_dataset_loss`); unused, they cost nothing under jit."""
    x = hidden_states(p, batch, cfg)
    w = p["unembed"].astype(x.dtype)
    targets = batch["targets"]
    if cfg.loss == "fused":
        return kernels.segment_linear_cross_entropy(
            x, w, targets, batch["offsets"], batch["lengths"], interpret=cfg.interpret)
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


def make_batch(tokens, segment_ids, positions, offsets, lengths) -> dict:
    """The model's batch from packed rows (numpy or jax arrays, [B, L] and [B, S]): next-token
    targets inside each segment, -100 on every segment's last token and on padding."""
    nxt = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    same = jnp.concatenate([segment_ids[:, 1:] == segment_ids[:, :-1],
                            jnp.zeros_like(segment_ids[:, :1], bool)], axis=1)
    targets = jnp.where(same & (segment_ids > 0), nxt.astype(jnp.int32), -100)
    return {"tokens": jnp.asarray(tokens, jnp.int32), "targets": targets,
            "segment_ids": jnp.asarray(segment_ids, jnp.int32),
            "positions": jnp.asarray(positions, jnp.int32),
            "offsets": jnp.asarray(offsets, jnp.int32), "lengths": jnp.asarray(lengths, jnp.int32)}


def bucket(n: int, *, min_width: int, seq_len: int) -> int:
    """The padded width of a row holding n tokens: min_width * 2^k >= n, at most seq_len."""
    width = min_width
    while width < n:
        width *= 2
    return min(width, seq_len)


def padded_rows(pieces: list, rows: int, width: int, dtype=np.int32) -> dict[str, np.ndarray]:
    """`pieces` (1-D token arrays, each at most `width`) one a row in `rows` rows of `width`:
    make_batch's arrays (numpy), one segment slot a row; rows past the pieces hold none."""
    out = {"tokens": np.zeros((rows, width), dtype),
           "segment_ids": np.zeros((rows, width), np.int32),
           "positions": np.zeros((rows, width), np.int32),
           "offsets": np.full((rows, 1), width, np.int32),
           "lengths": np.zeros((rows, 1), np.int32)}
    for r, piece in enumerate(pieces):
        n = len(piece)
        out["tokens"][r, :n] = piece
        out["segment_ids"][r, :n], out["positions"][r, :n] = 1, np.arange(n)
        out["offsets"][r, 0], out["lengths"][r, 0] = 0, n
    return out


def value_and_grad(cfg: LMConfig):
    """jit(value_and_grad(loss_fn)) for this configuration: (params, batch) -> (loss, grads)."""
    return jax.jit(jax.value_and_grad(functools.partial(loss_fn, cfg=cfg)))
