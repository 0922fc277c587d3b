"""The Pallas GPU (Triton) kernel families: what each op's Registry reads of this wing.

    ATTENTION       segment_attention              GpuAttentionBlockSizes, lse f32[B, H, L]
    SEGMENT_OPS     segment reduce / broadcast     common.GpuBlockSizes, padded metadata
    CROSS_ENTROPY   segment_cross_entropy          common.GpuBlockSizes, padded metadata
    GATHER          segment_gather                 common.GpuBlockSizes, padded metadata
    LOSS_HEAD       segment_linear_cross_entropy   common.GpuBlockSizes (its head_* tiles)

Each is a small adapter: its `common.Target` (PALLAS_GPU), its block-size class, the metadata
layout it reads (metadata.MetadataLayout), and this wing's kernels called the way its op's
protocol says (attention_schedule.AttentionFamily, common.SegmentFamily, cross_entropy.py
CrossEntropyFamily, gather.py GatherFamily, fused/families.py LossHeadFamily). The registries
list it beside the TPU wing's; stateless frozen dataclasses, so equal and hashable as static
arguments.
"""

from __future__ import annotations

import dataclasses

from seqpack.kernels.attention_schedule import AttentionCall, AttentionConfig, LseLayout
from seqpack.kernels.common import (
    PALLAS_GPU,
    GpuBlockSizes,
    SegmentCall,
    check_power_of_two,
    next_power_of_two,
    tile,
)
from seqpack.kernels.gpu.attention import backward as attention_backward
from seqpack.kernels.gpu.attention import forward as attention_forward
from seqpack.kernels.gpu.cross_entropy import backward_call as cross_entropy_backward
from seqpack.kernels.gpu.cross_entropy import forward_call as cross_entropy_forward
from seqpack.kernels.gpu.gather import gather_call
from seqpack.kernels.gpu.linear_cross_entropy import LinearTiling, linear_backward, linear_forward
from seqpack.kernels.gpu.segment_ops import broadcast_call, reduce_call
from seqpack.kernels.metadata import MetadataLayout


@dataclasses.dataclass(frozen=True)
class GpuAttentionBlockSizes:
    """Tile sizes of the Triton kernels: powers of two >= 16 (Triton's dot), plus launch options.

    num_warps None: 4 for D <= 64, else 8 (jax's Pallas GPU attention does the same). Defaults are
    chosen by register budget (a 64 x 64 f32 score tile and a 64 x D accumulator per program);
    benchmarks/device_run.sh measures them (results: benchmarks/README.md).
    """

    block_q: int = 64
    block_kv: int = 64
    block_q_bwd: int = 64
    block_kv_bwd: int = 64
    num_warps: int | None = None
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd"):
            check_power_of_two(name, getattr(self, name), 16)
        if self.num_warps is not None and self.num_warps < 1:
            raise ValueError(f"num_warps={self.num_warps} must be >= 1 (or None)")
        if self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages} must be >= 1")


@dataclasses.dataclass(frozen=True)
class GpuAttention:
    """Segment attention on the Triton kernels: the schedule as loop bounds (gpu/attention.py)."""

    target = PALLAS_GPU
    block_sizes = GpuAttentionBlockSizes
    needs_schedule = True
    own_vjp = False
    lse_layout = LseLayout.BHL
    operands = ("blhd",)

    def refuses(self, call: AttentionCall) -> None:
        del call  # every dtype, head dim and head grouping; ring steps too

    def configure(self, cfg: AttentionConfig, blocks: GpuAttentionBlockSizes,
                  batch: int) -> AttentionConfig:
        """Tiles of at least 16 and at most L rounded up to a power of two; the launch options."""
        del batch  # the schedule travels as ordinary inputs: no SMEM budget
        fit = lambda b: max(16, min(b, next_power_of_two(cfg.seq_len)))  # noqa: E731
        warps = blocks.num_warps or (4 if cfg.head_dim <= 64 else 8)
        return dataclasses.replace(
            cfg, block_q=fit(cfg.block_q), block_kv=fit(cfg.block_kv),
            block_q_bwd=fit(cfg.block_q_bwd), block_kv_bwd=fit(cfg.block_kv_bwd),
            triton=(warps, blocks.num_stages))

    def forward(self, q, k, v, sched, cfg: AttentionConfig):
        return attention_forward(q, k, v, sched, cfg)

    def backward(self, q, k, v, o, lse, do, sched, cfg: AttentionConfig):
        return attention_backward(q, k, v, o, lse, do, sched, cfg)


