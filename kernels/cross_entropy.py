"""Public segment_cross_entropy: per-segment losses of packed rows, with its custom VJP.

    segment_cross_entropy   logits f[B, L, V], targets i32[B, L] -> (loss, per-segment loss sums
                            f32[B, S], per-segment counted tokens i32[B, S])

The kernels are fused and vocabulary-tiled (no softmax is materialized, no f32 copy of the logits):
tpu/cross_entropy.py (Mosaic, online log-sum-exp over vocab tiles, scalar-prefetched metadata,
token blocks past the row's used length skipped) and gpu/cross_entropy.py (Triton), each behind
its wing's CROSS_ENTROPY family (the CrossEntropyFamily protocol); `impl` (common.resolve_impl's
table) picks a family of FAMILIES or kernels/reference.py, and the custom VJP's static argument
carries it. The forward saves the per-token lse; the backward turns the per-segment cotangents
into per-token weights and writes dlogits.

Normalization (`normalize=`) is plain jnp on the `[B, S]` sums (kernels.reference.normalize_loss),
so its gradient comes from autodiff and reaches the kernel as the per-segment cotangent:

    tokens     loss = sum(seg_loss) / sum(seg_tokens)        w_j = 1 / total tokens
    segments   loss = mean_j(seg_loss_j / seg_tokens_j)      w_j = 1 / (n_nonempty * tokens_j)
    none       loss = sum(seg_loss)                          w_j = 1
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax import lax

from seqpack.kernels import gpu, reference, tpu
from seqpack.kernels.checks import FLOAT_DTYPES, check_metadata
from seqpack.kernels.common import (
    Family,
    GpuBlockSizes,
    Impl,
    Interpret,
    Normalize,
    Registry,
    parse_enum,
)
from seqpack.kernels.metadata import MetadataLayout, family_metadata, row_ends
from seqpack.kernels.tpu import CrossEntropyBlockSizes  # also importable from here, as before


class CrossEntropyFamily(Family, Protocol):
    """A kernel family of segment_cross_entropy (`target`, `block_sizes`: common.Family).

    offsets / lengths come in its `metadata_layout`, `used` is metadata.row_ends, targets i32
    and mask f32 [B, L]. tiling: its static configuration (hashable) for one call; forward ->
    (per-slot loss sums, counted tokens) f32[B, S] and the per-token lse, in whatever layout
    its backward takes back; backward: the per-slot cotangent g_loss f32[B, S] -> dlogits.
    """

    @property
    def metadata_layout(self) -> MetadataLayout: ...

    def tiling(self, seq_len: int, vocab: int, num_segments: int, z_loss: float, blocks: Any,
               interpret: Interpret) -> Any: ...

    def forward(self, logits, targets, mask, offsets, lengths, used,
                st: Any) -> tuple[jax.Array, jax.Array, jax.Array]: ...

    def backward(self, logits, targets, mask, lse, g_loss, offsets, lengths, used,
                 st: Any) -> jax.Array: ...  # logits.dtype[B, L, V]


# auto's order within a platform: the first family that can run here is taken.
FAMILIES: Registry[CrossEntropyFamily] = Registry("segment_cross_entropy",
                                                  (tpu.CROSS_ENTROPY, gpu.CROSS_ENTROPY))


@dataclasses.dataclass(frozen=True)
class _Static:
    """Static configuration (a custom_vjp nondiff argument): the family that runs, its tiling."""

    family: CrossEntropyFamily
    tiling: Any


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _pallas_ce(logits, targets, mask, offsets, lengths, used, st: _Static):
    loss, count, _ = st.family.forward(logits, targets, mask, offsets, lengths, used, st.tiling)
    return loss, count


def _pallas_ce_fwd(logits, targets, mask, offsets, lengths, used, st):
    loss, count, lse = st.family.forward(logits, targets, mask, offsets, lengths, used,
                                         st.tiling)
    return (loss, count), (logits, targets, mask, offsets, lengths, used, lse)


def _pallas_ce_bwd(st, residuals, cotangents):
    logits, targets, mask, offsets, lengths, used, lse = residuals
    g_loss, _ = cotangents  # counts are piecewise constant: no gradient
    dlogits = st.family.backward(logits, targets, mask, lse, g_loss, offsets, lengths, used,
                                 st.tiling)
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
    targets: jax.Array,  # int[B, L], ids in [0, V) or negative (-100: not counted)
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
    lies in a segment, its target is >= 0 (-100: ignored) and `loss_mask` is set; a counted
    target >= V makes its segment's loss NaN. per_segment_loss holds each slot's sum of counted
    token losses (its mean is per_segment_loss / max(per_segment_tokens, 1)); empty slots hold 0.
    `normalize`: "tokens" (sum / counted tokens), "segments" (mean over non-empty segments of the
    segment means) or "none" (sum); an empty batch gives loss 0. `impl`: common.resolve_impl;
    `block_sizes`: CrossEntropyBlockSizes for the TPU kernels, GpuBlockSizes for the GPU ones.
    """
    normalize = parse_enum(Normalize, "normalize", normalize)
    num_segments = _check(logits, targets, segment_offsets, segment_lengths, loss_mask, z_loss)
    family, blocks = FAMILIES.resolve(impl, interpret, block_sizes, op="segment_cross_entropy")
    if family is None:
        return reference.segment_cross_entropy(
            logits, targets, segment_offsets, segment_lengths, normalize=normalize,
            loss_mask=loss_mask, z_loss=z_loss,
        )
    batch, seq_len, vocab = logits.shape
    kept = targets >= 0  # -100 (any negative id): not counted
    mask = (kept if loss_mask is None else kept & (loss_mask != 0)).astype(jnp.float32)
    targets = jnp.maximum(targets, 0).astype(jnp.int32)
    used = row_ends(segment_offsets, segment_lengths, seq_len)
    offsets, lengths = family_metadata(segment_offsets, segment_lengths, family)
    st = _Static(family, family.tiling(seq_len, vocab, num_segments, float(z_loss), blocks,
                                       interpret))
    per_segment_loss, count = _pallas_ce(logits, targets, mask, offsets, lengths, used, st)
    count = lax.stop_gradient(count)
    per_segment_loss = reference.out_of_vocab(per_segment_loss, targets, mask > 0,
                                              segment_offsets, segment_lengths, vocab)
    loss = reference.normalize_loss(per_segment_loss, count, normalize)
    return loss, per_segment_loss, count.astype(jnp.int32)
