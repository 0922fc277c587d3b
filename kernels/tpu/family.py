"""The Pallas TPU (Mosaic) kernel families: what each op's Registry reads of this wing.

    ATTENTION       segment_attention              AttentionBlockSizes, lse f32[B, H, L, 1]
    SEGMENT_OPS     segment reduce / broadcast     common.SegmentBlockSizes, flat metadata
    CROSS_ENTROPY   segment_cross_entropy          CrossEntropyBlockSizes, flat metadata
    GATHER          segment_gather                 GatherBlockSizes, flat metadata
    LOSS_HEAD       segment_linear_cross_entropy   LinearCrossEntropyBlockSizes

Each is a small adapter: its `common.Target` (PALLAS_TPU), its block-size class, the metadata
layout it reads (metadata.MetadataLayout), and this wing's kernels called the way its op's
protocol says (attention_schedule.AttentionFamily, common.SegmentFamily, cross_entropy.py
CrossEntropyFamily, gather.py GatherFamily, fused/families.py LossHeadFamily). The registries
list it beside the GPU wing's; stateless frozen dataclasses, so equal and hashable as static
arguments.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from seqpack.kernels.attention_schedule import AttentionCall, AttentionConfig, LseLayout
from seqpack.kernels.common import (
    LANES,
    PALLAS_TPU,
    SMEM_METADATA_BUDGET_BYTES,
    SegmentBlockSizes,
    SegmentCall,
    check_multiple,
    round_up,
    token_block,
)
from seqpack.kernels.metadata import MetadataLayout
from seqpack.kernels.tpu.attention import forward as attention_forward
from seqpack.kernels.tpu.attention_bwd import backward as attention_backward
from seqpack.kernels.tpu.cross_entropy import Tiling as CrossEntropyTiling
from seqpack.kernels.tpu.cross_entropy import backward_call as cross_entropy_backward
from seqpack.kernels.tpu.cross_entropy import forward_call as cross_entropy_forward
from seqpack.kernels.tpu.gather import gather_call
from seqpack.kernels.tpu.linear_cross_entropy import LinearTiling, linear_backward, linear_forward
from seqpack.kernels.tpu.segment_ops import broadcast_call, reduce_call


@dataclasses.dataclass(frozen=True)
class AttentionBlockSizes:
    """Block sizes and options of the TPU attention kernels (rows per block, forward and backward).

    Block sizes are multiples of 128 (lanes: the (bq, bk) score tile and the (1, bq) logsumexp
    rows of the dk / dv kernel); each computed block pair costs a grid step beside its matmuls.
    narrow_steps: a grid's step axis is static (L / b steps; those past a block's range cost
    only the grid loop); when L / b is larger, a second grid of `narrow_steps` steps is compiled
    and runs (`lax.cond`) whenever every range of the batch fits it. None: the full grid only.
    fused_bwd: the dk / dv kernel also forms dq (5 block matmuls a visited pair instead of 7,
    one exp pass instead of two), the group's dq resident in VMEM over the row; where that does
    not fit (tpu/attention_bwd.py `fuses`), the dq and dk / dv kernels run apart.
    The defaults are the configuration measured fastest in a training step (the tables:
    benchmarks/README.md, "On the chip").
    """

    block_q: int = 512
    block_kv: int = 512
    block_q_bwd: int = 512
    block_kv_bwd: int = 512
    narrow_steps: int | None = 8
    fused_bwd: bool = True

    def __post_init__(self) -> None:
        for name in ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd"):
            check_multiple(name, getattr(self, name), LANES, " (lanes)")
        if self.narrow_steps is not None and self.narrow_steps < 1:
            raise ValueError(f"narrow_steps={self.narrow_steps} must be >= 1 (or None)")


@dataclasses.dataclass(frozen=True)
class LinearCrossEntropyBlockSizes:
    """Block sizes of the fused loss head: the TPU kernels', whose block_vocab the XLA path reads.

    block_vocab = 512 columns: at N = 16k tokens an f32 `[N, 512]` logits block is 32 MiB, small
    next to the 2 GiB of logits at V = 32k, and each matmul stays large enough for the MXU.
    block_tokens = 256 rows (the Pallas kernels' token block). Multiples of 128 and 16.
    """

    block_tokens: int = 256
    block_vocab: int = 512

    def __post_init__(self) -> None:
        check_multiple("block_tokens", self.block_tokens, 16, " (bf16 tile rows)")
        check_multiple("block_vocab", self.block_vocab, 128, " (lanes)")


@dataclasses.dataclass(frozen=True)
class CrossEntropyBlockSizes:
    """Block sizes of the cross-entropy kernels.

    block_tokens x block_vocab = 256 x 2048: a 1 MiB bf16 logits tile (2 MiB f32), so the DMA per
    step dominates the per-step overhead, while the tile, its double buffer and the f32
    temporaries of exp / where stay well inside 16 MiB of scoped VMEM.
    block_tokens must be a multiple of 16 (bf16 tile rows), block_vocab of 128 (lanes).
    """

    block_tokens: int = 256
    block_vocab: int = 2048

    def __post_init__(self) -> None:
        check_multiple("block_tokens", self.block_tokens, 16, " (bf16 tile rows)")
        check_multiple("block_vocab", self.block_vocab, LANES, " (lanes)")


@dataclasses.dataclass(frozen=True)
class GatherBlockSizes:
    """Block sizes of the gather kernel.

    block_features: lanes per step (a multiple of 128; D itself when D is smaller). A step moves
      only rows x bd elements (16 x 2048 bf16 = 64 KiB), so wide blocks amortize the per-step cost.
    """

    block_features: int = 2048

    def __post_init__(self) -> None:
        check_multiple("block_features", self.block_features, LANES, " (lanes)")


def check_smem(batch: int, cfg: AttentionConfig) -> None:
    """The scalar-prefetched ranges (the dk / dv kernel's: 2 x (nq' + nk') i32 a row) fit SMEM."""
    per_row = 4 * 2 * max(cfg.blocks(cfg.block_q),
                          cfg.blocks(cfg.block_q_bwd) + cfg.blocks(cfg.block_kv_bwd))
    if per_row * batch > SMEM_METADATA_BUDGET_BYTES:
        raise ValueError(
            f"B={batch} rows of L={cfg.seq_len} need {per_row * batch} bytes of block ranges in "
            f"SMEM, over the {SMEM_METADATA_BUDGET_BYTES}-byte budget; pass larger block sizes, "
            f"or call on chunks of at most {max(SMEM_METADATA_BUDGET_BYTES // per_row, 1)} rows")


@dataclasses.dataclass(frozen=True)
class TpuAttention:
    """Segment attention on the Mosaic kernels: the schedule scalar-prefetched (tpu/attention.py,
    tpu/attention_bwd.py)."""

    target = PALLAS_TPU
    block_sizes = AttentionBlockSizes
    needs_schedule = True
    own_vjp = False
    lse_layout = LseLayout.BHL1
    operands = ("bhld", "blhd")  # handed [B, H, L, D]; a ring step's [B, L/C, H, D] too

    def refuses(self, call: AttentionCall) -> None:
        del call  # every dtype, head dim and head grouping; ring steps too

    def configure(self, cfg: AttentionConfig, blocks: AttentionBlockSizes,
                  batch: int) -> AttentionConfig:
        """Blocks at most L rounded up to lanes, the TPU options; refused past the SMEM budget."""
        fit = lambda b: min(b, round_up(cfg.seq_len, LANES))  # noqa: E731
        cfg = dataclasses.replace(
            cfg, block_q=fit(cfg.block_q), block_kv=fit(cfg.block_kv),
            block_q_bwd=fit(cfg.block_q_bwd), block_kv_bwd=fit(cfg.block_kv_bwd),
            narrow_steps=blocks.narrow_steps, fused_bwd=blocks.fused_bwd)
        check_smem(batch, cfg)
        return cfg

    def forward(self, q, k, v, sched, cfg: AttentionConfig):
        return attention_forward(q, k, v, sched, cfg)

    def backward(self, q, k, v, o, lse, do, sched, cfg: AttentionConfig):
        return attention_backward(q, k, v, o, lse, do, sched, cfg)


@dataclasses.dataclass(frozen=True)
class TpuSegmentOps:
    """The segment reduce and broadcast on the Mosaic kernels (tpu/segment_ops.py): flat
    metadata and the rows' ends, scalar-prefetched."""

    target = PALLAS_TPU
    block_sizes = SegmentBlockSizes
    metadata_layout = MetadataLayout.FLAT

    def reduce(self, x, offsets, lengths, ends, *, mode, st):
        return reduce_call(x, offsets, lengths, ends, mode=mode, st=st)

    def broadcast(self, values, offsets, lengths, *, out_dtype, st):
        return broadcast_call(values, offsets, lengths, out_dtype=out_dtype, st=st)


@dataclasses.dataclass(frozen=True)
class TpuLossHead:
    """The fused loss head's recompute kernels on Mosaic (tpu/linear_cross_entropy.py), which
    take per-token values as [B, L, 1] columns and skip the token blocks `meta` marks dead."""

    target = PALLAS_TPU
    block_sizes = LinearCrossEntropyBlockSizes

    def tiling(self, seq_len: int, vocab: int, dim: int,
               blocks: LinearCrossEntropyBlockSizes, softcap, interpret) -> LinearTiling:
        del dim  # a token block holds all of H
        bl = token_block(seq_len, blocks.block_tokens, 16)
        bv = vocab if vocab <= blocks.block_vocab else blocks.block_vocab
        return LinearTiling(seq_len, vocab, bl, bv, softcap, interpret=interpret)

    def forward(self, x, w, targets, mask, meta, st: LinearTiling):
        lse, tgt = linear_forward(x, w, targets[:, :, None], mask[:, :, None], meta, st=st)
        return lse[:, :, 0], tgt[:, :, 0]

    def backward(self, x, w, targets, mask, meta, lse, g_lse, g_tgt, st: LinearTiling):
        col = lambda a: a[:, :, None]  # noqa: E731
        return linear_backward(x, w, col(targets), col(mask), col(lse), col(g_lse), col(g_tgt),
                               meta, st=st)


@dataclasses.dataclass(frozen=True)
class TpuCrossEntropy:
    """The per-segment cross-entropy on Mosaic (tpu/cross_entropy.py), which takes targets and
    mask as [B, L, 1] columns and skips token blocks past the row's end; its backward turns the
    per-slot cotangents into per-token weights with this wing's broadcast kernel."""

    target = PALLAS_TPU
    block_sizes = CrossEntropyBlockSizes
    metadata_layout = MetadataLayout.FLAT

    def tiling(self, seq_len: int, vocab: int, num_segments: int, z_loss: float,
               blocks: CrossEntropyBlockSizes, interpret) -> CrossEntropyTiling:
        """Token blocks of at most L rounded up to 16 rows, vocab tiles of at most V."""
        bv = vocab if vocab <= blocks.block_vocab else blocks.block_vocab
        return CrossEntropyTiling(seq_len, vocab, num_segments, z_loss,
                                  token_block(seq_len, blocks.block_tokens, 16), bv, interpret)

    def forward(self, logits, targets, mask, offsets, lengths, used, st: CrossEntropyTiling):
        return cross_entropy_forward(logits, targets[:, :, None], mask[:, :, None], offsets,
                                     lengths, used, st=st)

    def backward(self, logits, targets, mask, lse, g_loss, offsets, lengths, used,
                 st: CrossEntropyTiling):
        scatter = SegmentCall(st.seq_len, st.num_segments, jnp.dtype(jnp.float32),
                              SegmentBlockSizes(), st.interpret, SEGMENT_OPS)
        weights = broadcast_call(g_loss[:, :, None], offsets, lengths, out_dtype=jnp.float32,
                                 st=scatter)
        weights = jnp.where(mask[:, :, None] > 0, weights, 0.0)
        return cross_entropy_backward(logits, targets[:, :, None], lse, weights, offsets,
                                      lengths, used, st=st)


@dataclasses.dataclass(frozen=True)
class TpuGather:
    """One token per segment on Mosaic (tpu/gather.py: a data-dependent index map per slot); its
    backward scatters with this wing's broadcast kernel at that kernel's default block sizes
    (a GatherBlockSizes does not configure it)."""

    target = PALLAS_TPU
    block_sizes = GatherBlockSizes
    metadata_layout = MetadataLayout.FLAT

    def scatter_call(self, seq_len: int, num_segments: int, dtype, blocks: GatherBlockSizes,
                     interpret) -> SegmentCall:
        del blocks
        return SegmentCall(seq_len, num_segments, dtype, SegmentBlockSizes(), interpret,
                           SEGMENT_OPS)

    def gather(self, x, offsets, lengths, *, k: int, num_segments: int,
               blocks: GatherBlockSizes, interpret):
        del num_segments  # the flat metadata holds B * S slots
        return gather_call(x, offsets, lengths, k=k, block_features=blocks.block_features,
                           interpret=interpret)


ATTENTION = TpuAttention()
SEGMENT_OPS = TpuSegmentOps()
CROSS_ENTROPY = TpuCrossEntropy()
GATHER = TpuGather()
LOSS_HEAD = TpuLossHead()