@dataclasses.dataclass(frozen=True)
class GpuSegmentOps:
    """The segment reduce and broadcast on the Triton kernels (gpu/segment_ops.py): metadata
    padded to a power of two of slots; the rows' ends are not read."""

    target = PALLAS_GPU
    block_sizes = GpuBlockSizes
    metadata_layout = MetadataLayout.PADDED

    def reduce(self, x, offsets, lengths, ends, *, mode, st):
        del ends  # each program walks its own segment's tiles
        return reduce_call(x, offsets, lengths, mode=mode, st=st)

    def broadcast(self, values, offsets, lengths, *, out_dtype, st):
        return broadcast_call(values, offsets, lengths, out_dtype=out_dtype, st=st)


@dataclasses.dataclass(frozen=True)
class GpuLossHead:
    """The fused loss head's recompute kernels on Triton (gpu/linear_cross_entropy.py): tiles of
    the head_* sizes, H summed in head_block_hidden chunks (head_block_hidden_bwd in the
    backward); `meta` is not read."""

    target = PALLAS_GPU
    block_sizes = GpuBlockSizes

    def tiling(self, seq_len: int, vocab: int, dim: int, blocks: GpuBlockSizes, softcap,
               interpret) -> LinearTiling:
        edge = lambda size, requested: max(tile(size, requested), 16)  # noqa: E731 (tl.dot)
        return LinearTiling(seq_len, vocab, edge(seq_len, blocks.head_block_tokens),
                            edge(vocab, blocks.head_block_vocab), softcap,
                            block_hidden=edge(dim, blocks.head_block_hidden),
                            block_hidden_bwd=edge(dim, blocks.head_block_hidden_bwd),
                            num_warps=blocks.num_warps, interpret=bool(interpret))

    def forward(self, x, w, targets, mask, meta, st: LinearTiling):
        del meta
        return linear_forward(x, w, targets, mask, st=st)

    def backward(self, x, w, targets, mask, meta, lse, g_lse, g_tgt, st: LinearTiling):
        del meta
        return linear_backward(x, w, targets, mask, lse, g_lse, g_tgt, st=st)


@dataclasses.dataclass(frozen=True)
class CrossEntropyTiling:
    """Static configuration of the Triton cross-entropy (hashable: a custom_vjp nondiff
    argument); its tiles are fitted to L and V inside each call (common.tile)."""

    num_segments: int
    z_loss: float
    blocks: GpuBlockSizes
    interpret: bool


@dataclasses.dataclass(frozen=True)
class GpuCrossEntropy:
    """The per-segment cross-entropy on Triton (gpu/cross_entropy.py): targets and mask as
    [B, L]; its backward is a kernel of its own (per-token weights from the same slot compare,
    no broadcast kernel); the rows' ends are not read."""

    target = PALLAS_GPU
    block_sizes = GpuBlockSizes
    metadata_layout = MetadataLayout.PADDED

    def tiling(self, seq_len: int, vocab: int, num_segments: int, z_loss: float,
               blocks: GpuBlockSizes, interpret) -> CrossEntropyTiling:
        del seq_len, vocab  # read from the logits in each call
        return CrossEntropyTiling(num_segments, z_loss, blocks, bool(interpret))

    def forward(self, logits, targets, mask, offsets, lengths, used, st: CrossEntropyTiling):
        del used  # every program masks its own tokens
        return cross_entropy_forward(logits, targets, mask, offsets, lengths,
                                     num_segments=st.num_segments, z_loss=st.z_loss,
                                     blocks=st.blocks, interpret=st.interpret)

    def backward(self, logits, targets, mask, lse, g_loss, offsets, lengths, used,
                 st: CrossEntropyTiling):
        del used
        return cross_entropy_backward(logits, targets, mask, lse, g_loss, offsets, lengths,
                                      z_loss=st.z_loss, blocks=st.blocks, interpret=st.interpret)


@dataclasses.dataclass(frozen=True)
class GpuGather:
    """One token per segment on Triton (gpu/gather.py: one gather-load per row and lane block),
    its output sliced back from the padded slots to S; the backward scatters with this wing's
    broadcast kernel at the same GpuBlockSizes."""

    target = PALLAS_GPU
    block_sizes = GpuBlockSizes
    metadata_layout = MetadataLayout.PADDED

    def scatter_call(self, seq_len: int, num_segments: int, dtype, blocks: GpuBlockSizes,
                     interpret) -> SegmentCall:
        return SegmentCall(seq_len, num_segments, dtype, blocks, interpret, SEGMENT_OPS)

    def gather(self, x, offsets, lengths, *, k: int, num_segments: int, blocks: GpuBlockSizes,
               interpret):
        out = gather_call(x, offsets, lengths, k=k, blocks=blocks, interpret=bool(interpret))
        return out[:, :num_segments]  # drop the padding slots


ATTENTION = GpuAttention()
SEGMENT_OPS = GpuSegmentOps()
CROSS_ENTROPY = GpuCrossEntropy()
GATHER = GpuGather()
LOSS_HEAD = GpuLossHead()
