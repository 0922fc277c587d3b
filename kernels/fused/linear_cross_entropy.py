"""Public segment_linear_cross_entropy: the output projection fused into the per-segment loss.

    segment_linear_cross_entropy   hidden f[B, L, H], weight f[H, V], targets i32[B, L]
                                   -> (loss, per-segment loss sums f32[B, S], tokens i32[B, S])

equal to `segment_cross_entropy(hidden @ weight, ...)` without storing logits. The public
function checks its inputs, takes the plan (policy.loss_head_plan: the mode and chunk for the
size and `max_logits_bytes`) and runs one of two paths: `_in_forward` ("logits" and "chunked",
the gradients formed in the forward: in_forward.py) or `_recompute`, which returns each token's
log-sum-exp and target logit from the chosen implementation (blockwise.py on XLA, the Mosaic or
Triton kernels) and whose backward recomputes the logits block by block. Everything after that
is plain jnp on `[B, L]` and `[B, S]` values (in_forward.finish), so its gradient comes from
autodiff:

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

import functools

import jax
import jax.numpy as jnp
from jax import lax

from seqpack.kernels import reference
from seqpack.kernels.checks import FLOAT_DTYPES, check_metadata, float_dtype
from seqpack.kernels.common import GpuBlockSizes, Impl, Interpret, Normalize, parse_enum
from seqpack.kernels.fused.blockwise import counted_rows, token_terms, varying_axes, vocab_tiling
from seqpack.kernels.fused.families import (
    FAMILIES,
    HeadCall,
    LossHeadFamily,
    block_schedule,
    pallas_terms,
)
from seqpack.kernels.fused.in_forward import InForward, finish, head, segment_tokens
from seqpack.kernels.fused.policy import LossHeadMode, loss_head_plan
from seqpack.kernels.metadata import row_ends
from seqpack.kernels.tpu import LinearCrossEntropyBlockSizes


def _check(hidden, weight, targets, segment_offsets, segment_lengths, loss_mask,
           segment_weights, z_loss, logit_softcap) -> int:
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
    if segment_weights is not None and segment_weights.shape != segment_offsets.shape:
        raise ValueError(f"segment_weights.shape={segment_weights.shape} must be [B, S] like "
                         f"segment_offsets {segment_offsets.shape}")
    if not z_loss >= 0.0:
        raise ValueError(f"{z_loss=} must be >= 0 (typical: 1e-4)")
    if logit_softcap is not None and not logit_softcap > 0.0:
        raise ValueError(f"{logit_softcap=} must be > 0 (Gemma 2: 30.0) or None")
    return check_metadata(segment_offsets, segment_lengths, hidden.shape[0])


def _counted(targets, segment_offsets, segment_lengths, loss_mask) -> jax.Array:  # bool[B, L]
    ids = reference.segment_index(segment_offsets, segment_lengths, targets.shape[1])
    counted = (ids < segment_offsets.shape[1]) & (targets >= 0)
    return counted if loss_mask is None else counted & (loss_mask != 0)


def _local_terms(hidden, weight, targets, counted, offsets, lengths, *,
                 family: LossHeadFamily | None, blocks, softcap, interpret):
    """This shard's per-token (lse, target logit), f32[B, L] each; family None: the XLA path."""
    batch, seq_len, dim = hidden.shape
    if family is None:
        st = vocab_tiling(blocks.block_vocab, weight.shape[1], softcap)
        lse, tgt = token_terms(counted_rows(hidden, counted), weight, targets.reshape(-1), st)
        return lse.reshape(batch, seq_len), tgt.reshape(batch, seq_len)
    tiling = family.tiling(seq_len, weight.shape[1], dim, blocks, softcap, interpret)
    meta = block_schedule(counted, row_ends(offsets, lengths, seq_len), tiling.block_tokens)
    return pallas_terms(hidden, weight, targets, counted.astype(jnp.float32), meta,
                        HeadCall(family, tiling))


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


