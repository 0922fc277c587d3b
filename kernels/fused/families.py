"""The Pallas paths of the fused loss head: its kernel families (FAMILIES, each wing's
LOSS_HEAD: tpu/linear_cross_entropy.py, gpu/linear_cross_entropy.py behind the LossHeadFamily
protocol), the token-block schedule and the custom VJP around the family that runs.

Every family takes `hidden` as is (`[B, L, H]`, uncounted rows never enter a sum) and a counted
mask, and returns each token's lse and target logit (0 where not counted). The forward saves
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
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax import lax

from seqpack.kernels import gpu, tpu
from seqpack.kernels.common import Family, Interpret, LossHeadTiling, Registry


class LossHeadFamily(Family, Protocol):
    """A kernel family of the loss head's "recompute" mode (`target`, `block_sizes`: common.Family).

    tiling: its static configuration for one call from its block sizes; forward: x f[B, L, H],
    w f[H, V], targets i32[B, L], mask f32[B, L], meta (block_schedule) -> (lse, target logit)
    f32[B, L]; backward: -> (dx, dw) from the lse and the two cotangents f32[B, L].
    """

    def tiling(self, seq_len: int, vocab: int, dim: int, blocks: Any, softcap: float | None,
               interpret: Interpret) -> LossHeadTiling: ...

    def forward(self, x, w, targets, mask, meta, st: Any) -> tuple[jax.Array, jax.Array]: ...

    def backward(self, x, w, targets, mask, meta, lse, g_lse, g_tgt,
                 st: Any) -> tuple[jax.Array, jax.Array]: ...


# auto's order within a platform: the first family that can run here is taken.
FAMILIES: Registry[LossHeadFamily] = Registry("segment_linear_cross_entropy",
                                              (tpu.LOSS_HEAD, gpu.LOSS_HEAD))


@dataclasses.dataclass(frozen=True)
class HeadCall:
    """Static configuration (a custom_vjp nondiff argument): the family that runs, its tiling."""

    family: LossHeadFamily
    tiling: LossHeadTiling


def block_schedule(counted: jax.Array, used: jax.Array, block: int):
    """counted bool[B, L], used i32[B] -> (used, live i32[B * T], src i32[B * T])."""
    batch, seq_len = counted.shape
    blocks = -(-seq_len // block)
    padded = jnp.pad(counted, ((0, 0), (0, blocks * block - seq_len)))
    live = padded.reshape(batch, blocks, block).any(axis=2)
    t = jnp.arange(blocks, dtype=jnp.int32)[None, :]
    src = lax.cummax(jnp.where(live, t, 0), axis=1)
    return used.astype(jnp.int32), live.astype(jnp.int32).reshape(-1), src.reshape(-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def pallas_terms(x, w, targets, mask, meta, call: HeadCall):
    """x f[B, L, H], w f[H, V], targets i32[B, L], mask f32[B, L], meta (block_schedule) ->
    (lse, target logit) f32[B, L]."""
    return call.family.forward(x, w, targets, mask, meta, call.tiling)


def _pallas_terms_fwd(x, w, targets, mask, meta, call):
    lse, tgt = call.family.forward(x, w, targets, mask, meta, call.tiling)
    return (lse, tgt), (x, w, targets, mask, meta, lse)


def _pallas_terms_bwd(call, residuals, cotangents):
    x, w, targets, mask, meta, lse = residuals
    g_lse, g_tgt = (g.astype(jnp.float32) for g in cotangents)
    dx, dw = call.family.backward(x, w, targets, mask, meta, lse, g_lse, g_tgt, call.tiling)
    return dx, dw, None, None, tuple(None for _ in meta)


pallas_terms.defvjp(_pallas_terms_fwd, _pallas_terms_bwd)
