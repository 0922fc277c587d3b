"""The Pallas GPU (Triton) kernels: no scalar prefetch, so metadata and schedules are int32 inputs.

One module per op (segment_ops, gather, cross_entropy, attention forward and backward),
cudnn.py (cuDNN's packed attention as a family: a library, not a kernel), and family.py: this
wing's kernel families (ATTENTION, SEGMENT_OPS, CROSS_ENTROPY, GATHER, LOSS_HEAD: their target,
block sizes, metadata layout and calls), which the public ops' registries list beside the TPU
wing's. The public ops in kernels/ check inputs, look the family up and wire the custom VJPs;
they call this wing only through its families.
"""

from seqpack.kernels.gpu.cudnn import ATTENTION as CUDNN_ATTENTION
from seqpack.kernels.gpu.family import (
    ATTENTION,
    CROSS_ENTROPY,
    GATHER,
    LOSS_HEAD,
    SEGMENT_OPS,
    GpuAttentionBlockSizes,
)

__all__ = [
    "ATTENTION",
    "CROSS_ENTROPY",
    "CUDNN_ATTENTION",
    "GATHER",
    "GpuAttentionBlockSizes",
    "LOSS_HEAD",
    "SEGMENT_OPS",
]
