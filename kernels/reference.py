"""Pure-jnp references of the segment kernels (`jax.ops.segment_sum` style); XLA on any backend.

The attention reference at the end is dense: a [B, L, L] mask from the same slot-of-token map.

Each token is mapped to its slot (or to a dump bucket `S` for padding), then an XLA segment op
reduces over the flattened `B * (S + 1)` buckets. Worked example, one row, L = 8, S = 3:

    tokens              a  b  c  _  d  e  _  _      (_ = padding, e.g. an alignment gap)
    segment_offsets     [0, 4, 6]
    segment_lengths     [3, 2, 0]                    (slot 2 unused: offset = used length 6)
    slot of each token  0  0  0  3  1  1  3  3      (3 = dump bucket, dropped after the sum)
    segment_sum         [a+b+c, d+e, 0]

Reductions accumulate in float32 and return the input dtype, as the Pallas kernels do. These
functions are differentiable by plain autodiff and are what the kernel tests compare against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from seqpack.kernels.common import (
    Normalize,
    gather_offset,
    parse_enum,
    per_slot,
    target_position,
)


def segment_index(
    segment_offsets: jax.Array,  # int[B, S]
    segment_lengths: jax.Array,  # int[B, S]
    seq_len: int,
) -> jax.Array:  # i32[B, L]
    """Slot of every token, S on padding (tokens covered by no segment)."""
    member = _members(segment_offsets, segment_lengths, seq_len)
    num_segments = segment_offsets.shape[1]
    return jnp.where(member.any(-1), jnp.argmax(member, -1), num_segments).astype(jnp.int32)


def _members(segment_offsets, segment_lengths, seq_len: int) -> jax.Array:  # bool[B, L, S]
    pos = jnp.arange(seq_len, dtype=jnp.int32)[None, :, None]
    start = segment_offsets.astype(jnp.int32)[:, None, :]
    end = start + segment_lengths.astype(jnp.int32)[:, None, :]
    return (pos >= start) & (pos < end)


def _bucket_reduce(op, x, segment_offsets, segment_lengths):
    """op(data [B*L, ...], ids, num_segments) over the B * (S + 1) buckets -> [B, S, ...]."""
    batch, seq_len = x.shape[:2]
    num_segments = segment_offsets.shape[1]
    ids = segment_index(segment_offsets, segment_lengths, seq_len)
    ids = ids + (num_segments + 1) * jnp.arange(batch, dtype=jnp.int32)[:, None]
    flat = x.reshape(batch * seq_len, *x.shape[2:])
    out = op(flat, ids.reshape(-1), num_segments=batch * (num_segments + 1))
    return out.reshape(batch, num_segments + 1, *x.shape[2:])[:, :num_segments]


def _segment_totals(x, segment_offsets, segment_lengths):  # f[B, L(, D)] -> f32[B, S(, D)]
    if x.ndim == 2:  # a masked sum over [B, L, S], fused: no scatter (a TPU serializes those)
        member = _members(segment_offsets, segment_lengths, x.shape[1])
        return jnp.sum(jnp.where(member, x.astype(jnp.float32)[:, :, None], 0.0), axis=1)
    return _bucket_reduce(jax.ops.segment_sum, x.astype(jnp.float32), segment_offsets,
                          segment_lengths)


def out_of_vocab(
    per_segment_loss: jax.Array,  # f32[B, S]
    targets: jax.Array,  # int[B, L]
    counted: jax.Array,  # bool[B, L]
    segment_offsets: jax.Array,  # int[B, S]
    segment_lengths: jax.Array,  # int[B, S]
    vocab: int | jax.Array,
) -> jax.Array:  # f32[B, S]
    """per_segment_loss with NaN in every segment holding a counted target >= vocab: an id the
    logits lack (a vocabulary mismatch) shows the same under every impl, never a made-up
    loss."""
    bad = (counted & (targets >= vocab)).astype(jnp.float32)
    return jnp.where(_segment_totals(bad, segment_offsets, segment_lengths) > 0, jnp.nan,
                     per_segment_loss)


def mean_of_sums(
    totals: jax.Array,  # f32[B, S] or f32[B, S, D], per-segment sums
    segment_lengths: jax.Array,  # int[B, S]
) -> jax.Array:  # f32, like totals
    """Per-segment sums divided by the segment lengths; 0 for empty slots (length <= 0)."""
    count = jnp.maximum(segment_lengths, 1).astype(jnp.float32)
    return totals / per_slot(count, totals.ndim)


def segment_sum(
    x: jax.Array,  # f[B, L] or f[B, L, D]
    segment_offsets: jax.Array,  # int[B, S]
    segment_lengths: jax.Array,  # int[B, S]
) -> jax.Array:  # f[B, S] or f[B, S, D]
    """Sum of each segment's tokens; 0 for empty slots."""
    return _segment_totals(x, segment_offsets, segment_lengths).astype(x.dtype)


