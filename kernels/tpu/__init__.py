"""The Pallas TPU (Mosaic) kernels: metadata and block schedules scalar-prefetched into SMEM.

One module per op (segment_ops, gather, cross_entropy, attention forward and attention_bwd), and
family.py: this wing's kernel families (ATTENTION, SEGMENT_OPS, LOSS_HEAD: their target, block
sizes and calls), which the public ops' registries list beside the GPU wing's. The public ops in
kernels/ check inputs, look the family up and wire the custom VJPs; gather and cross-entropy
still call this wing's functions by name.
"""

from seqpack.kernels.tpu.cross_entropy import Tiling as CrossEntropyTiling
from seqpack.kernels.tpu.cross_entropy import backward_call as cross_entropy_backward
from seqpack.kernels.tpu.cross_entropy import forward_call as cross_entropy_forward
from seqpack.kernels.tpu.family import (
    ATTENTION,
    LOSS_HEAD,
    SEGMENT_OPS,
    AttentionBlockSizes,
    LinearCrossEntropyBlockSizes,
)
from seqpack.kernels.tpu.gather import gather_call

__all__ = [
    "ATTENTION",
    "AttentionBlockSizes",
    "CrossEntropyTiling",
    "LOSS_HEAD",
    "LinearCrossEntropyBlockSizes",
    "SEGMENT_OPS",
    "cross_entropy_backward",
    "cross_entropy_forward",
    "gather_call",
]
