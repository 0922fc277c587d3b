"""A jnp stand-in for cuDNN's packed attention, so the cuDNN family's adapter runs on a CPU.

It reads memory as cuDNN does: jax's own `_fix_seqlen_offsets` turns the [B, M] metadata into
element offsets into the flattened q / k / v (so a JAX whose key offsets are wrong under GQA
reads the wrong keys here too), each sequence's rows are read at the tensors' per-token strides
from its offset, attention runs within it (causal from its start for PADDING_CAUSAL), and the
output is written back at the query offsets. What cuDNN leaves unwritten is NaN: the output's
rows of no sequence, and the gradients of q, k and v there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src.cudnn import fused_attention_stablehlo as fused
from jax._src.cudnn.fused_attention_stablehlo import MaskType


@jax.custom_vjp
def _poison(x, read):  # identity; NaN gradient where cuDNN read nothing
    return x


def _poison_fwd(x, read):
    return x, read


def _poison_bwd(read, g):
    return jnp.where(read, g, jnp.nan), None


_poison.defvjp(_poison_fwd, _poison_bwd)


def _index(offsets, rows: int, heads: int, dim: int):
    """Element indices [Q, T, N, D] of each sequence's rows from its element offset."""
    t = jnp.arange(rows)[:, None, None] * heads * dim
    n = jnp.arange(heads)[None, :, None] * dim
    return offsets[:, None, None, None] + t + n + jnp.arange(dim)[None, None, :]


def dot_product_attention(query, key, value, *, q_seqlen, kv_seqlen, q_offsets, kv_offsets,
                          scale, mask_type, qkv_layout="BTNH"):
    assert qkv_layout == "BTNH"
    batch, rows, heads, dim = query.shape
    kv_heads = key.shape[2]
    qs, ks, qo, ko = fused._fix_seqlen_offsets(  # looked up at each call: tests patch it
        q_seqlen, kv_seqlen, q_offsets, kv_offsets, query, key)
    qs, ks = qs.reshape(-1), ks.reshape(-1)
    count = qs.size  # sequences: B * M, the live ones first, then length 0
    qi = _index(qo.reshape(-1)[:count], rows, heads, dim)
    ki = _index(ko.reshape(-1)[:count], rows, kv_heads, dim)
    q_ok = (jnp.arange(rows)[None, :] < qs[:, None])[..., None, None]
    k_ok = (jnp.arange(rows)[None, :] < ks[:, None])[..., None, None]
    size = query.size
    read_q = jnp.zeros(size, bool).at[jnp.where(q_ok, qi, size)].set(True, mode="drop")
    read_k = jnp.zeros(key.size, bool).at[jnp.where(k_ok, ki, key.size)].set(True, mode="drop")
    flat_q = _poison(query.reshape(-1), read_q)
    flat_k, flat_v = (_poison(x.reshape(-1), read_k) for x in (key, value))
    take = lambda flat, i, ok: jnp.where(ok, flat.at[i].get(mode="fill", fill_value=0), 0)  # noqa: E731
    q, k, v = take(flat_q, qi, q_ok), take(flat_k, ki, k_ok), take(flat_v, ki, k_ok)
    k, v = (jnp.repeat(x, heads // kv_heads, axis=2) for x in (k, v))
    s = jnp.einsum("qtnd,qsnd->qnts", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    allowed = k_ok[:, None, None, :, 0, 0] & q_ok[:, None, :, None, 0, 0]
    if mask_type == MaskType.PADDING_CAUSAL:
        allowed = allowed & (jnp.arange(rows)[:, None] >= jnp.arange(rows)[None, :])
    p = jax.nn.softmax(jnp.where(allowed, s, -1e30), axis=-1) * allowed
    o = jnp.einsum("qnts,qsnd->qtnd", p, v.astype(jnp.float32)).astype(query.dtype)
    out = jnp.full(size, jnp.nan, query.dtype).at[jnp.where(q_ok, qi, size)].set(o, mode="drop")
    return out.reshape(query.shape)


def install(monkeypatch, module) -> None:
    """Make the cuDNN family runnable here (kernels/gpu/cudnn.py `module`) on the stand-in."""
    monkeypatch.setattr(module, "requires", lambda: None)
    monkeypatch.setattr(module, "library", lambda: (dot_product_attention, MaskType))
