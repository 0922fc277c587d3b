"""A tiny decoder-only transformer in plain JAX that trains on packed rows.

Each packed segment is its own example: attention is causal *within* a segment
(`kernels.segment_attention`, which computes only the blocks the row's segments need), positions
restart per segment (the packed rows' positions), and the loss comes from
`kernels.segment_cross_entropy` with next-token targets that never cross a segment boundary
(with `ModelConfig(fused_loss=True)`, `kernels.segment_linear_cross_entropy` on the last hidden
states and the tied embedding instead: the same loss without the `[B, L, V]` logits).
Both kernels take the rows' segment offsets and lengths; rows that carry only segment ids (Grain's
own packers, MaxText) get them from `kernels.segment_metadata` (see `batch_metadata`).
Parameters are a flat dict of arrays; the optimizer is a small Adam, so the example needs no
flax or optax. The RMS norm (examples/lm_layers.py) and the next-token targets
(examples/lm_data.py) are the ones examples/lm.py uses.

Context parallelism (`make_train_step(..., context_parallel=C)`): each row is split over C
devices in the load-balanced layout the training pipeline emits (`Batching(context_parallel=C)`),
attention is `segment_attention(..., context_parallel_axis="cp")` under `shard_map` (ring
attention over the row's segments), and the loss sums each rank's tokens per segment, then
`psum`s: `cp_batch` reads the next-token targets through the layout on the host first (the next
token of a chunk's last one is on another rank).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from examples.lm_data import next_token_targets
from examples.lm_layers import rms_norm
from seqpack import kernels, packer
from seqpack.kernels.common import Interpret

AttentionBlocks = kernels.AttentionBlockSizes | kernels.GpuAttentionBlockSizes


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int = 256
    dim: int = 128
    heads: int = 4
    layers: int = 4
    mlp: int = 512
    max_len: int = 256  # positions are < max_len (the packed seq_len)
    # kernels.segment_attention options: "auto" runs the Pallas kernels on TPU and GPU and the
    # jnp reference elsewhere; tests pass a Pallas family with `attention_interpret` on CPU.
    attention_impl: str = "auto"
    attention_interpret: Interpret = False
    attention_block_sizes: AttentionBlocks | None = None
    max_segments: int = 64  # for rows without offsets / lengths (see batch_metadata)
    context_parallel_axis: str | None = None  # set by make_train_step(context_parallel=C)
    # the loss head: kernels.segment_linear_cross_entropy on the last hidden states and the tied
    # embedding (no [B, L, V] logits; "auto": the Pallas kernels on TPU / GPU, XLA elsewhere)
    fused_loss: bool = False
    loss_impl: str = "auto"
    loss_interpret: Interpret = False


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


def attention(
    q: jax.Array,  # f32[B, L, H, hd]
    k: jax.Array,  # f32[B, L, H, hd]
    v: jax.Array,  # f32[B, L, H, hd]
    segment_offsets: jax.Array,  # i32[B, S]
    segment_lengths: jax.Array,  # i32[B, S]
    cfg: ModelConfig,
) -> jax.Array:  # f32[B, L, H, hd]
    """Causal attention within each segment; padding tokens get 0."""
    return kernels.segment_attention(q, k, v, segment_offsets, segment_lengths, causal=True,
                                     impl=cfg.attention_impl, interpret=cfg.attention_interpret,
                                     block_sizes=cfg.attention_block_sizes,
                                     context_parallel_axis=cfg.context_parallel_axis)


def hidden_states(
    params: dict[str, jax.Array],
    tokens: jax.Array,  # i32[B, L]
    positions: jax.Array,  # i32[B, L]
    segment_offsets: jax.Array,  # i32[B, S]
    segment_lengths: jax.Array,  # i32[B, S]
    cfg: ModelConfig,
) -> jax.Array:  # f32[B, L, dim], normalized: the logits are this @ embed.T
    B, L = tokens.shape
    hd = cfg.dim // cfg.heads
    x = params["embed"][tokens] + params["pos_embed"][positions]
    for i in range(cfg.layers):
        h = rms_norm(x, params[f"l{i}.norm1"])
        q, k, v = jnp.split(h @ params[f"l{i}.qkv"], 3, axis=-1)
        q, k, v = (t.reshape(B, L, cfg.heads, hd) for t in (q, k, v))
        o = attention(q, k, v, segment_offsets, segment_lengths, cfg).reshape(B, L, cfg.dim)
        x = x + o @ params[f"l{i}.proj"]
        h = rms_norm(x, params[f"l{i}.norm2"])
        x = x + jax.nn.gelu(h @ params[f"l{i}.up"]) @ params[f"l{i}.down"]
    return rms_norm(x, params["out_norm"])


def forward(params, tokens, positions, segment_offsets, segment_lengths,
            cfg: ModelConfig) -> jax.Array:  # f32[B, L, V]
    return hidden_states(params, tokens, positions, segment_offsets, segment_lengths,
                         cfg) @ params["embed"].T


def batch_metadata(batch: dict, cfg: ModelConfig, feature: str = "tokens"):
    """(segment_offsets, segment_lengths) i32[B, S]: the batch's own, or built from its segment ids
    (rows of Grain's packers carry only `<feature>_segment_ids`; S = cfg.max_segments)."""
    if f"{feature}_segment_offsets" in batch:
        return (jnp.asarray(batch[f"{feature}_segment_offsets"]),
                jnp.asarray(batch[f"{feature}_segment_lengths"]))
    return kernels.segment_metadata(jnp.asarray(batch[f"{feature}_segment_ids"]),
                                    max_segments=cfg.max_segments)


def loss_fn(params, batch: dict, cfg: ModelConfig, *, normalize: str = "tokens",
            feature: str = "tokens", labels: str | None = None):
    """(loss, (per_segment_loss [B, S], per_segment_tokens [B, S])) for a packed batch.

    `labels`: a label column packed with the tokens (SFT: -100 on the prompt); position p,
    which predicts token p + 1, takes a loss only where labels[p + 1] != -100 (the positions
    the batch's `loss_tokens` counts)."""
    tokens = jnp.asarray(batch[feature], jnp.int32)
    seg = jnp.asarray(batch[f"{feature}_segment_ids"])
    offsets, lengths = batch_metadata(batch, cfg, feature)
    hidden = hidden_states(params, tokens, jnp.asarray(batch[f"{feature}_positions"]), offsets,
                           lengths, cfg)
    targets, mask = next_token_targets(
        tokens, seg, None if labels is None else jnp.asarray(batch[labels]))
    if cfg.fused_loss:  # the projection inside the loss: the logits never exist
        loss, per_seg, count = kernels.segment_linear_cross_entropy(
            hidden, params["embed"].T, targets, offsets, lengths, normalize=normalize,
            loss_mask=mask, impl=cfg.loss_impl, interpret=cfg.loss_interpret)
    else:
        loss, per_seg, count = kernels.segment_cross_entropy(
            hidden @ params["embed"].T, targets, offsets, lengths, normalize=normalize,
            loss_mask=mask)
    return loss, (per_seg, count)


# -- context parallelism ----------------------------------------------------------------------
def cp_batch(batch: dict, context_parallel: int, *, feature: str = "tokens",
             labels: str | None = None) -> dict:
    """A host batch in the load-balanced layout plus its next-token "targets" and "loss_mask"
    (numpy [B, L], in the layout): the next token of row position p is at p + 1, found through
    the layout's order, counted where it is in the same segment (and its label is not -100)."""
    tokens, ids = np.asarray(batch[feature]), np.asarray(batch[f"{feature}_segment_ids"])
    L = tokens.shape[1]
    order = packer.context_parallel_order(batch[f"{feature}_segment_offsets"],
                                          batch[f"{feature}_segment_lengths"], seq_len=L,
                                          context_parallel=context_parallel)
    slot_of = np.argsort(order, axis=1)  # where each row position sits in the layout
    nxt = np.take_along_axis(slot_of, np.minimum(order + 1, L - 1), axis=1)
    mask = (ids > 0) & (np.take_along_axis(ids, nxt, axis=1) == ids) & (order + 1 < L)
    if labels is not None:
        mask &= np.take_along_axis(np.asarray(batch[labels]), nxt, axis=1) != -100
    return {**batch, "targets": np.take_along_axis(tokens, nxt, axis=1), "loss_mask": mask}


def cp_loss_fn(params, batch: dict, cfg: ModelConfig, *, normalize: str = "tokens",
               feature: str = "tokens"):
    """`loss_fn` on one rank's shard of a `cp_batch` (inside shard_map over
    cfg.context_parallel_axis): per-segment sums of the rank's tokens, psum'd over the ranks."""
    tokens = jnp.asarray(batch[feature], jnp.int32)
    offsets, lengths = batch_metadata(batch, cfg, feature)
    logits = forward(params, tokens, jnp.asarray(batch[f"{feature}_positions"]), offsets,
                     lengths, cfg).astype(jnp.float32)
    token_loss = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(
        logits, batch["targets"][..., None].astype(jnp.int32), axis=-1)[..., 0]
    mask = batch["loss_mask"].astype(bool)
    S = offsets.shape[1]
    slot = jnp.where(mask, batch[f"{feature}_segment_ids"] - 1, S)  # S: not counted
    rows = jnp.arange(tokens.shape[0])[:, None]
    sums = jnp.zeros((tokens.shape[0], S + 1), jnp.float32).at[rows, slot].add(
        jnp.where(mask, token_loss, 0.0))[:, :S]
    count = jnp.zeros((tokens.shape[0], S + 1), jnp.int32).at[rows, slot].add(mask)[:, :S]
    sums, count = jax.lax.psum((sums, count), cfg.context_parallel_axis)
    return kernels.reference.normalize_loss(sums, count, normalize), (sums, count)


def cp_mesh(context_parallel: int) -> jax.sharding.Mesh:
    """The mesh of the context-parallel ranks: axis "cp" over the first C devices."""
    from jax.sharding import AxisType

    if len(jax.devices()) < context_parallel:
        raise ValueError(f"context_parallel={context_parallel} needs that many devices, "
                         f"{len(jax.devices())} found (on a CPU: XLA_FLAGS="
                         f"--xla_force_host_platform_device_count={context_parallel})")
    return jax.make_mesh((context_parallel,), ("cp",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:context_parallel])


def cp_replicated(tree, context_parallel: int):
    """`tree` (parameters, optimizer state) replicated over the `cp_mesh`, as a context-parallel
    step returns them: the second step then runs the first one's compilation."""
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.device_put(tree, NamedSharding(cp_mesh(context_parallel), PartitionSpec()))


def cp_loss(cfg: ModelConfig, context_parallel: int, *, normalize: str = "tokens"):
    """(params, cp batch) -> (loss, (per-segment loss sums, tokens) [B, S]): `cp_loss_fn` with
    the batch's [B, L] arrays split over a mesh of `context_parallel` devices ("cp"), the rest
    replicated."""
    from jax.sharding import PartitionSpec

    mesh = cp_mesh(context_parallel)
    cfg = dataclasses.replace(cfg, context_parallel_axis="cp")

    def loss(params, batch):
        L = batch["targets"].shape[1]
        specs = {k: PartitionSpec(None, "cp") if v.ndim == 2 and v.shape[1] == L
                 else PartitionSpec() for k, v in batch.items()}
        return jax.shard_map(functools.partial(cp_loss_fn, cfg=cfg, normalize=normalize),
                             mesh=mesh, in_specs=(PartitionSpec(), specs),
                             out_specs=PartitionSpec())(params, batch)

    return loss


def cp_value_and_grad(cfg: ModelConfig, context_parallel: int, *, normalize: str = "tokens"):
    """(params, cp batch) -> ((loss, (per-segment loss, tokens)), grads) of `cp_loss`."""
    return jax.value_and_grad(cp_loss(cfg, context_parallel, normalize=normalize), has_aux=True)


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


def make_train_step(cfg: ModelConfig, *, normalize: str = "tokens", lr: float = 3e-3,
                    labels: str | None = None, micro_batches: int = 1,
                    context_parallel: int = 1):
    """A jitted Adam step. With `micro_batches` > 1 (and `normalize="tokens"`), the batch is cut
    into that many micro-batches whose summed losses and gradients are divided by the whole
    batch's `loss_tokens` (one global denominator: the per-token mean of the unpacked
    examples, whatever the split), as a data-parallel step divides by the psum of its ranks'.
    With `context_parallel` C > 1 each row is split over C devices: pass `cp_batch` batches."""
    if context_parallel > 1 and micro_batches > 1:
        raise ValueError("pass micro_batches=1 with context_parallel > 1")
    if context_parallel > 1 and cfg.fused_loss:
        raise ValueError("fused_loss runs on one device's rows: pass context_parallel=1")
    cp_grads = cp_value_and_grad(cfg, context_parallel, normalize=normalize) \
        if context_parallel > 1 else None

    def grads_of(params, batch):
        if cp_grads is not None:
            (loss, (_, count)), grads = cp_grads(params, batch)
            return loss, grads, count.sum()
        if micro_batches == 1:
            (loss, (_, count)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                params, batch, cfg, normalize=normalize, labels=labels)
            return loss, grads, count.sum()
        total = jnp.sum(batch["loss_tokens"]).astype(jnp.float32)
        summed = lambda p, mb: loss_fn(p, mb, cfg, normalize="none", labels=labels)  # noqa: E731
        loss, grads, count = 0.0, None, 0
        for part in _split(batch, micro_batches):
            (l_mb, (_, c_mb)), g_mb = jax.value_and_grad(summed, has_aux=True)(params, part)
            loss, count = loss + l_mb, count + c_mb.sum()
            grads = g_mb if grads is None else jax.tree.map(jnp.add, grads, g_mb)
        return loss / total, jax.tree.map(lambda g: g / total, grads), count

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads, count = grads_of(params, batch)
        params, opt_state = adam_update(params, grads, opt_state, lr=lr)
        return params, opt_state, loss, count

    return step


def _split(batch: dict, parts: int) -> list[dict]:
    """The batch's rows in `parts` consecutive micro-batches (per-row arrays only)."""
    B = next(iter(batch.values())).shape[0]
    if B % parts:
        raise ValueError(f"a batch of {B} rows does not split into {parts} micro-batches")
    n = B // parts
    return [{k: v[i * n : (i + 1) * n] for k, v in batch.items()} for i in range(parts)]


def flatten_state(params, opt_state) -> dict[str, np.ndarray]:
    out = {f"p/{k}": np.asarray(v) for k, v in params.items()}
    out |= {f"m/{k}": np.asarray(v) for k, v in opt_state["m"].items()}
    out |= {f"v/{k}": np.asarray(v) for k, v in opt_state["v"].items()}
    out["t"] = np.asarray(opt_state["t"])
    return out


def unflatten_state(arrays) -> tuple[dict, dict]:
    pick = lambda pre: {k[2:]: jnp.asarray(arrays[k]) for k in arrays if k.startswith(pre)}  # noqa: E731
    return pick("p/"), {"m": pick("m/"), "v": pick("v/"), "t": jnp.asarray(arrays["t"])}
