"""The Pallas paths of the fused loss head: the token-block schedule and the custom VJP around
either family's kernels (tpu/linear_cross_entropy.py, gpu/linear_cross_entropy.py).

Both families take `hidden` as is (`[B, L, H]`, uncounted rows never enter a sum) and a counted
mask, and return each token's lse and target logit (0 where not counted). The forward saves
the lse only; the backward recomputes the logits tile by tile.

Schedule, per row and token block of `bl` tokens: `live` (the block holds a counted token) and
`src` (the block itself when live, else the last live block before it, 0 before any), e.g.

    counted blocks   t=0 no   t=1 yes  t=2 no   t=3 no   t=4 yes
    live             0        1        0        0        1
    src              0        1        1        1        4
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from seqpack.kernels import gpu, tpu


@dataclasses.dataclass(frozen=True)
class Family:
    """Static configuration (a custom_vjp nondiff argument): exactly one of `tpu`, `gpu`."""

    tpu: tpu.LinearTiling | None = None
    gpu: gpu.LinearTiling | None = None


def block_schedule(counted: jax.Array, used: jax.Array, block: int):
    """counted bool[B, L], used i32[B] -> (used, live i32[B * T], src i32[B * T])."""
    batch, seq_len = counted.shape
    blocks = -(-seq_len // block)
    padded = jnp.pad(counted, ((0, 0), (0, blocks * block - seq_len)))
    live = padded.reshape(batch, blocks, block).any(axis=2)
    t = jnp.arange(blocks, dtype=jnp.int32)[None, :]
    src = lax.cummax(jnp.where(live, t, 0), axis=1)
    return used.astype(jnp.int32), live.astype(jnp.int32).reshape(-1), src.reshape(-1)


def _forward(x, w, targets, mask, meta, fam: Family):
    if fam.gpu is not None:
        return gpu.linear_forward(x, w, targets, mask, st=fam.gpu)
    lse, tgt = tpu.linear_forward(x, w, targets[:, :, None], mask[:, :, None], meta, st=fam.tpu)
    return lse[:, :, 0], tgt[:, :, 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def pallas_terms(x, w, targets, mask, meta, fam: Family):
    """x f[B, L, H], w f[H, V], targets i32[B, L], mask f32[B, L], meta (block_schedule) ->
    (lse, target logit) f32[B, L]."""
    return _forward(x, w, targets, mask, meta, fam)


def _pallas_terms_fwd(x, w, targets, mask, meta, fam):
    lse, tgt = _forward(x, w, targets, mask, meta, fam)
    return (lse, tgt), (x, w, targets, mask, meta, lse)


def _pallas_terms_bwd(fam, residuals, cotangents):
    x, w, targets, mask, meta, lse = residuals
    g_lse, g_tgt = (g.astype(jnp.float32) for g in cotangents)
    if fam.gpu is not None:
        dx, dw = gpu.linear_backward(x, w, targets, mask, lse, g_lse, g_tgt, st=fam.gpu)
    else:
        col = lambda a: a[:, :, None]  # noqa: E731
        dx, dw = tpu.linear_backward(x, w, col(targets), col(mask), col(lse), col(g_lse),
                                     col(g_tgt), meta, st=fam.tpu)
    return dx, dw, None, None, tuple(None for _ in meta)


pallas_terms.defvjp(_pallas_terms_fwd, _pallas_terms_bwd)