def segment_mean(
    x: jax.Array,  # f[B, L] or f[B, L, D]
    segment_offsets: jax.Array,  # int[B, S]
    segment_lengths: jax.Array,  # int[B, S]
) -> jax.Array:  # f[B, S] or f[B, S, D]
    """Mean of each segment's tokens; 0 for empty slots."""
    totals = _segment_totals(x, segment_offsets, segment_lengths)
    return mean_of_sums(totals, segment_lengths).astype(x.dtype)


def segment_max(
    x: jax.Array,  # f[B, L] or f[B, L, D]
    segment_offsets: jax.Array,  # int[B, S]
    segment_lengths: jax.Array,  # int[B, S]
    *,
    fill_value: float = 0.0,
) -> jax.Array:  # f[B, S] or f[B, S, D]
    """Max of each segment's tokens; `fill_value` for empty slots (jax.ops.segment_max gives -inf).

    The gradient is split evenly between tied maxima (as for `jnp.max`).
    """
    out = _bucket_reduce(jax.ops.segment_max, x.astype(jnp.float32), segment_offsets,
                         segment_lengths)
    nonempty = per_slot(segment_lengths > 0, x.ndim)
    return jnp.where(nonempty, out, fill_value).astype(x.dtype)


def segment_gather(
    x: jax.Array,  # f[B, L] or f[B, L, D]
    segment_offsets: jax.Array,  # int[B, S]
    segment_lengths: jax.Array,  # int[B, S]
    *,
    position: str | int = "last",
) -> jax.Array:  # f[B, S] or f[B, S, D]
    """One token per segment ('first', 'last' or k-th, k < 0 from the end); 0 where absent."""
    k = gather_offset(position)
    pos, valid = target_position(segment_offsets.astype(jnp.int32),
                                 segment_lengths.astype(jnp.int32), k, x.shape[1])
    if x.ndim == 3:
        picked = jnp.take_along_axis(x, pos[:, :, None], axis=1)
        return jnp.where(valid[:, :, None], picked, 0).astype(x.dtype)
    return jnp.where(valid, jnp.take_along_axis(x, pos, axis=1), 0).astype(x.dtype)


def segment_broadcast(
    values: jax.Array,  # f[B, S] or f[B, S, D]
    segment_offsets: jax.Array,  # int[B, S]
    segment_lengths: jax.Array,  # int[B, S]
    *,
    seq_len: int,
) -> jax.Array:  # f[B, L] or f[B, L, D]
    """Each segment's value on each of its tokens, 0 on padding (the transpose of segment_sum)."""
    if values.ndim == 2:  # a masked sum over [B, L, S], fused: no gather, nor a scatter-add
        # in its transpose (a TPU serializes those)
        member = _members(segment_offsets, segment_lengths, seq_len)
        out = jnp.sum(jnp.where(member, values.astype(jnp.float32)[:, None, :], 0.0), axis=2)
        return out.astype(values.dtype)
    ids = segment_index(segment_offsets, segment_lengths, seq_len)
    # Through f32 so that the transpose (a scatter-add of the cotangent) accumulates in f32.
    padded = jnp.concatenate([values, jnp.zeros_like(values[:, :1])], axis=1).astype(jnp.float32)
    return jnp.take_along_axis(padded, ids[:, :, None], axis=1).astype(values.dtype)


def normalize_loss(
    per_segment_loss: jax.Array,  # f32[B, S]
    per_segment_tokens: jax.Array,  # int[B, S]
    normalize: Normalize | str,
) -> jax.Array:  # f32[]
    """One scalar loss from per-segment sums; an empty batch gives 0."""
    normalize = parse_enum(Normalize, "normalize", normalize)
    count = per_segment_tokens.astype(jnp.float32)
    if normalize is Normalize.TOKENS:
        return per_segment_loss.sum() / jnp.maximum(count.sum(), 1.0)
    if normalize is Normalize.SEGMENTS:
        nonempty = count > 0
        means = jnp.where(nonempty, per_segment_loss / jnp.maximum(count, 1.0), 0.0)
        return means.sum() / jnp.maximum(nonempty.sum().astype(jnp.float32), 1.0)
    return per_segment_loss.sum()


