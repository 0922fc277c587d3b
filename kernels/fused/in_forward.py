"""The loss head's gradients computed in its forward, a chunk of tokens at a time: the "logits"
(one chunk) and "chunked" modes of segment_linear_cross_entropy, in XLA on any backend; the
chunk is the plan's (policy.py).

    head   hidden f[B, L, H], weight f[H, V], segment_weights f32[B, S], targets, counted, metadata
           -> (loss f32[], per_segment_loss f32[B, S], tokens i32[B, S])

The loss is the final scalar, so each token's weight in it is known before any backward: with
`a_s` the normalization of slot s (1 / counted tokens: "tokens"; 1 / (non-empty segments x the
segment's tokens): "segments"; 1: "none") and `u_s` its segment weight, token i of slot s counts
`c_i = u_s a_s` (0 uncounted), and `d loss / d lse_i = c_i (1 + 2 z_loss lse_i)`,
`d loss / d target_i = -c_i`. So, per chunk of C flattened tokens (Liger's FusedLinearCrossEntropy):

    z = softcap(x_c @ w)                         [C, V], the chunk's logits, all at once, stored
                                                 in logits_dtype (the inputs': bf16 halves the
                                                 bytes read and written, as materialized logits)
    lse, target logit                            f32[C]
    d = (c (1 + 2 z_loss lse) softmax(z) - c onehot) softcap'    cast to the input dtype
    dx_c = d @ w^T                               the chunk's rows of d hidden
    dw += x_c^T @ d                              f32[H, V], carried over the chunks (in
                                                 weight_grad_dtype: bf16 halves it)

6NHV FLOPs (as materialized logits) with C x V logits live; C = N is materialized logits that are
never stored. The first chunk's x_c^T @ d starts dw (no zeros written and read back), a scan
adds the others'; the first chunk takes what the scan's equal chunks leave (at most C), so no
token is padded. Worked example, N = 1000 tokens, V = 32768, f32 logits, budget 64 MiB:
C x V x 4 <= 64 MiB gives C <= 512 (a multiple of policy.CHUNK_MULTIPLE); two chunks of 500 tokens
round up to 512: a first chunk of 488 tokens, then a scan over one of 512.

custom_vjp with symbolic zeros: evaluated without differentiation it computes the values only;
its fwd computes values and gradients (d hidden only if hidden is perturbed, d weight only if
weight is); bwd scales them by the cotangent of `loss`. A cotangent of `per_segment_loss` (a user
differentiating per-segment or per-dataset sums) cannot be known in the forward: bwd adds its
part with the recomputing XLA backward (blockwise.backward, from the saved lse; 6NHV more).

Vocab-parallel (`vocab_axis`, inside shard_map, `w` this shard's columns, targets shifted to it):
each chunk's row max and exp-sum combine with a pmax and a psum before the softmax, so the
gradients use the global lse in the same pass; d hidden is each shard's partial sum (the caller
pcasts hidden to varying, whose transpose sums it). Under shard_map(check_vma=False) a shard's
cotangents arrive divided by the shard count, which no psum of the backward restores here, so
bwd sums them over the axis first (`InForward.unchecked`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero

from seqpack.kernels import reference
from seqpack.kernels.common import Normalize
from seqpack.kernels.fused.blockwise import backward, counted_rows, varying_carry, vocab_tiling
from seqpack.kernels.tpu import LinearCrossEntropyBlockSizes


@dataclasses.dataclass(frozen=True)
class InForward:
    """Static configuration (a custom_vjp nondiff argument)."""

    chunk: int
    normalize: Normalize
    z_loss: float
    softcap: float | None
    vocab_axis: str | None
    # shard_map(check_vma=False) hands each vocab shard its cotangents divided by the shard
    # count (autodiff's psums restore them; gradients formed in the forward meet none): bwd
    # sums them over vocab_axis first
    unchecked: bool = False
    # the recomputing backward of per_segment_loss cotangents (the XLA path's vocab block)
    fallback_block_vocab: int = LinearCrossEntropyBlockSizes.block_vocab
    logits_dtype: str = "float32"  # a chunk's logits as stored (rounded once, behind a barrier)
    weight_grad_dtype: str = "float32"  # d weight as carried over the chunks


def loss_scale(tokens: jax.Array, normalize: Normalize) -> jax.Array:  # i32[B, S] -> f32[B, S]
    """a_s: d loss / d per_segment_loss[s], from reference.normalize_loss itself (linear in the
    per-segment sums, so its gradient at 0 is each slot's weight)."""
    norm = functools.partial(reference.normalize_loss, per_segment_tokens=tokens,
                             normalize=normalize)
    return jax.grad(norm)(jnp.zeros(tokens.shape, jnp.float32))


def segment_tokens(counted, offsets, lengths) -> jax.Array:  # bool[B, L] -> i32[B, S]
    """Each slot's counted tokens (the per_segment_tokens output, the normalization's count)."""
    return reference.segment_sum(counted.astype(jnp.int32), offsets, lengths)


def finish(lse, tgt, counted, tokens, segment_weights, offsets, lengths, *, normalize, z_loss):
    """Per-token (lse, target logit) f32[B, L], tokens (segment_tokens) -> (loss,
    per_segment_loss, tokens): every mode's last step (plain jnp; the recompute mode
    differentiates through it)."""
    token_loss = jnp.where(counted, lse - tgt + z_loss * lse * lse, 0.0)
    per_segment_loss = reference.segment_sum(token_loss, offsets, lengths)
    weighted = per_segment_loss if segment_weights is None else segment_weights * per_segment_loss
    return reference.normalize_loss(weighted, tokens, normalize), per_segment_loss, tokens


def _chunk(x, t, c, w, cfg: InForward, want_dx: bool, want_dw: bool):
    """One chunk: x f[C, H] (uncounted rows zero), t i32[C] (this shard's columns), c f32[C]
    -> lse, tgt f32[C], dx x.dtype[C, H] | None, dw f32[H, V] | None."""
    z = jnp.dot(x, w, preferred_element_type=jnp.float32)
    if cfg.logits_dtype != "float32":  # stored narrow: the barrier keeps XLA from eliding the
        # rounding (excess precision), so the chunk's consumers read logits of this size; the
        # row max is of the stored values (rounding is monotonic), taken before the barrier so
        # that the matmul's fusion computes it and no pass re-reads the logits for it
        stored = z.astype(cfg.logits_dtype)
        stored, m = lax.optimization_barrier((stored, jnp.max(stored, axis=1)))
        z, m = stored.astype(jnp.float32), m.astype(jnp.float32)
    else:
        m = jnp.max(z, axis=1)
    if cfg.softcap is not None:  # increasing: the max of the capped logits is the capped max
        z, m = (cfg.softcap * jnp.tanh(a / cfg.softcap) for a in (z, m))
    onehot = lax.broadcasted_iota(jnp.int32, (1, w.shape[1]), 1) == t[:, None]
    if cfg.vocab_axis is not None:
        m = lax.pmax(m, cfg.vocab_axis)
    s = jnp.sum(jnp.exp(z - m[:, None]), axis=1)
    tgt = jnp.sum(jnp.where(onehot, z, 0.0), axis=1)
    if cfg.vocab_axis is not None:
        s, tgt = lax.psum((s, tgt), cfg.vocab_axis)
    lse = m + jnp.log(s)
    if not (want_dx or want_dw):
        return lse, tgt, None, None
    g = c * (1.0 + 2.0 * cfg.z_loss * lse)
    d = g[:, None] * jnp.exp(z - lse[:, None]) - jnp.where(onehot, c[:, None], 0.0)
    if cfg.softcap is not None:
        d = d * (1.0 - jnp.square(z / cfg.softcap))
    d = d.astype(x.dtype)
    dx = (lax.dot_general(d, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
          .astype(x.dtype) if want_dx else None)
    dw = (lax.dot_general(x, d, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
          if want_dw else None)
    return lse, tgt, dx, dw


def _sweep(cfg: InForward, hidden, weight, targets, counted, coef, want_dx=False, want_dw=False):
    """Every chunk -> lse, tgt f32[B, L], dx hidden.dtype[B, L, H], dw weight.dtype[H, V] (None
    when not wanted). A float32 weight beside narrower hidden (a master weight) is read in
    hidden's dtype, and its gradient, summed in float32, is returned unrounded. d weight is
    carried in cfg.weight_grad_dtype: each chunk's f32 product is added to the carry in f32 and
    the sum rounded to it (a narrow carry halves that [H, V] buffer, at an error growing with
    the chunk count)."""
    carry = jnp.dtype(cfg.weight_grad_dtype)

    def add(dw, dw_c):  # dw_c f32; XLA fuses this into the d weight matmul's output
        return (dw.astype(jnp.float32) + dw_c).astype(dw.dtype)

    batch, seq_len, dim = hidden.shape
    n, chunk = batch * seq_len, cfg.chunk
    x = counted_rows(hidden, counted)
    t, c = targets.reshape(n), jnp.where(counted, coef, 0.0).reshape(n)
    chunks = -(-n // chunk)
    first = n - (chunks - 1) * chunk  # in (0, chunk]: chunk is at least n / chunks
    body = functools.partial(_chunk, w=weight.astype(hidden.dtype), cfg=cfg, want_dx=want_dx,
                             want_dw=want_dw)
    if chunks == 1:
        lse, tgt, dx, dw = body(x, t, c)
        dw = None if dw is None else dw.astype(carry)
    else:  # the first chunk starts d weight (no zeros written and read), a scan does the rest
        def step(dw, xs):
            lse, tgt, dx, dw_c = body(*xs)
            return (None if dw is None else add(dw, dw_c)), (lse, tgt, dx)

        lse0, tgt0, dx0, dw = body(x[:first], t[:first], c[:first])
        if dw is not None:
            dw = varying_carry(dw.astype(carry), hidden, weight, targets, coef)
        xs = (x[first:].reshape(chunks - 1, chunk, dim), t[first:].reshape(chunks - 1, chunk),
              c[first:].reshape(chunks - 1, chunk))
        dw, rest = lax.scan(step, dw, xs)
        lse, tgt, dx = (None if r is None else jnp.concatenate([r0, r.reshape(-1, *r0.shape[1:])])
                        for r0, r in zip((lse0, tgt0, dx0), rest))
    lse, tgt = (a.reshape(batch, seq_len) for a in (lse, tgt))
    dx = None if dx is None else dx.reshape(hidden.shape)
    return lse, tgt, dx, None if dw is None else dw.astype(weight.dtype)


def _coefficients(tokens, segment_weights, counted, offsets, lengths, normalize):
    """tokens i32[B, S] -> (a_s f32[B, S], c_i f32[B, L])."""
    scale = loss_scale(tokens, normalize)
    per_token = reference.segment_broadcast(segment_weights * scale, offsets, lengths,
                                            seq_len=counted.shape[1])
    return scale, jnp.where(counted, per_token, 0.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def head(cfg: InForward, hidden, weight, segment_weights, targets, counted, offsets, lengths):
    """-> (loss, per_segment_loss, tokens); targets already this shard's (vocab_axis)."""
    lse, tgt, _, _ = _sweep(cfg, hidden, weight, targets, counted, jnp.zeros(counted.shape))
    return finish(lse, tgt, counted, segment_tokens(counted, offsets, lengths), segment_weights,
                  offsets, lengths, normalize=cfg.normalize, z_loss=cfg.z_loss)


def _head_fwd(cfg, hidden, weight, segment_weights, targets, counted, offsets, lengths):
    want_dx, want_dw = hidden.perturbed, weight.perturbed
    hidden, weight, segment_weights, targets, counted, offsets, lengths = (
        a.value for a in (hidden, weight, segment_weights, targets, counted, offsets, lengths))
    tokens = segment_tokens(counted, offsets, lengths)
    scale, coef = _coefficients(tokens, segment_weights, counted, offsets, lengths,
                                cfg.normalize)
    lse, tgt, dx, dw = _sweep(cfg, hidden, weight, targets, counted, coef, want_dx, want_dw)
    out = finish(lse, tgt, counted, tokens, segment_weights, offsets, lengths,
                 normalize=cfg.normalize, z_loss=cfg.z_loss)
    return out, (dx, dw, scale, out[1], hidden, weight, targets, counted, offsets, lengths, lse)


def _scaled(grad, g):  # grad * g in f32, back to grad's dtype
    return (grad.astype(jnp.float32) * g).astype(grad.dtype)


def _head_bwd(cfg, residuals, cotangents):
    dx, dw, scale, per_segment_loss, hidden, weight, targets, counted, offsets, lengths, lse = (
        residuals)
    g_loss, g_seg, _ = cotangents
    if cfg.unchecked:
        g_loss, g_seg = (g if isinstance(g, SymbolicZero) else lax.psum(g, cfg.vocab_axis)
                         for g in (g_loss, g_seg))
    d_hidden = d_weight = d_segw = None
    if not isinstance(g_loss, SymbolicZero):
        d_hidden = None if dx is None else _scaled(dx, g_loss)
        d_weight = None if dw is None else _scaled(dw, g_loss)
        d_segw = g_loss * scale * per_segment_loss
    if not isinstance(g_seg, SymbolicZero):  # recompute: sum g_seg[s] per_segment_loss[s]
        batch, seq_len = hidden.shape[:2]
        g_tok = jnp.where(counted, reference.segment_broadcast(
            g_seg.astype(jnp.float32), offsets, lengths, seq_len=seq_len), 0.0)
        flat = lambda a: a.reshape(batch * seq_len)  # noqa: E731
        st = vocab_tiling(cfg.fallback_block_vocab, weight.shape[1], cfg.softcap)
        rx, rw = backward(counted_rows(hidden, counted), weight.astype(hidden.dtype),
                          flat(targets), flat(lse), flat(g_tok * (1.0 + 2.0 * cfg.z_loss * lse)),
                          flat(-g_tok), st)
        rx, rw = rx.reshape(hidden.shape), rw.astype(weight.dtype)
        d_hidden = rx if d_hidden is None else d_hidden + rx
        d_weight = rw if d_weight is None else d_weight + rw
    return d_hidden, d_weight, d_segw, None, None, None, None


head.defvjp(_head_fwd, _head_bwd, symbolic_zeros=True)
