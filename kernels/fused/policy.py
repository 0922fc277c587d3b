"""How segment_linear_cross_entropy picks its mode and chunk: the loss head's plan.

    loss_head_plan   num_tokens, vocab (this shard's columns), mode, max_logits_bytes,
                     logits_dtype -> LossHeadPlan(mode, chunk_tokens, logits_bytes)

"logits" and "chunked" (in_forward.py) form the gradients in the forward, holding a chunk's
C x V logits at once (6NHV); "recompute" holds only vocabulary blocks and recomputes them in the
backward (8-10NHV). "auto" takes the first that fits its budget: `max_logits_bytes` bounds the
stored logits (C x V x the logits dtype's size); without it, BUDGET_SHARE of the device's free
memory (read when the call is traced) bounds all a chunk holds, held_bytes a logit; on a chip
in CHIPS a chunk is also at most its knee (knee_tokens: past it a larger chunk gains under 5%
of the time, by the cost model beside CHIPS). Chunks are
balanced over the tokens and rounded up to CHUNK_MULTIPLE; where the budget allows no chunk of
MIN_CHUNK_TOKENS (or of all tokens, if fewer), "auto" recomputes. Worked example, N = 5000
tokens, V = 1000, float32 logits (4,000 bytes a token):

    max_logits_bytes   tokens that fit   plan
    5000 x 4000        5000              logits,    C = 5000
    4096 x 4000        4096              chunked,   C = 2560 (two chunks of 2500, rounded up)
     511 x 4000         384              recompute  (below MIN_CHUNK_TOKENS = 512)

A forced "chunked" takes the budget's chunk, at least CHUNK_MULTIPLE tokens; a forced "logits"
all tokens at once, whatever the budget.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import jax
from jax.typing import DTypeLike

from seqpack.kernels.checks import float_dtype
from seqpack.kernels.common import parse_enum

# Chunks are a multiple of this many tokens (MXU rows).
CHUNK_MULTIPLE = 128
# "auto" recomputes (8NHV, the kernels) when the budget allows no chunk of this many tokens:
# smaller chunks re-read and re-write the f32 d weight [H, V] too often to beat recomputing.
MIN_CHUNK_TOKENS = 512
# "auto" without max_logits_bytes: this share of the device's free memory (memory_stats()
# bytes_limit - bytes_in_use at trace time) for all a chunk holds, held_bytes a logit;
# DEFAULT_FREE_BYTES where the backend reports none (CPU).
BUDGET_SHARE = 2 / 3
DEFAULT_FREE_BYTES = 1 << 30
# The cost model of a chunk (benchmarks/README.md, "auto's chunk: the cost model"): each chunk
# reads and writes the f32 d weight [H, V] once (8HV bytes) beside 6HV FLOPs a token, so the
# head's time goes as 1 + K / C with K = (4/3) peak FLOP/s / memory bytes/s tokens, whatever H
# and V. Past K / KNEE_SHARE tokens a larger chunk saves less than KNEE_SHARE of the time while
# its memory grows in proportion, so "auto" takes no larger chunk on a chip listed here.
CHIPS = {  # a substring of jax's device_kind -> (dense bf16 FLOP/s, memory bytes/s): datasheets
    "TPU v5 lite": (197e12, 819e9),
    "TPU v5": (459e12, 2765e9),
    "TPU v6 lite": (918e12, 1640e9),
    "TPU v4": (275e12, 1228e9),
    "H100 PCIe": (756e12, 2.0e12),
    "H100": (989e12, 3.35e12),
    "H200": (989e12, 4.8e12),
    "A100": (312e12, 2.039e12),
}
KNEE_SHARE = 0.05


class LossHeadMode(enum.StrEnum):
    """How segment_linear_cross_entropy computes the loss head (`mode=`)."""

    AUTO = "auto"  # the fastest that fits max_logits_bytes (or a share of free memory)
    LOGITS = "logits"  # all logits at once, gradients in the forward (6NHV, N x V live)
    CHUNKED = "chunked"  # gradients in the forward over token chunks (6NHV, C x V live)
    RECOMPUTE = "recompute"  # lse only in the forward, the backward recomputes (8-10NHV; impl=)


@dataclasses.dataclass(frozen=True)
class LossHeadPlan:
    """What segment_linear_cross_entropy runs for a size and a budget (loss_head_plan)."""

    mode: LossHeadMode  # LOGITS, CHUNKED or RECOMPUTE, never AUTO
    chunk_tokens: int | None  # tokens a chunk (all of them for LOGITS); None for RECOMPUTE
    logits_bytes: int | None  # a chunk's stored logits, chunk_tokens x vocab x itemsize; None
    # for RECOMPUTE (its vocabulary blocks depend on impl= and block_sizes=)


def reported_free_bytes() -> int | None:
    """bytes_limit - bytes_in_use of the first local device; None where the backend reports
    none."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 (backends without memory stats raise various errors)
        stats = None
    if not stats or "bytes_limit" not in stats:
        return None
    return max(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)), 0)


