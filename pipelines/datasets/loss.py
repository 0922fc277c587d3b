"""Loss tokens per packed row: the denominator that makes a packed per-token mean exact.

A per-token mean over a global batch split across hosts and micro-batches equals the unpacked
one only if every part divides by the same global count of loss tokens. `LossTokens` counts,
per row, exactly the positions `kernels.segment_cross_entropy` counts with the loss mask
`LossTokens.mask(batch)` (in a segment and `loss_mask` set), and adds it to the batch as
`loss_tokens` (i32, `[B]` for a batch, a scalar for one row). The training step then computes

    loss = psum(sum of per_segment_loss over its micro-batches) / psum(sum of loss_tokens)

Which positions count (`next_token`, `labels`, `masks` as in `pipelines.datasets.columns`)::

    next_token=True  (position p predicts token p + 1, as a causal LM with unshifted labels):
        p counts  iff  seg[p] > 0, seg[p + 1] == seg[p], labels[p + 1] != -100, mask[p + 1] != 0
    next_token=False (labels[p] is position p's own target: pre-shifted labels):
        p counts  iff  seg[p] > 0, labels[p] != -100, mask[p] != 0
    no label / mask columns: only the segment conditions (all real tokens with next_token=False)

Worked example (one row, L = 6, next_token=True)::

    tokens_segment_ids   1    1    1    2    2  0
    labels            -100   12   13 -100   22  -100
    mask (counts)        1    1    0    1    0  0     -> loss_tokens = 3
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from seqpack.packer.contract import keys
from seqpack.packer.mixing import carries_loss

LOSS_TOKENS = "loss_tokens"


@dataclasses.dataclass(frozen=True)
class LossTokens:
    """Counts loss tokens per row (see the module docstring); call it on a row or batch."""

    feature: str = "tokens"
    labels: tuple[str, ...] = ()  # columns whose -100 positions take no loss
    masks: tuple[str, ...] = ()  # columns whose 0 positions take no loss
    next_token: bool = True

    def __post_init__(self) -> None:
        for name in ("labels", "masks"):
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, (getattr(self, name),))

    def mask(self, batch: dict[str, Any]) -> np.ndarray:  # bool[..., L]
        """The loss mask to pass `kernels.segment_cross_entropy` (with next-token targets when
        `next_token`); its count per row is `count(batch)`."""
        seg = np.asarray(batch[keys(self.feature).segment_ids])
        allowed = carries_loss([*((batch[n], "labels") for n in self.labels),
                                *((batch[n], "mask") for n in self.masks)], seg.shape)
        if not self.next_token:
            return (seg > 0) & allowed
        out = np.zeros(seg.shape, bool)
        out[..., :-1] = (seg[..., :-1] > 0) & (seg[..., 1:] == seg[..., :-1]) & allowed[..., 1:]
        return out

    def count(self, batch: dict[str, Any]) -> np.ndarray:  # i32[...]
        return self.mask(batch).sum(axis=-1, dtype=np.int32)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        """`batch` with `loss_tokens` added (for `ds.map(LossTokens(...))`)."""
        return {**batch, LOSS_TOKENS: self.count(batch)}
