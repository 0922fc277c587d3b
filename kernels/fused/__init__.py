"""The fused loss head: the output projection and the per-segment cross-entropy in one op.

linear_cross_entropy.py holds the public function (checks, dispatch, vocab-parallel combination,
normalization); in_forward.py its "logits" and "chunked" modes (the gradients formed in the
forward, a chunk of tokens at a time) and how "auto" chooses; blockwise.py the "recompute" mode's
XLA path (a scan over vocabulary blocks with a custom VJP that recomputes). The Pallas kernels
live in the families' wings (tpu/, gpu/).
"""

from seqpack.kernels.fused.in_forward import LossHeadMode
from seqpack.kernels.fused.linear_cross_entropy import (
    LinearCrossEntropyBlockSizes,
    segment_linear_cross_entropy,
)

__all__ = [
    "LinearCrossEntropyBlockSizes",
    "LossHeadMode",
    "segment_linear_cross_entropy",
]
