"""Pallas TPU kernels of the per-segment cross-entropy, forward and backward (vocabulary-tiled).

Forward, grid `(B, L / bl, V / bv)` = ("parallel", "arbitrary", "arbitrary"): for each token block
an online log-sum-exp runs over the vocabulary tiles (running max `m`, rescaled sum `s`, and the
target logit picked with an iota compare), so no softmax is materialized. At the last vocab tile
the token losses `lse - logit[target] + z_loss * lse^2` are summed into per-slot accumulators
`[1, S]` (loss, counted tokens) that stay resident for the row: membership is
`offsets[j] <= p < offsets[j] + lengths[j]` and `loss_mask[p]`, a `[bl, S]` compare against the
row's segment starts/ends held in VMEM. The per-token lse is saved for the backward.

Backward, grid `(B, L / bl, V / bv)` all "parallel": the per-segment cotangents become per-token
weights `w` (the broadcast kernel, times the mask), and each logits tile gets
`w * ((1 + 2 z_loss lse) * exp(x - lse) - onehot(target))`, zero where `w == 0`.

Both kernels read offsets/lengths and each row's used length (`metadata.row_ends`: the largest end
of a non-empty slot) from SMEM (scalar prefetch) to skip token blocks past it: the index maps clamp
those steps to the last fetched block (no DMA) and the kernels only write zeros there. On GPU the
same math runs as Triton kernels (gpu/cross_entropy.py); kernels/cross_entropy.py picks the family.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from seqpack.kernels.common import Interpret
from seqpack.kernels.tpu.segment_ops import last_used_block


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static configuration of the TPU kernels (hashable: it is a custom_vjp nondiff argument)."""

    seq_len: int
    vocab: int
    num_segments: int
    z_loss: float
    block_tokens: int
    block_vocab: int
    interpret: Interpret

    @property
    def grid(self) -> tuple[int, int]:
        return pl.cdiv(self.seq_len, self.block_tokens), pl.cdiv(self.vocab, self.block_vocab)

    def logits_index(self, b, t, v, offsets_ref, lengths_ref, used_ref):
        """(b, t, v), or the row's last fetched tile for blocks past its used length."""
        last = last_used_block(used_ref, b, self.block_tokens)
        skip = t > last
        return b, jnp.where(skip, last, t), jnp.where(skip, self.grid[1] - 1, v)

    def column_index(self, b, t, v, offsets_ref, lengths_ref, used_ref):
        last = last_used_block(used_ref, b, self.block_tokens)
        return b, jnp.minimum(t, last), 0


def _forward_kernel(offsets_ref, lengths_ref, used_ref, logits_ref, targets_ref, mask_ref,
                    starts_ref, ends_ref, loss_ref, count_ref, lse_ref, m_ref, s_ref, tgt_ref, *,
                    st: Tiling) -> None:
    # logits [bl, bv]; targets, mask, lse, m, s, tgt [bl, 1]; starts, ends, loss, count [1, S]
    b, t, v = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bl, bv = logits_ref.shape
    used = t * bl < used_ref[b]

    @pl.when((t == 0) & (v == 0))
    def _init_row():
        loss_ref[...] = jnp.zeros(loss_ref.shape, jnp.float32)
        count_ref[...] = jnp.zeros(count_ref.shape, jnp.float32)

    @pl.when(v == 0)
    def _init_tokens():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        s_ref[...] = jnp.zeros(s_ref.shape, jnp.float32)
        tgt_ref[...] = jnp.zeros(tgt_ref.shape, jnp.float32)

    @pl.when(used)
    def _online_lse():
        x = logits_ref[...].astype(jnp.float32)
        col = v * bv + lax.broadcasted_iota(jnp.int32, (bl, bv), 1)
        if st.vocab % bv:
            x = jnp.where(col < st.vocab, x, -jnp.inf)
        m_prev = m_ref[...]
        m_new = jnp.maximum(m_prev, jnp.max(x, axis=1, keepdims=True))
        s_ref[...] = s_ref[...] * jnp.exp(m_prev - m_new) + jnp.sum(
            jnp.exp(x - m_new), axis=1, keepdims=True
        )
        tgt_ref[...] += jnp.sum(jnp.where(col == targets_ref[...], x, 0.0), axis=1, keepdims=True)
        m_ref[...] = m_new

    @pl.when((v == st.grid[1] - 1) & used)
    def _segment_sums():
        lse = m_ref[...] + jnp.log(s_ref[...])
        lse_ref[...] = lse
        token_loss = lse - tgt_ref[...] + st.z_loss * lse * lse
        pos = t * bl + lax.broadcasted_iota(jnp.int32, (bl, 1), 0)
        member = (pos >= starts_ref[...]) & (pos < ends_ref[...]) & (pos < st.seq_len)
        member &= mask_ref[...] > 0  # [bl, S]
        loss_ref[...] += jnp.sum(jnp.where(member, token_loss, 0.0), axis=0, keepdims=True)
        count_ref[...] += jnp.sum(jnp.where(member, 1.0, 0.0), axis=0, keepdims=True)

    @pl.when((v == st.grid[1] - 1) & jnp.logical_not(used))
    def _padding_block():
        lse_ref[...] = jnp.zeros(lse_ref.shape, jnp.float32)


