"""MaxText's attention on a TPU: splash attention, causal, with segment ids on packed rows (the
anchor benchmarks/train_step.py and benchmarks/attention_bench.py time seqpack against). Plain
JAX, no flax: the kernel benchmark imports it alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