def free_device_bytes() -> int:
    """reported_free_bytes(), DEFAULT_FREE_BYTES where the backend reports none."""
    free = reported_free_bytes()
    return DEFAULT_FREE_BYTES if free is None else free


def device_kind() -> str:
    """jax's device_kind of the first local device ("" where none can be read)."""
    try:
        return jax.local_devices()[0].device_kind
    except Exception:  # noqa: BLE001
        return ""


def knee_tokens(kind: str | None = None) -> int | None:
    """The chunk past which a larger one gains under KNEE_SHARE of the head's time on the chip
    `kind` (default: this one's), K / KNEE_SHARE by CHIPS; None for a chip not listed."""
    kind = device_kind() if kind is None else kind
    for name, (peak, bandwidth) in CHIPS.items():
        if name in kind:
            return math.ceil(4 / 3 * peak / bandwidth / KNEE_SHARE)
    return None


def held_bytes(itemsize: int) -> int:
    """Bytes a chunk holds a logit, beside the f32 d weight: the logit as stored, its f32
    softmax and its gradient (at most the stored size): what "auto" sizes its chunks by."""
    return 2 * itemsize + 4


def chunk_tokens(n: int, vocab: int, budget: int, least: int, itemsize: int = 4) -> int | None:
    """Tokens per chunk: n when n x vocab logits (of itemsize bytes) fit `budget`, else the
    chunks of at most budget balanced and rounded up to CHUNK_MULTIPLE; None when that is below
    `least`."""
    fit = budget // (itemsize * vocab)
    if fit >= n:
        return n
    fit = fit // CHUNK_MULTIPLE * CHUNK_MULTIPLE
    if fit < least:
        return None
    per_chunk = -(-n // -(-n // fit))
    return -(-per_chunk // CHUNK_MULTIPLE) * CHUNK_MULTIPLE


def choose(mode: LossHeadMode, n: int, vocab: int, max_logits_bytes: int | None,
           itemsize: int = 4) -> tuple[LossHeadMode, int | None]:
    """(the mode to run, its chunk) for n tokens and this shard's vocab columns, logits of
    itemsize bytes: max_logits_bytes bounds the stored logits; without it, BUDGET_SHARE of the
    free memory bounds all a chunk holds (held_bytes a logit). Unchecked: loss_head_plan checks."""
    if mode is LossHeadMode.RECOMPUTE:
        return mode, None
    if mode is LossHeadMode.LOGITS:
        return mode, n
    if max_logits_bytes is not None:
        budget, per_logit = max_logits_bytes, itemsize
    else:
        budget, per_logit = int(free_device_bytes() * BUDGET_SHARE), held_bytes(itemsize)
    if mode is LossHeadMode.CHUNKED:  # forced: the budget's chunk, at least one multiple
        chunk = chunk_tokens(n, vocab, max(budget, per_logit * vocab * CHUNK_MULTIPLE),
                             CHUNK_MULTIPLE, per_logit)
        return mode, chunk
    knee = knee_tokens()
    if knee is not None:  # no larger chunk than the chip's knee (the cost model above)
        budget = min(budget, knee * per_logit * vocab)
    chunk = chunk_tokens(n, vocab, budget, min(MIN_CHUNK_TOKENS, n), per_logit)
    if chunk is None:
        return LossHeadMode.RECOMPUTE, None
    return (LossHeadMode.LOGITS if chunk == n else LossHeadMode.CHUNKED), chunk


def loss_head_plan(num_tokens: int, vocab: int, *, mode: LossHeadMode | str = "auto",
                   max_logits_bytes: int | None = None,
                   logits_dtype: DTypeLike = "float32") -> LossHeadPlan:
    """The mode and chunk segment_linear_cross_entropy runs for `num_tokens` (B x L) and `vocab`
    (weight's columns: with vocab_axis, this shard's) with the same mode, max_logits_bytes and
    logits_dtype (the call's, or hidden's dtype where it passes None). Without max_logits_bytes
    it reads the device's free memory now, as the call does when traced. ValueError for an
    unknown mode, a budget that is not positive, a logits_dtype that is not float, or sizes out
    of range."""
    mode = parse_enum(LossHeadMode, "mode", mode)
    if max_logits_bytes is not None and max_logits_bytes <= 0:
        raise ValueError(f"{max_logits_bytes=} must be a positive byte count or None")
    if num_tokens < 0 or vocab < 1:
        raise ValueError(f"{num_tokens=} must be >= 0 and {vocab=} >= 1 (hidden [B, L, H] has "
                         "B x L tokens, weight [H, V] V columns)")
    itemsize = float_dtype("logits_dtype", logits_dtype).itemsize
    chosen, chunk = choose(mode, num_tokens, vocab, max_logits_bytes, itemsize)
    return LossHeadPlan(chosen, chunk, None if chunk is None else chunk * vocab * itemsize)
