"""The fused loss head: the output projection and the per-segment cross-entropy in one op.

linear_cross_entropy.py holds the public function (checks, plan, one path per mode family,
vocab-parallel combination, normalization); policy.py the plan (which mode and chunk runs for
a size and budget: loss_head_plan, what "auto" reads of the device's free memory);
in_forward.py the "logits" and "chunked" modes (the gradients formed in the forward, a chunk
of tokens at a time); blockwise.py the "recompute" mode's XLA path (a scan over vocabulary
blocks with a custom VJP that recomputes). The Pallas kernels live in the families' wings
(tpu/, gpu/).
"""

from seqpack.kernels.fused.linear_cross_entropy import (
    LinearCrossEntropyBlockSizes,
    segment_linear_cross_entropy,
)
from seqpack.kernels.fused.policy import (
    LossHeadMode,
    LossHeadPlan,
    free_device_bytes,
    loss_head_plan,
    reported_free_bytes,
)

__all__ = [
    "LinearCrossEntropyBlockSizes",
    "LossHeadMode",
    "LossHeadPlan",
    "free_device_bytes",
    "loss_head_plan",
    "reported_free_bytes",
    "segment_linear_cross_entropy",
]
