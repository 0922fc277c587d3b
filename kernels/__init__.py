"""Pallas kernels (TPU, GPU) over packed rows: per-segment reduce, gather, broadcast, cross-entropy,
the fused loss head (`segment_linear_cross_entropy`: the output projection inside the loss, no
logits; `loss_head_plan`: the mode and chunk it runs for a size and budget), and segment
attention (`segment_attention`: only the blocks its segments need; `segment_attention_schedule`:
its block schedule made once per batch for every layer).

All functions take the packed-row metadata (docs/contract.md), `segment_offsets` / `segment_lengths`
i32[B, S], and treat every segment as its own example (padding and empty slots excluded). A slot is
defined by (offset, length) alone: length 0 means unused, whatever its offset, so metadata from any
packer works; `segment_metadata` builds it from [B, L] segment ids (Grain / MaxText).
Options: `impl="auto" | "pallas" | "pallas_tpu" | "pallas_gpu" | "reference"` (auto: the TPU kernels
on TPU, the GPU (Triton) kernels on GPU, the jnp reference elsewhere; see common.resolve_impl;
segment_attention also takes "cudnn": cuDNN's packed attention on a Hopper GPU, guarded) and
`interpret=` (True, or `pltpu.InterpretParams()` for the TPU kernels) to run either Pallas family
on CPU. Every function is jitted (options static) and differentiable. `validate_segments` checks
metadata values before jit.

Files: per op a public module with checks, dispatch and the custom VJP (segment_ops.py, gather.py,
cross_entropy.py, attention.py; the fused loss head's in the wing fused/, with its XLA path);
its kernels live in two wings, tpu/<op>.py (Mosaic, plus tpu/attention_bwd.py) and gpu/<op>.py
(Triton), which import only the shared modules, never each other: common.py (the family
registry, block sizes, launch), attention_schedule.py (the attention block schedule and its
family protocol), metadata.py (the row metadata in the MetadataLayout each family declares),
checks.py (input checks); reference.py holds the pure-jnp references. Each wing's family.py
holds its kernel families (target, block sizes, metadata layout, calls); attention.py,
segment_ops.py, cross_entropy.py, gather.py and fused/families.py list them in a
`common.Registry` (FAMILIES), which `impl=` looks up.
"""

try:
    import jax  # noqa: F401
except ImportError as e:  # kernels import nothing from the other layers, so no shared helper
    raise ImportError(f"seqpack.kernels needs jax: pip install 'seqpack[jax]' (from a clone: "
                      f"pip install '.[jax]'; on TPU 'seqpack[tpu]') ({e})") from None


from seqpack.kernels import reference
from seqpack.kernels.attention import (
    AttentionBlockSizes,
    GpuAttentionBlockSizes,
    segment_attention,
    segment_attention_schedule,
)
from seqpack.kernels.checks import validate_segments
from seqpack.kernels.common import GpuBlockSizes, Impl, Normalize, SegmentBlockSizes
from seqpack.kernels.cross_entropy import CrossEntropyBlockSizes, segment_cross_entropy
from seqpack.kernels.fused import (
    LinearCrossEntropyBlockSizes,
    LossHeadMode,
    LossHeadPlan,
    loss_head_plan,
    segment_linear_cross_entropy,
)
from seqpack.kernels.gather import GatherBlockSizes, segment_gather
from seqpack.kernels.metadata import segment_metadata
from seqpack.kernels.segment_ops import (
    segment_broadcast,
    segment_dataset_loss,
    segment_max,
    segment_mean,
    segment_sum,
)

__all__ = [
    "segment_dataset_loss",
    "AttentionBlockSizes",
    "CrossEntropyBlockSizes",
    "GatherBlockSizes",
    "GpuAttentionBlockSizes",
    "GpuBlockSizes",
    "Impl",
    "LinearCrossEntropyBlockSizes",
    "LossHeadMode",
    "LossHeadPlan",
    "Normalize",
    "SegmentBlockSizes",
    "loss_head_plan",
    "reference",
    "segment_attention",
    "segment_attention_schedule",
    "segment_broadcast",
    "segment_cross_entropy",
    "segment_gather",
    "segment_linear_cross_entropy",
    "segment_max",
    "segment_mean",
    "segment_metadata",
    "segment_sum",
    "validate_segments",
]
