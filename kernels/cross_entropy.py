"""Fused, vocabulary-tiled cross-entropy per packed segment, forward and backward as Pallas kernels.

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

Both kernels read offsets/lengths and each row's used length (`common.row_ends`: the largest end
of a non-empty slot) from SMEM (scalar prefetch) to skip token blocks past it: the index maps clamp
those steps to the last fetched block (no DMA) and the kernels only write zeros there. On GPU the
same math runs as Triton kernels (kernels/gpu_cross_entropy.py); `impl` picks the family.

Normalization (`normalize=`) is plain jnp on the `[B, S]` sums (kernels.reference.normalize_loss),
so its gradient comes from autodiff and reaches the kernel as the per-segment cotangent:

    tokens     loss = sum(seg_loss) / sum(seg_tokens)        w_j = 1 / total tokens
    segments   loss = mean_j(seg_loss_j / seg_tokens_j)      w_j = 1 / (n_nonempty * tokens_j)
    none       loss = sum(seg_loss)                          w_j = 1
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from seqpack.kernels import gpu_cross_entropy, reference
from seqpack.kernels.broadcast import broadcast_call
from seqpack.kernels.checks import FLOAT_DTYPES, check_metadata, check_smem
from seqpack.kernels.common import (
    GpuBlockSizes,
    Impl,
    Interpret,
    Normalize,
    SegmentBlockSizes,
    flat_metadata,
    last_used_block,
    parse_enum,
    pick_block_sizes,
    resolve_impl,
    row_ends,
    token_block,
)
from seqpack.kernels.gpu_segment import padded_metadata


@dataclasses.dataclass(frozen=True)
class CrossEntropyBlockSizes:
    """Block sizes of the cross-entropy kernels.

    block_tokens x block_vocab = 256 x 2048: a 1 MiB bf16 logits tile (2 MiB f32), so the DMA per
    step (~1.3 us at 800 GB/s) dominates the ~0.35 us step overhead, while the tile, its double
    buffer and the f32 temporaries of exp / where stay well inside 16 MiB of scoped VMEM.
    block_tokens must be a multiple of 16 (bf16 tile rows), block_vocab of 128 (lanes).
    """

    block_tokens: int = 256
    block_vocab: int = 2048

    def __post_init__(self) -> None:
        if self.block_tokens <= 0 or self.block_tokens % 16:
            raise ValueError(f"{self.block_tokens=} must be a positive multiple of 16")
        if self.block_vocab <= 0 or self.block_vocab % 128:
            raise ValueError(f"{self.block_vocab=} must be a positive multiple of 128")


@dataclasses.dataclass(frozen=True)
class _Static:
    seq_len: int
    vocab: int
    num_segments: int
    z_loss: float
    block_tokens: int
    block_vocab: int
    interpret: Interpret
    gpu: GpuBlockSizes | None = None  # set: the GPU (Triton) kernels run instead

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
                    st: _Static) -> None:
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


def _forward_call(logits, targets, mask, offsets, lengths, used, *, st: _Static):
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
                     dl_ref, *, st: _Static) -> None:
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


def _backward_call(logits, targets, lse, weights, offsets, lengths, used, *, st: _Static):
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


def _forward(logits, targets, mask, offsets, lengths, used, st: _Static):
    """-> per-slot loss sums f32[B, S], counted tokens f32[B, S], per-token lse (the residual)."""
    if st.gpu is not None:
        return gpu_cross_entropy.forward_call(
            logits, targets, mask, offsets, lengths, num_segments=st.num_segments,
            z_loss=st.z_loss, blocks=st.gpu, interpret=bool(st.interpret))
    return _forward_call(logits, targets, mask, offsets, lengths, used, st=st)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _pallas_ce(logits, targets, mask, offsets, lengths, used, st: _Static):
    loss, count, _ = _forward(logits, targets, mask, offsets, lengths, used, st)
    return loss, count


def _pallas_ce_fwd(logits, targets, mask, offsets, lengths, used, st):
    loss, count, lse = _forward(logits, targets, mask, offsets, lengths, used, st)
    return (loss, count), (logits, targets, mask, offsets, lengths, used, lse)


def _pallas_ce_bwd(st, residuals, cotangents):
    logits, targets, mask, offsets, lengths, used, lse = residuals
    g_loss, _ = cotangents  # counts are piecewise constant: no gradient
    if st.gpu is not None:
        dlogits = gpu_cross_entropy.backward_call(
            logits, targets, mask, lse, g_loss, offsets, lengths, z_loss=st.z_loss,
            blocks=st.gpu, interpret=bool(st.interpret))
        return dlogits, None, None, None, None, None
    weights = broadcast_call(g_loss[:, :, None], offsets, lengths, seq_len=st.seq_len,
                             out_dtype=jnp.float32, block_sizes=SegmentBlockSizes(),
                             interpret=st.interpret)
    weights = jnp.where(mask > 0, weights, 0.0)
    dlogits = _backward_call(logits, targets, lse, weights, offsets, lengths, used, st=st)
    return dlogits, None, None, None, None, None


_pallas_ce.defvjp(_pallas_ce_fwd, _pallas_ce_bwd)


def _check(logits, targets, segment_offsets, segment_lengths, loss_mask, z_loss) -> int:
    if logits.ndim != 3 or jnp.dtype(logits.dtype) not in FLOAT_DTYPES:
        raise ValueError(
            f"logits.shape={logits.shape} dtype={logits.dtype} must be float [B, L, V] "
            "(float32, bfloat16 or float16)"
        )
    if targets.shape != logits.shape[:2] or not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(
            f"targets.shape={targets.shape} dtype={targets.dtype} must be int [B, L] = "
            f"{list(logits.shape[:2])} (token ids in [0, V))"
        )
    if loss_mask is not None and loss_mask.shape != logits.shape[:2]:
        raise ValueError(f"loss_mask.shape={loss_mask.shape} must be [B, L] like targets")
    if not z_loss >= 0.0:
        raise ValueError(f"{z_loss=} must be >= 0 (typical: 1e-4)")
    return check_metadata(segment_offsets, segment_lengths, logits.shape[0])


@functools.partial(
    jax.jit, static_argnames=("normalize", "z_loss", "impl", "interpret", "block_sizes")
)
def segment_cross_entropy(
    logits: jax.Array,  # f[B, L, V]
    targets: jax.Array,  # int[B, L], values in [0, V)
    segment_offsets: jax.Array,  # int[B, S]
    segment_lengths: jax.Array,  # int[B, S]
    *,
    normalize: Normalize | str = "tokens",
    loss_mask: jax.Array | None = None,  # bool or 0/1 [B, L]
    z_loss: float = 0.0,
    impl: Impl | str = "auto",
    interpret: Interpret = False,
    block_sizes: CrossEntropyBlockSizes | GpuBlockSizes | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # f32[], f32[B, S], i32[B, S]
    """Segment-aware cross-entropy: (loss, per_segment_loss, per_segment_tokens).

    Token loss = logsumexp(logits) - logits[target] + z_loss * logsumexp^2, counted when the token
    lies in a segment and `loss_mask` is set. per_segment_loss holds each slot's sum of counted
    token losses (its mean is per_segment_loss / max(per_segment_tokens, 1)); empty slots hold 0.
    `normalize`: "tokens" (sum / counted tokens), "segments" (mean over non-empty segments of the
    segment means) or "none" (sum); an empty batch gives loss 0. `impl`: common.resolve_impl;
    `block_sizes`: CrossEntropyBlockSizes for the TPU kernels, GpuBlockSizes for the GPU ones.
    """
    normalize = parse_enum(Normalize, "normalize", normalize)
    num_segments = _check(logits, targets, segment_offsets, segment_lengths, loss_mask, z_loss)
    impl = resolve_impl(impl, interpret)
    blocks = pick_block_sizes(block_sizes, impl, CrossEntropyBlockSizes, "segment_cross_entropy")
    if impl is Impl.REFERENCE:
        return reference.segment_cross_entropy(
            logits, targets, segment_offsets, segment_lengths, normalize=normalize,
            loss_mask=loss_mask, z_loss=z_loss,
        )
    batch, seq_len, vocab = logits.shape
    mask = (jnp.ones((batch, seq_len), jnp.float32) if loss_mask is None
            else (loss_mask != 0).astype(jnp.float32))
    targets = targets.astype(jnp.int32)
    used = row_ends(segment_offsets, segment_lengths, seq_len)
    if impl is Impl.PALLAS_GPU:
        st = _Static(seq_len, vocab, num_segments, float(z_loss), blocks.ce_block_tokens,
                     blocks.block_vocab, interpret, gpu=blocks)
        offsets, lengths = padded_metadata(segment_offsets, segment_lengths)
    else:
        check_smem(batch, num_segments)
        st = _Static(
            seq_len=seq_len,
            vocab=vocab,
            num_segments=num_segments,
            z_loss=float(z_loss),
            block_tokens=token_block(seq_len, blocks.block_tokens, 16),
            block_vocab=vocab if vocab <= blocks.block_vocab else blocks.block_vocab,
            interpret=interpret,
        )
        offsets, lengths = flat_metadata(segment_offsets, segment_lengths)
        targets, mask = targets[:, :, None], mask[:, :, None]
    per_segment_loss, count = _pallas_ce(logits, targets, mask, offsets, lengths, used, st)
    count = lax.stop_gradient(count)
    loss = reference.normalize_loss(per_segment_loss, count, normalize)
    return loss, per_segment_loss, count.astype(jnp.int32)
