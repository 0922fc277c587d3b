"""MaxText's attention on a GPU, the anchor seqpack's GPU benchmarks time against: a flash kernel
that masks cross-document pairs without skipping them. MaxText's `attention: flash` hands tokamax's
Triton kernel the dense [B, 1, L, L] segment mask; where tokamax does not import, jax's Pallas
GPU `mha` with segment ids (what MaxText ran before) stands in. Plain JAX, no flax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dense_segment_mask(segment_ids: jax.Array) -> jax.Array:
    """bool[B, 1, L, L]: query and key in the same segment (ids > 0); causality applied apart."""
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (same & (segment_ids[:, :, None] > 0))[:, None]


def tokamax_available() -> bool:
    try:
        import tokamax  # noqa: F401
    except ImportError:
        return False
    return True


def masked_attention(q, k, v, segment_ids, *, interpret: bool = False) -> jax.Array:
    """Causal attention of q [B, L, H, D], k / v [B, L, K, D] masked by segment_ids i32[B, L]
    (0: padding), every block computed; scale D^-0.5. tokamax's Triton kernel with the dense mask
    where it imports, else jax's Pallas GPU `mha` (grouped key / value heads repeated)."""
    if tokamax_available() and not interpret:
        import tokamax

        return tokamax.dot_product_attention(q, k, v, mask=dense_segment_mask(segment_ids),
                                             is_causal=True, implementation="triton")
    from jax.experimental.pallas.ops.gpu import attention as jax_attention

    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    return jax_attention.mha(q, k, v, segment_ids, sm_scale=q.shape[-1] ** -0.5, causal=True,
                             interpret=interpret)