def forward_call(logits, targets, mask, offsets, lengths, used, *, st: Tiling):
    """-> per-slot loss sums f32[B, S], counted tokens f32[B, S], per-token lse f32[B, L, 1]."""
    batch = logits.shape[0]
    nseg, bl, bv = st.num_segments, st.block_tokens, st.block_vocab
    starts = offsets.reshape(batch, 1, nseg)
    ends = starts + lengths.reshape(batch, 1, nseg)
    column = pl.BlockSpec((None, bl, 1), st.column_index)
    per_row = pl.BlockSpec((None, 1, nseg), lambda b, t, v, *_: (b, 0, 0))
    loss, count, lse = pl.pallas_call(
        functools.partial(_forward_kernel, st=st),
        out_shape=(
            jax.ShapeDtypeStruct((batch, 1, nseg), jnp.float32),
            jax.ShapeDtypeStruct((batch, 1, nseg), jnp.float32),
            jax.ShapeDtypeStruct((batch, st.seq_len, 1), jnp.float32),
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(batch, *st.grid),
            in_specs=[pl.BlockSpec((None, bl, bv), st.logits_index), column, column, per_row,
                      per_row],
            out_specs=[
                per_row, per_row, pl.BlockSpec((None, bl, 1), lambda b, t, v, *_: (b, t, 0))
            ],
            scratch_shapes=[pltpu.VMEM((bl, 1), jnp.float32)] * 3,
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")
        ),
        cost_estimate=pl.CostEstimate(
            flops=6 * logits.size,
            transcendentals=logits.size,
            bytes_accessed=logits.size * logits.dtype.itemsize + 12 * batch * st.seq_len,
        ),
        interpret=st.interpret,
        name="segment_cross_entropy_fwd",
    )(offsets, lengths, used, logits, targets, mask, starts, ends)
    return loss[:, 0], count[:, 0], lse


def _backward_kernel(offsets_ref, lengths_ref, used_ref, logits_ref, targets_ref, lse_ref, w_ref,
                     dl_ref, *, st: Tiling) -> None:
    # logits, dl [bl, bv]; targets, lse, w [bl, 1]
    b, t, v = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bl, bv = logits_ref.shape
    used = t * bl < used_ref[b]

    @pl.when(used)
    def _grad():
        x = logits_ref[...].astype(jnp.float32)
        col = v * bv + lax.broadcasted_iota(jnp.int32, (bl, bv), 1)
        lse, w = lse_ref[...], w_ref[...]
        probs = jnp.exp(x - lse) * (1.0 + 2.0 * st.z_loss * lse)
        grad = probs - jnp.where(col == targets_ref[...], 1.0, 0.0)
        dl_ref[...] = jnp.where(w != 0.0, w * grad, 0.0).astype(dl_ref.dtype)

    @pl.when(jnp.logical_not(used))
    def _padding_block():
        dl_ref[...] = jnp.zeros(dl_ref.shape, dl_ref.dtype)


def backward_call(logits, targets, lse, weights, offsets, lengths, used, *, st: Tiling):
    batch = logits.shape[0]
    bl, bv = st.block_tokens, st.block_vocab
    column = pl.BlockSpec((None, bl, 1), st.column_index)
    return pl.pallas_call(
        functools.partial(_backward_kernel, st=st),
        out_shape=jax.ShapeDtypeStruct(logits.shape, logits.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(batch, *st.grid),
            in_specs=[pl.BlockSpec((None, bl, bv), st.logits_index), column, column, column],
            out_specs=pl.BlockSpec((None, bl, bv), lambda b, t, v, *_: (b, t, v)),
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel")
        ),
        cost_estimate=pl.CostEstimate(
            flops=6 * logits.size,
            transcendentals=logits.size,
            bytes_accessed=2 * logits.size * logits.dtype.itemsize + 12 * batch * st.seq_len,
        ),
        interpret=st.interpret,
        name="segment_cross_entropy_bwd",
    )(offsets, lengths, used, logits, targets, lse, weights)