def segment_cross_entropy(
    logits: jax.Array,  # f[B, L, V]
    targets: jax.Array,  # int[B, L], values in [0, V)
    segment_offsets: jax.Array,  # int[B, S]
    segment_lengths: jax.Array,  # int[B, S]
    *,
    normalize: Normalize | str = "tokens",
    loss_mask: jax.Array | None = None,  # bool or 0/1 [B, L]
    z_loss: float = 0.0,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # f32[], f32[B, S], i32[B, S]
    """Cross-entropy per segment: (loss, per_segment_loss sums, per_segment_tokens counts).

    Token loss = logsumexp(logits) - logits[target] + z_loss * logsumexp^2, counted when the token
    lies in a segment, its target is >= 0 (-100: PyTorch's ignore_index) and loss_mask (if
    given) is set. A counted target >= V makes its segment's loss NaN.
    """
    batch, seq_len, _ = logits.shape
    num_segments = segment_offsets.shape[1]
    ids = segment_index(segment_offsets, segment_lengths, seq_len)
    counted = (ids < num_segments) & (targets >= 0)
    if loss_mask is not None:
        counted &= loss_mask.astype(bool)
    # Excluded tokens get zero logits *before* the math, so whatever they hold (even NaN) never
    # reaches the loss or the gradient (a `where` after the logsumexp would leak 0 * NaN).
    lf = jnp.where(counted[..., None], logits.astype(jnp.float32), 0.0)
    lse = jax.nn.logsumexp(lf, axis=-1)
    picked = jnp.maximum(targets, 0).astype(jnp.int32)[..., None]  # >= V: NaN (take's fill)
    target_logit = jnp.take_along_axis(lf, picked, axis=-1)[..., 0]
    token_loss = lse - target_logit + z_loss * lse * lse
    ids = jnp.where(counted, ids, num_segments)
    ids = (ids + (num_segments + 1) * jnp.arange(batch, dtype=jnp.int32)[:, None]).reshape(-1)
    buckets = batch * (num_segments + 1)

    def per_slot(values):
        out = jax.ops.segment_sum(values.reshape(-1), ids, num_segments=buckets)
        return out.reshape(batch, num_segments + 1)[:, :num_segments]

    per_segment_loss = out_of_vocab(per_slot(jnp.where(counted, token_loss, 0.0)), targets,
                                    counted, segment_offsets, segment_lengths, logits.shape[2])
    per_segment_tokens = per_slot(counted.astype(jnp.int32))
    loss = normalize_loss(per_segment_loss, per_segment_tokens, normalize)
    return loss, per_segment_loss, per_segment_tokens


def segment_attention(
    q: jax.Array,  # f[B, L, H, D]
    k: jax.Array,  # f[B, L, K, D], H % K == 0
    v: jax.Array,  # f[B, L, K, D]
    segment_offsets: jax.Array,  # int[B, S]
    segment_lengths: jax.Array,  # int[B, S]
    *,
    causal: bool = True,
    scale: float | None = None,
) -> jax.Array:  # f[B, L, H, D]
    """Dense masked attention in f32: each token over its own segment (causal: up to itself).

    Query head h uses key/value head h // (H / K); tokens outside every segment give 0. The
    [B, H, L, L] scores are materialized: a reference for tests, and the XLA baseline.
    """
    batch, seq_len, heads, dim = q.shape
    kv_heads = k.shape[2]
    num_segments = segment_offsets.shape[1]
    scale = dim**-0.5 if scale is None else scale
    ids = segment_index(segment_offsets, segment_lengths, seq_len)
    inside = ids < num_segments
    # Tokens outside segments are zeroed first, so whatever they hold (even NaN) reaches neither
    # the output nor a gradient (a masked score times a NaN value would still be NaN).
    zero = lambda x: jnp.where(inside[:, :, None, None], x, 0).astype(jnp.float32)  # noqa: E731
    qf = zero(q).reshape(batch, seq_len, kv_heads, heads // kv_heads, dim)
    kf, vf = zero(k), zero(v)
    mask = (ids[:, :, None] == ids[:, None, :]) & inside[:, :, None]  # [B, L(query), L(key)]
    if causal:
        mask &= jnp.tril(jnp.ones((seq_len, seq_len), bool))
    mask = mask[:, None, None]  # [B, 1, 1, L, L] against scores [B, K, G, L, L]
    s = jnp.einsum("bqkgd,bskd->bkgqs", qf, kf) * scale
    s = jnp.where(mask, s, -1e30)
    p = jnp.where(mask, jnp.exp(s - jax.lax.stop_gradient(s.max(-1, keepdims=True))), 0.0)
    total = p.sum(-1, keepdims=True)
    p = p / jnp.where(total > 0, total, 1.0)
    out = jnp.einsum("bkgqs,bskd->bqkgd", p, vf)
    return out.reshape(batch, seq_len, heads, dim).astype(q.dtype)
