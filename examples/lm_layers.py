"""Plain-JAX layers both example models share (examples/lm.py, examples/tiny_lm.py).

No flax here: examples/tiny_lm.py imports these and needs only jax and numpy (flax is the
optional `train` extra, which examples/lm.py needs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, w: jax.Array, *, eps: float = 1e-6) -> jax.Array:
    """x / rms(x) * w over the last axis, computed in f32 and returned in x's dtype (an f32 x
    is not cast: the same ops as the norm written in f32)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * w).astype(x.dtype)