def _in_forward(hidden, weight, targets, offsets, lengths, counted, segment_weights, *,
                chunk: int, blocks, normalize, z_loss, softcap, vocab_axis, logits_dtype: str,
                weight_grad_dtype: str):
    """The "logits" and "chunked" modes: in_forward.head over chunks of `chunk` tokens, with this
    shard's targets (vocab_axis); a float32 master weight is passed as is (head casts it).
    `blocks`' block_vocab tiles the recomputing backward of per_segment_loss cotangents."""
    local = targets
    if vocab_axis is not None:
        hidden, local = _shard(hidden, weight, targets, vocab_axis)
    weights = (jnp.ones(offsets.shape, jnp.float32) if segment_weights is None
               else segment_weights.astype(jnp.float32))
    # pcast left hidden invariant: shard_map(check_vma=False), cotangents divided
    unchecked = vocab_axis is not None and vocab_axis not in varying_axes(hidden)
    block_vocab = getattr(blocks, "block_vocab", LinearCrossEntropyBlockSizes.block_vocab)
    cfg = InForward(chunk, normalize, float(z_loss), softcap, vocab_axis, unchecked, block_vocab,
                    logits_dtype, weight_grad_dtype)
    return head(cfg, hidden, weight, weights, local, counted, offsets, lengths)


def _recompute(hidden, weight, targets, offsets, lengths, counted, segment_weights, *,
               family: LossHeadFamily | None, blocks, softcap, interpret, normalize, z_loss,
               vocab_axis):
    """The "recompute" mode: per-token terms from the family (None: the XLA path), combined over
    vocab_axis, then in_forward.finish, differentiated by autodiff."""
    weight = weight.astype(hidden.dtype)  # a float32 master weight: its gradient through the cast
    terms = functools.partial(_local_terms, offsets=offsets, lengths=lengths, family=family,
                              blocks=blocks, softcap=softcap, interpret=interpret)
    if vocab_axis is None:
        lse, tgt = terms(hidden, weight, targets, counted)
    else:
        lse, tgt = _vocab_parallel_terms(hidden, weight, targets, counted, vocab_axis, terms)
    return finish(lse, tgt, counted, segment_tokens(counted, offsets, lengths), segment_weights,
                  offsets, lengths, normalize=normalize, z_loss=z_loss)


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
    memory for all a chunk holds, its logits, their f32 softmax and gradient): what
    `loss_head_plan` returns for the same size and options.
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
    _check(hidden, weight, targets, segment_offsets, segment_lengths, loss_mask, segment_weights,
           z_loss, logit_softcap)
    stored = float_dtype("logits_dtype", hidden.dtype if logits_dtype is None else logits_dtype)
    carry = float_dtype("weight_grad_dtype",
                        jnp.float32 if weight_grad_dtype is None else weight_grad_dtype)
    plan = loss_head_plan(hidden.shape[0] * hidden.shape[1], weight.shape[1], mode=mode,
                          max_logits_bytes=max_logits_bytes, logits_dtype=stored)
    family, blocks = FAMILIES.resolve(impl, interpret, block_sizes)
    if family is None:  # the XLA path reads block_vocab alone, of either class
        blocks = block_sizes or LinearCrossEntropyBlockSizes()
    targets = targets.astype(jnp.int32)
    counted = _counted(targets, segment_offsets, segment_lengths, loss_mask)
    data = (hidden, weight, targets, segment_offsets, segment_lengths, counted, segment_weights)
    softcap = None if logit_softcap is None else float(logit_softcap)
    if plan.mode is LossHeadMode.RECOMPUTE:
        out = _recompute(*data, family=family, blocks=blocks, softcap=softcap,
                         interpret=interpret, normalize=normalize, z_loss=z_loss,
                         vocab_axis=vocab_axis)
    else:
        assert plan.chunk_tokens is not None  # LOGITS and CHUNKED have a chunk
        out = _in_forward(*data, chunk=plan.chunk_tokens, blocks=blocks, normalize=normalize,
                          z_loss=z_loss, softcap=softcap, vocab_axis=vocab_axis,
                          logits_dtype=stored.name, weight_grad_dtype=carry.name)
    return _out_of_vocab(out, targets, counted, segment_offsets, segment_lengths,
                         weight.shape[1], vocab_axis)


def _out_of_vocab(out, targets, counted, offsets, lengths, columns: int, vocab_axis):
    """`out` with NaN in each segment holding a counted target past the whole vocabulary (this
    shard's columns times the shards), and in the loss then (`reference.out_of_vocab`)."""
    loss, per_segment_loss, tokens = out
    vocab = columns if vocab_axis is None else columns * lax.psum(1, vocab_axis)
    per_segment_loss = reference.out_of_vocab(per_segment_loss, targets, counted, offsets,
                                              lengths, vocab)
    return jnp.where(jnp.isnan(per_segment_loss).any(), jnp.nan, loss), per_segment_loss, tokens
