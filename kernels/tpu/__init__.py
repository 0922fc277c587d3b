"""The Pallas TPU (Mosaic) kernels: metadata and block schedules scalar-prefetched into SMEM.

One module per op (segment_ops, gather, cross_entropy, attention forward and attention_bwd); the
public ops in kernels/ check inputs, pick this family or the GPU one and wire the custom VJPs. The
GPU wing (kernels/gpu/) exports the same names, so a public op calls either as `family.<name>`.
"""

from seqpack.kernels.tpu.attention import forward as attention_forward
from seqpack.kernels.tpu.attention_bwd import backward as attention_backward
from seqpack.kernels.tpu.cross_entropy import Tiling as CrossEntropyTiling
from seqpack.kernels.tpu.cross_entropy import backward_call as cross_entropy_backward
from seqpack.kernels.tpu.cross_entropy import forward_call as cross_entropy_forward
from seqpack.kernels.tpu.gather import gather_call
from seqpack.kernels.tpu.linear_cross_entropy import LinearTiling, linear_backward, linear_forward
from seqpack.kernels.tpu.segment_ops import broadcast_call, reduce_call

__all__ = [
    "CrossEntropyTiling",
    "attention_backward",
    "attention_forward",
    "broadcast_call",
    "cross_entropy_backward",
    "cross_entropy_forward",
    "gather_call",
    "LinearTiling",
    "linear_backward",
    "linear_forward",
    "reduce_call",
]
