"""The fused loss head: the output projection and the per-segment cross-entropy in one op.

linear_cross_entropy.py holds the public function (checks, dispatch, vocab-parallel combination,
normalization); blockwise.py its XLA path (a scan over vocabulary blocks with a custom VJP that
recomputes). The Pallas kernels live in the families' wings (tpu/, gpu/).
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
