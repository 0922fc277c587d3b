"""The Pallas GPU (Triton) kernels: no scalar prefetch, so metadata and schedules are int32 inputs.

One module per op (segment_ops, gather, cross_entropy, attention forward and backward),
cudnn.py (cuDNN's packed attention as a family: a library, not a kernel), and family.py: this
wing's kernel families (ATTENTION, SEGMENT_OPS, LOSS_HEAD: their target, block
sizes and calls), which the public ops' registries list beside the TPU wing's. The public ops in
kernels/ check inputs, look the family up and wire the custom VJPs; gather and cross-entropy
still call this wing's functions by name.
"""

from seqpack.kernels.gpu.cross_entropy import backward_call as cross_entropy_backward
from seqpack.kernels.gpu.cross_entropy import forward_call as cross_entropy_forward
from seqpack.kernels.gpu.cudnn import ATTENTION as CUDNN_ATTENTION
from seqpack.kernels.gpu.family import ATTENTION, LOSS_HEAD, SEGMENT_OPS, GpuAttentionBlockSizes
from seqpack.kernels.gpu.gather import gather_call

__all__ = [
    "ATTENTION",
    "CUDNN_ATTENTION",
    "GpuAttentionBlockSizes",
    "LOSS_HEAD",
    "SEGMENT_OPS",
    "cross_entropy_backward",
    "cross_entropy_forward",
    "gather_call",
]
