"""The Pallas GPU (Triton) kernels: no scalar prefetch, so metadata and schedules are int32 inputs.

One module per op (segment_ops, gather, cross_entropy, attention forward and backward); the public
ops in kernels/ check inputs, pick this family or the TPU one and wire the custom VJPs. The TPU
wing (kernels/tpu/) exports the same names, so a public op calls either as `family.<name>`.
"""

from seqpack.kernels.gpu.attention import backward as attention_backward
from seqpack.kernels.gpu.attention import forward as attention_forward
from seqpack.kernels.gpu.cross_entropy import backward_call as cross_entropy_backward
from seqpack.kernels.gpu.cross_entropy import forward_call as cross_entropy_forward
from seqpack.kernels.gpu.gather import gather_call
from seqpack.kernels.gpu.linear_cross_entropy import LinearTiling, linear_backward, linear_forward
from seqpack.kernels.gpu.segment_ops import broadcast_call, reduce_call

__all__ = [
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
