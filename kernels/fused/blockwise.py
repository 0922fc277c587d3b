"""The XLA path of the fused loss head: per-token lse and target logit of `x @ w`, never the logits.

    token_terms   x f[N, H], w f[H, V], targets i32[N] -> lse f32[N], target logit f32[N]

Forward: a `lax.scan` over vocabulary blocks of `block_vocab` columns keeps an online
log-sum-exp per token (running max `m`, rescaled sum `s`) and picks the target logit with an
iota compare; only `[N, block_vocab]` logits exist at a time. The custom VJP saves the lse alone
(x, w and targets are inputs) and the backward scans the blocks again, recomputing each one:

    z = softcap(x @ w_blk)     p = exp(z - lse)     da = (g_lse * p + g_tgt * onehot) * softcap'
    dx += da @ w_blk^T         dw_blk = x^T @ da    (both accumulated in f32)

so the FLOPs are 8NHV (forward 2, backward 6) against 6NHV for materialized logits. Columns past
V (the last block is padded with zero columns) are set to -inf *before* the exp (a `where`, never
a product with a mask), so p = 0 there and nothing of them reaches lse or a gradient. Rows of `x`
the caller zeroes (uncounted tokens) give finite lse = log V and receive g = 0.

Targets outside [0, V) match no column (their target logit is 0): that is how a vocab-parallel
shard sees the targets another shard owns. The per-token results are all the normalization,
z-loss and vocab-parallel combination need (kernels/fused/linear_cross_entropy.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from seqpack.kernels.common import LANES, round_up


@dataclasses.dataclass(frozen=True)
class Blockwise:
    """Static configuration (a custom_vjp nondiff argument)."""

    block_vocab: int
    logit_softcap: float | None


def vocab_tiling(block_vocab: int, vocab: int, softcap: float | None) -> Blockwise:
    """Blocks of block_vocab columns, or one of V rounded up to lanes where that is narrower."""
    return Blockwise(min(block_vocab, round_up(vocab, LANES)), softcap)


def counted_rows(hidden: jax.Array, counted: jax.Array) -> jax.Array:
    """hidden f[B, L, H], counted bool[B, L] -> x f[B * L, H], uncounted rows zero (a `where`:
    NaN there reaches nothing)."""
    x = jnp.where(counted[:, :, None], hidden, jnp.zeros((), hidden.dtype))
    return x.reshape(-1, hidden.shape[2])


def _pad_columns(w: jax.Array, block: int) -> jax.Array:
    pad = -w.shape[1] % block
    return jnp.pad(w, ((0, 0), (0, pad))) if pad else w


def _block_logits(x, wp, i, vocab: int, st: Blockwise):
    """(softcapped logits f32[N, bv] with -inf past V, the raw softcapped ones, column ids)."""
    bv = st.block_vocab
    w_blk = lax.dynamic_slice_in_dim(wp, i * bv, bv, axis=1)
    z = jnp.dot(x, w_blk, preferred_element_type=jnp.float32)
    if st.logit_softcap is not None:
        z = st.logit_softcap * jnp.tanh(z / st.logit_softcap)
    cols = i * bv + lax.broadcasted_iota(jnp.int32, (1, bv), 1)
    return jnp.where(cols < vocab, z, -jnp.inf), z, cols, w_blk


def varying_axes(a) -> frozenset:
    """The mesh axes `a` varies over inside shard_map (none elsewhere)."""
    manual = getattr(jax.typeof(a), "manual_axis_type", None)
    return frozenset() if manual is None else frozenset(manual.varying)


def varying_carry(tree, *like):
    """Loop carries varying over the mesh axes `like` varies over (inside shard_map, a scan's
    carries must say so; elsewhere, or already varying so, they come back unchanged)."""
    axes = set().union(*(varying_axes(a) for a in like))

    def cast(a):
        missing = tuple(sorted(axes - varying_axes(a)))
        return lax.pcast(a, missing, to="varying") if missing else a

    return jax.tree.map(cast, tree)


def _forward(x, w, targets, st: Blockwise):
    n, vocab = x.shape[0], w.shape[1]
    wp = _pad_columns(w, st.block_vocab)

    def step(carry, i):
        m, s, tgt = carry
        z, raw, cols, _ = _block_logits(x, wp, i, vocab, st)
        m_new = jnp.maximum(m, jnp.max(z, axis=1))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - m_new[:, None]), axis=1)
        tgt = tgt + jnp.sum(jnp.where(cols == targets[:, None], raw, 0.0), axis=1)
        return (m_new, s, tgt), None

    init = varying_carry((jnp.full((n,), -jnp.inf, jnp.float32), jnp.zeros((n,), jnp.float32),
                     jnp.zeros((n,), jnp.float32)), x, w, targets)
    (m, s, tgt), _ = lax.scan(step, init, jnp.arange(wp.shape[1] // st.block_vocab))
    return m + jnp.log(s), tgt


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def token_terms(x, w, targets, st: Blockwise):
    """x f[N, H], w f[H, V], targets i32[N] -> (lse f32[N], target logit f32[N])."""
    return _forward(x, w, targets, st)


def _token_terms_fwd(x, w, targets, st):
    lse, tgt = _forward(x, w, targets, st)
    return (lse, tgt), (x, w, targets, lse)


def backward(x, w, targets, lse, g_lse, g_tgt, st: Blockwise):
    """(dx x.dtype[N, H], dw w.dtype[H, V]) of sum(g_lse * lse + g_tgt * target logit), the
    logits recomputed block by block from `lse` (the global one, under vocab parallelism)."""
    vocab = w.shape[1]
    wp = _pad_columns(w, st.block_vocab)
    dtype = jnp.promote_types(x.dtype, w.dtype)

    def step(dx, i):
        z, raw, cols, w_blk = _block_logits(x, wp, i, vocab, st)
        p = jnp.exp(z - lse[:, None])  # 0 past V (z = -inf there)
        da = g_lse[:, None] * p + jnp.where(cols == targets[:, None], g_tgt[:, None], 0.0)
        if st.logit_softcap is not None:
            da = da * (1.0 - jnp.square(raw / st.logit_softcap))
        da = da.astype(dtype)
        dx = dx + jnp.dot(da, w_blk.T, preferred_element_type=jnp.float32)
        return dx, jnp.dot(x.T, da, preferred_element_type=jnp.float32)

    blocks = jnp.arange(wp.shape[1] // st.block_vocab)
    dx0 = varying_carry(jnp.zeros(x.shape, jnp.float32), x, w, targets, lse, g_lse, g_tgt)
    dx, dw = lax.scan(step, dx0, blocks)  # dw [nb, H, bv]
    dw = jnp.moveaxis(dw, 0, 1).reshape(w.shape[0], -1)[:, :vocab]
    return dx.astype(x.dtype), dw.astype(w.dtype)


def _token_terms_bwd(st, residuals, cotangents):
    x, w, targets, lse = residuals
    return (*backward(x, w, targets, lse, *cotangents, st), None)


token_terms.defvjp(_token_terms_fwd, _token_terms_bwd)
