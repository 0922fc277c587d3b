"""The Pallas TPU (Mosaic) kernels: metadata and block schedules scalar-prefetched into SMEM.

One module per op (segment_ops, gather, cross_entropy, attention forward and attention_bwd), and
family.py: this wing's kernel families (ATTENTION, SEGMENT_OPS, CROSS_ENTROPY, GATHER,
LOSS_HEAD: their target, block sizes, metadata layout and calls), which the public ops'
registries list beside the GPU wing's. The public ops in kernels/ check inputs, look the family
up and wire the custom VJPs; they call this wing only through its families.
"""

from seqpack.kernels.tpu.family import (
    ATTENTION,
    CROSS_ENTROPY,
    GATHER,
    LOSS_HEAD,
    SEGMENT_OPS,
    AttentionBlockSizes,
    CrossEntropyBlockSizes,
    GatherBlockSizes,
    LinearCrossEntropyBlockSizes,
)

__all__ = [
    "ATTENTION",
    "AttentionBlockSizes",
    "CROSS_ENTROPY",
    "CrossEntropyBlockSizes",
    "GATHER",
    "GatherBlockSizes",
    "LOSS_HEAD",
    "LinearCrossEntropyBlockSizes",
    "SEGMENT_OPS",
]
