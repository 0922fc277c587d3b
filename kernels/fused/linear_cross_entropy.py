"""Public segment_linear_cross_entropy: the output projection fused into the per-segment loss.

    segment_linear_cross_entropy   hidden f[B, L, H], weight f[H, V], targets i32[B, L]
                                   -> (loss, per-segment loss sums f32[B, S], tokens i32[B, S])

equal to `segment_cross_entropy(hidden @ weight, ...)` without storing logits. `mode` (chosen by
`max_logits_bytes`, in_forward.choose): "logits" and "chunked" form the gradients in the forward
(in_forward.py); "recompute" returns each token's log-sum-exp and target logit from the chosen
implementation (blockwise.py on XLA, the Mosaic or Triton kernels), and the backward recomputes
the logits block by block. Everything after that is plain jnp on `[B, L]` and `[B, S]` values
(in_forward.finish), so its gradient comes from autodiff:

    token loss      lse - target logit + z_loss * lse^2      (counted tokens only)
    per segment     sums over each slot's counted tokens     (reference.segment_sum)
    loss            reference.normalize_loss (tokens, segments, none) of
                    segment_weights * per-segment sums

Counted: inside a segment, `loss_mask` set and target >= 0 (-100 is PyTorch's ignore_index).
Uncounted rows of `hidden` are replaced by zeros before the projection (a `where`), so NaN there
reaches nothing. Vocab-parallel (`vocab_axis=`, inside shard_map, `weight` this shard's
`[H, V / P]` columns): every shard computes its local lse and target logit (targets shifted by the
shard's first column; others' targets match no column), then `lse = m + log psum exp(lse_s - m)`
with `m = pmax(lse_s)` and `target = psum(target_s)`; the gradients of `weight` stay local, and
the one of `hidden` is summed over the shards by the transpose of `pcast(..., to="varying")`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from seqpack.kernels import gpu, reference, tpu
from seqpack.kernels.checks import FLOAT_DTYPES, check_metadata
from seqpack.kernels.common import (
    GpuBlockSizes,
    Impl,
    Interpret,
    Normalize,
    check_multiple,
    parse_enum,
    resolve,
    tile,
    token_block,
)
from seqpack.kernels.fused.blockwise import Blockwise, token_terms, varying_axes
from seqpack.kernels.fused.families import Family, block_schedule, pallas_terms
from seqpack.kernels.fused.in_forward import InForward, LossHeadMode, choose, finish, head
from seqpack.kernels.metadata import row_ends


@dataclasses.dataclass(frozen=True)
class LinearCrossEntropyBlockSizes:
    """Block sizes of the fused loss head (the XLA path reads only block_vocab).

    block_vocab = 512 columns: at N = 16k tokens an f32 `[N, 512]` logits block is 32 MiB, small
    next to the 2 GiB of logits at V = 32k, and each matmul stays large enough for the MXU.
    block_tokens = 256 rows (the Pallas kernels' token block). Multiples of 128 and 16.
    """

    block_tokens: int = 256
    block_vocab: int = 512

    def __post_init__(self) -> None:
        check_multiple("block_tokens", self.block_tokens, 16, " (bf16 tile rows)")
        check_multiple("block_vocab", self.block_vocab, 128, " (lanes)")


def _check(hidden, weight, targets, segment_offsets, segment_lengths, loss_mask, z_loss,
           logit_softcap) -> int:
    for name, arr, ndim in (("hidden", hidden, 3), ("weight", weight, 2)):
        if arr.ndim != ndim or jnp.dtype(arr.dtype) not in FLOAT_DTYPES:
            want = "[B, L, H]" if ndim == 3 else "[H, V]"
            raise ValueError(f"{name}.shape={arr.shape} dtype={arr.dtype} must be float {want} "
                             "(float32, bfloat16 or float16)")
    if weight.dtype != hidden.dtype and weight.dtype != jnp.float32:
        raise ValueError(f"weight.dtype={weight.dtype} must equal hidden.dtype={hidden.dtype} "
                         "or be float32 (a master weight, read in hidden's dtype): cast the "
                         "projection to the compute dtype first")
    if weight.shape[0] != hidden.shape[2]:
        raise ValueError(f"weight.shape={weight.shape} must be [H, V] with H={hidden.shape[2]} "
                         f"(hidden.shape={hidden.shape}); pass the output projection as [H, V]")
    if targets.shape != hidden.shape[:2] or not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"targets.shape={targets.shape} dtype={targets.dtype} must be int "
                         f"[B, L] = {list(hidden.shape[:2])} (ids in [0, V), or -100: ignored)")
    if loss_mask is not None and loss_mask.shape != hidden.shape[:2]:
        raise ValueError(f"loss_mask.shape={loss_mask.shape} must be [B, L] like targets")
    if not z_loss >= 0.0:
        raise ValueError(f"{z_loss=} must be >= 0 (typical: 1e-4)")
    if logit_softcap is not None and not logit_softcap > 0.0:
        raise ValueError(f"{logit_softcap=} must be > 0 (Gemma 2: 30.0) or None")
    return check_metadata(segment_offsets, segment_lengths, hidden.shape[0])


def _counted(targets, segment_offsets, segment_lengths, loss_mask) -> jax.Array:  # bool[B, L]
    ids = reference.segment_index(segment_offsets, segment_lengths, targets.shape[1])
    counted = (ids < segment_offsets.shape[1]) & (targets >= 0)
    return counted if loss_mask is None else counted & (loss_mask != 0)


def _local_terms(hidden, weight, targets, counted, offsets, lengths, *, impl: Impl, blocks,
                 softcap, interpret):
    """This shard's per-token (lse, target logit), f32[B, L] each."""
    batch, seq_len, dim = hidden.shape
    if impl is Impl.REFERENCE:
        x = jnp.where(counted[:, :, None], hidden, jnp.zeros((), hidden.dtype))
        st = Blockwise(min(blocks.block_vocab, -(-weight.shape[1] // 128) * 128), softcap)
        lse, tgt = token_terms(x.reshape(-1, dim), weight, targets.reshape(-1), st)
        return lse.reshape(batch, seq_len), tgt.reshape(batch, seq_len)
    vocab = weight.shape[1]
    if impl is Impl.PALLAS_GPU:
        fam = Family(gpu=gpu.LinearTiling(
            seq_len, vocab, max(tile(seq_len, blocks.head_block_tokens), 16),
            max(tile(vocab, blocks.head_block_vocab), 16), softcap,
            block_hidden=max(tile(dim, blocks.head_block_hidden), 16),
            num_warps=blocks.num_warps, interpret=bool(interpret)))
        bl = fam.gpu.block_tokens
    else:
        bl = token_block(seq_len, blocks.block_tokens, 16)
        bv = vocab if vocab <= blocks.block_vocab else blocks.block_vocab
        fam = Family(tpu=tpu.LinearTiling(seq_len, vocab, bl, bv, softcap, interpret=interpret))
    meta = block_schedule(counted, row_ends(offsets, lengths, seq_len), bl)
    return pallas_terms(hidden, weight, targets, counted.astype(jnp.float32), meta, fam)


def _check_options(segment_weights, segment_offsets, max_logits_bytes) -> None:
    if segment_weights is not None and segment_weights.shape != segment_offsets.shape:
        raise ValueError(f"segment_weights.shape={segment_weights.shape} must be [B, S] like "
                         f"segment_offsets {segment_offsets.shape}")
    if max_logits_bytes is not None and max_logits_bytes <= 0:
        raise ValueError(f"{max_logits_bytes=} must be a positive byte count or None")


def _float_dtype(name: str, value, default) -> jnp.dtype:
    """An option's dtype (None: default), a ValueError naming it unless a float one."""
    dtype = jnp.dtype(value or default)
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}={dtype} must be float32, bfloat16 or float16")
    return dtype


def _shard(hidden, weight, targets, axis: str):
    """(hidden varying over `axis`, targets shifted to this shard's columns)."""
    try:
        shard = lax.axis_index(axis)
    except NameError:
        raise ValueError(f"vocab_axis={axis!r} is not an axis here: call "
                         "segment_linear_cross_entropy inside shard_map over a mesh with that "
                         "axis, weight being this shard's [H, V / P] columns") from None
    if axis not in varying_axes(hidden):
        hidden = lax.pcast(hidden, axis, to="varying")  # its transpose sums dhidden over shards
    return hidden, targets - shard * weight.shape[1]


def _vocab_parallel_terms(hidden, weight, targets, counted, axis: str, terms):
    """lse and target logit over the whole vocabulary from each shard's columns."""
    hidden, local = _shard(hidden, weight, targets, axis)
    lse_s, tgt_s = terms(hidden, weight, local, counted)
    m = lax.pmax(lax.stop_gradient(lse_s), axis)
    lse = m + jnp.log(lax.psum(jnp.exp(lse_s - m), axis))
    return lse, lax.psum(tgt_s, axis)


@functools.partial(jax.jit, static_argnames=(
    "normalize", "z_loss", "logit_softcap", "impl", "interpret", "block_sizes", "vocab_axis",
    "mode", "max_logits_bytes", "logits_dtype", "weight_grad_dtype"))
def segment_linear_cross_entropy(
    hidden: jax.Array,  # f[B, L, H]
    weight: jax.Array,  # f[H, V] (with vocab_axis: this shard's [H, V / P]); hidden's dtype or f32
    targets: jax.Array,  # int[B, L], ids in [0, V) or negative (-100: not counted)
    segment_offsets: jax.Array,  # int[B, S]
    segment_lengths: jax.Array,  # int[B, S]
    *,
    normalize: Normalize | str = "tokens",
    loss_mask: jax.Array | None = None,  # bool or 0/1 [B, L]
    segment_weights: jax.Array | None = None,  # f32[B, S]
    z_loss: float = 0.0,
    logit_softcap: float | None = None,
    mode: LossHeadMode | str = "auto",
    max_logits_bytes: int | None = None,
    logits_dtype: str | None = None,
    weight_grad_dtype: str | None = None,
    impl: Impl | str = "auto",
    interpret: Interpret = False,
    block_sizes: LinearCrossEntropyBlockSizes | GpuBlockSizes | None = None,
    vocab_axis: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # f32[], f32[B, S], i32[B, S]
    """`segment_cross_entropy(hidden @ weight, ...)` without storing the logits: (loss,
    per_segment_loss, per_segment_tokens), differentiable in hidden, weight and segment_weights.

    Logits are `c * tanh(x / c)` with `logit_softcap=c` (Gemma 2). `segment_weights`: each
    segment's weight in `loss` (per_segment_loss stays unweighted); per dataset, e.g.
    `dataset_weight[segment_dataset_id]`. A float32 `weight` beside narrower `hidden` (a master
    weight) is read in hidden's dtype; its gradient is float32, and unrounded where the forward
    forms it ("logits", "chunked"). `mode` (LossHeadMode): "logits" (all logits at once,
    gradients in the forward), "chunked" (the same over token chunks whose logits fit
    `max_logits_bytes`), "recompute" (the backward recomputes), "auto": the first of those that
    fits `max_logits_bytes` (the stored logits' bytes; None: two thirds of the device's free
    memory for all a chunk holds, its logits, their f32 softmax and gradient; in_forward.py).
    In "logits" and "chunked": `logits_dtype`, the dtype the logits are stored in (None: the
    inputs'; each rounded once, as materialized logits are; a budget holds twice as many bf16
    as f32), and `weight_grad_dtype`, the one d weight is carried in over the chunks (None:
    f32; bf16 halves that [H, V] buffer, its error growing with the chunk count).
    `impl` applies to "recompute": "reference" (and "auto" off TPU / GPU) is the blockwise XLA
    path; "pallas_tpu" / "pallas_gpu" the kernels. `block_sizes`: LinearCrossEntropyBlockSizes
    (XLA, TPU) or GpuBlockSizes (GPU: its head_* tile sizes and num_warps). `vocab_axis`: a mesh
    axis the vocabulary is sharded over (inside shard_map).
    """
    normalize = parse_enum(Normalize, "normalize", normalize)
    mode = parse_enum(LossHeadMode, "mode", mode)
    _check(hidden, weight, targets, segment_offsets, segment_lengths, loss_mask, z_loss,
           logit_softcap)
    _check_options(segment_weights, segment_offsets, max_logits_bytes)
    impl, blocks = resolve(impl, interpret, block_sizes, LinearCrossEntropyBlockSizes,
                           "segment_linear_cross_entropy")
    if impl is Impl.REFERENCE:  # the XLA path reads block_vocab alone, of either class
        blocks = block_sizes or LinearCrossEntropyBlockSizes()
    targets = targets.astype(jnp.int32)
    counted = _counted(targets, segment_offsets, segment_lengths, loss_mask)
    softcap = None if logit_softcap is None else float(logit_softcap)
    logits_dtype = _float_dtype("logits_dtype", logits_dtype, hidden.dtype)
    weight_grad_dtype = _float_dtype("weight_grad_dtype", weight_grad_dtype, jnp.float32)
    mode, chunk = choose(mode, hidden.shape[0] * hidden.shape[1], weight.shape[1],
                         max_logits_bytes, logits_dtype.itemsize)
    if mode is not LossHeadMode.RECOMPUTE:  # a float32 master weight: in_forward casts it
        local = targets
        if vocab_axis is not None:
            hidden, local = _shard(hidden, weight, targets, vocab_axis)
        weights = (jnp.ones(segment_offsets.shape, jnp.float32) if segment_weights is None
                   else segment_weights.astype(jnp.float32))
        # pcast left hidden invariant: shard_map(check_vma=False), cotangents divided
        unchecked = vocab_axis is not None and vocab_axis not in varying_axes(hidden)
        cfg = InForward(chunk, normalize, float(z_loss), softcap, vocab_axis, unchecked,
                        getattr(blocks, "block_vocab", 512), logits_dtype.name,
                        weight_grad_dtype.name)
        return head(cfg, hidden, weight, weights, local, counted, segment_offsets,
                    segment_lengths)
    weight = weight.astype(hidden.dtype)  # a float32 master weight: its gradient through the cast
    terms = functools.partial(_local_terms, offsets=segment_offsets, lengths=segment_lengths,
                              impl=impl, blocks=blocks, softcap=softcap, interpret=interpret)
    if vocab_axis is None:
        lse, tgt = terms(hidden, weight, targets, counted)
    else:
        lse, tgt = _vocab_parallel_terms(hidden, weight, targets, counted, vocab_axis, terms)
    return finish(lse, tgt, counted, segment_weights, segment_offsets, segment_lengths,
                  normalize=normalize, z_loss=z_loss)
