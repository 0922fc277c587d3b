"""Static configuration and block schedule of segment attention: which key blocks each query block
visits, computed from the row metadata.

A token attends to the tokens of its own segment (causal: up to itself), so a query block needs
only the key blocks overlapping its segments. Per row the schedule is, for every query block `i`
(rows `[i bq, (i + 1) bq)`), one contiguous key-block range `[lo_i, hi_i)`:

    lo_i = (start of the first segment touching block i) // bk
    hi_i = (causal: the block's last segment token; else: its last segment's end - 1) // bk + 1
    lo_i = hi_i = 0 when no segment touches block i (nothing is computed there)

Worked example, L = 16, bq = bk = 4, causal, segments [0, 6), [6, 7), [8, 15) (token 7 and 15 are
padding). `x` marks a visited (query block, key block) pair, `.` a skipped one:

    query block   rows     segments touching   [lo, hi)    key blocks 0 1 2 3
    0             0..3     [0, 6)              [0, 1)                 x . . .
    1             4..7     [0, 6), [6, 7)      [0, 2)                 x x . .
    2             8..11    [8, 15)             [2, 3)                 . . x .
    3             12..15   [8, 15)             [2, 4)                 . . x x

Six of the ten pairs of the causal triangle are visited. Within a visited pair an iota mask keeps
exactly (query r, key c) with `start(r) <= c < end(r)` (and `c <= r` when causal), from the
per-token bounds of `token_bounds`; boundary blocks are masked, interior blocks are fully used.
Pairs visited per row are at most `pair_bound`: sum over segments of m(m + 1) / 2 (causal) or m^2,
m = the number of blocks the segment touches (<= ceil(l / b) + 1, one more where its edges are
not block-aligned), for bq = bk = b; the masked alternatives visit the whole causal triangle
nq(nq + 1) / 2.

The backward's dk/dv kernel walks the pairs by key block: `transpose_ranges` gives, per key block
`k`, the query blocks `[qlo_k, qhi_k)` whose ranges hold `k` (contiguous, because lo and hi do
not decrease along the row; an empty query block inside it is skipped by the kernel's check
`lo_i <= k < hi_i`). Every function here is jnp (traced inside the kernels' wrappers) except the
host-side numpy counters at the end, used by tests and benchmarks/attention_bench.py.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from seqpack.kernels.common import Family, Interpret, round_up

# Segment start of a token outside every segment: above any position, so `start <= c` never holds.
NO_SEGMENT = 2**30
# The score of a masked pair, in both kernel families: finite, so max/exp never see -inf - -inf.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Static (hashable) configuration of one segment_attention call: shapes, options and the
    block sizes in effect (already fitted to L by the family that runs, `AttentionFamily`)."""

    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    scale: float
    block_q: int
    block_kv: int
    block_q_bwd: int
    block_kv_bwd: int
    interpret: Interpret
    triton: tuple[int, int] | None = None  # GPU: the Triton kernels' (num_warps, num_stages)
    narrow_steps: int | None = None  # TPU: the narrow grid's steps (AttentionBlockSizes)
    count_visits: bool = False  # kernels also return how many block pairs they computed (tests)
    # the layout q / k / v reach the kernels in: "blhd" [B, L, H, D] or "bhld" [B, H, L, D]
    operand: str = "blhd"
    fused_bwd: bool = False  # TPU backward: dq formed in the dk/dv kernel (tpu/attention_bwd.py)

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads

    def blocks(self, block: int) -> int:
        return -(-self.seq_len // block)

    @property
    def padded_len(self) -> int:
        """Length of the per-token bounds: every block of every kernel lies inside it."""
        sizes = (self.block_q, self.block_kv, self.block_q_bwd, self.block_kv_bwd)
        return max(round_up(self.seq_len, b) for b in sizes)


class LseLayout(enum.Enum):
    """The shape of a family's f32 logsumexp: its forward returns it so, its backward takes it."""

    BHL = "[B, H, L]"
    BHL1 = "[B, H, L, 1]"  # a trailing unit axis: the TPU kernels' (rows, 1) blocks

    def shape(self, batch: int, heads: int, seq_len: int) -> tuple[int, ...]:
        return (batch, heads, seq_len, 1) if self is LseLayout.BHL1 else (batch, heads, seq_len)


class AttentionCall(NamedTuple):
    """What a family's `refuses` reads of one call, before any config is built."""

    dtype: Any  # q's
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    ring: bool  # a ring step of context parallelism (runs on the schedule)


class AttentionFamily(Family, Protocol):
    """A kernel family of segment attention (its Registry: attention.py; `target`, `block_sizes`:
    common.Family). `refuses(call)`: why it turns down an AttentionCall, or None. `configure`
    fits a call's config to the family (block sizes, options; a ValueError where the call does
    not fit it). A family with `own_vjp` is differentiated by JAX as it is: `attend(q, k, v,
    offsets, lengths, cfg)` is the whole op (a library with a VJP of its own, cuDNN's). The
    others are wrapped in attention.py's custom VJP: `forward` returns (o, lse[, visits]) with
    lse in `lse_layout`; `backward` takes that lse back and returns (dq, dk, dv), with visit
    counters (grads, visits_dq, visits_dkv) when `cfg.count_visits`."""

    @property
    def needs_schedule(self) -> bool: ...  # forward / backward read make_schedule's ranges

    @property
    def own_vjp(self) -> bool: ...

    def refuses(self, call: AttentionCall) -> str | None: ...

    @property
    def lse_layout(self) -> LseLayout: ...

    @property
    def operands(self) -> tuple[str, ...]: ...  # the layouts its kernels read; the first is
    # the one segment_attention hands them (transposing other operands once, at its boundary)

    def configure(self, cfg: AttentionConfig, blocks: Any, batch: int) -> AttentionConfig: ...

    def forward(self, q: jax.Array, k: jax.Array, v: jax.Array, sched: Schedule | None,
                cfg: AttentionConfig) -> tuple[jax.Array, ...]: ...

    def backward(self, q: jax.Array, k: jax.Array, v: jax.Array, o: jax.Array, lse: jax.Array,
                 do: jax.Array, sched: Schedule | None, cfg: AttentionConfig) -> tuple: ...


class Schedule(NamedTuple):
    """The arrays the kernels read (int32): per-token bounds and the block ranges of each pass.

    Query r may see key c iff start[r] <= c < end[r] (and c <= r when the config is causal),
    in the key array's own indices; a query or key row takes part iff its `q_live` / `k_live`
    is <= its index (rows of no segment are zeroed where they enter a product). One array:
    `start` plays all three parts (make_schedule). A ring step of context parallelism
    (kernels/context_parallel.py) passes its own bounds, causality folded into `end`.
    """

    start: jax.Array  # [B, Lp] segment start of each token, NO_SEGMENT outside segments
    end: jax.Array  # [B, Lp] segment end of each token, 0 outside segments
    lo: jax.Array  # [B, nq] forward: key blocks [lo, hi) of each query block
    hi: jax.Array  # [B, nq]
    lo_bwd: jax.Array  # [B, nq'] the same with the backward block sizes (dq kernel)
    hi_bwd: jax.Array  # [B, nq']
    qlo_bwd: jax.Array  # [B, nk'] query blocks [qlo, qhi) of each key block (dk/dv kernel)
    qhi_bwd: jax.Array  # [B, nk']
    q_live: jax.Array  # [B, Lp] <= the query row's index iff it lies in a segment
    k_live: jax.Array  # [B, Lp] the same for the key rows
    stamp: jax.Array  # i32[0, causal, block_q, block_kv, block_q_bwd, block_kv_bwd]: empty,
    # its shape names what the ranges were made for, so a call of other blocks or causality
    # refuses the schedule (`stamp_of`)


def stamp_of(cfg: AttentionConfig) -> jax.Array:
    """The empty array whose shape records a config's causality and block sizes."""
    return jnp.zeros((0, int(cfg.causal), cfg.block_q, cfg.block_kv, cfg.block_q_bwd,
                      cfg.block_kv_bwd), jnp.int32)


def make_schedule(
    segment_offsets: jax.Array,  # int[B, S]
    segment_lengths: jax.Array,  # int[B, S]
    cfg: AttentionConfig,
) -> Schedule:
    """All block ranges of one call, from the metadata (a few O(B * L) jnp ops)."""
    start, end = token_bounds(segment_offsets, segment_lengths, cfg.seq_len, cfg.padded_len)
    lo, hi = block_ranges(start, end, block_q=cfg.block_q, block_kv=cfg.block_kv,
                          num_q_blocks=cfg.blocks(cfg.block_q), causal=cfg.causal)
    lo_b, hi_b = block_ranges(start, end, block_q=cfg.block_q_bwd, block_kv=cfg.block_kv_bwd,
                              num_q_blocks=cfg.blocks(cfg.block_q_bwd), causal=cfg.causal)
    qlo_b, qhi_b = transpose_ranges(lo_b, hi_b, cfg.blocks(cfg.block_kv_bwd))
    return Schedule(start, end, lo, hi, lo_b, hi_b, qlo_b, qhi_b, start, start, stamp_of(cfg))


def bounded_schedule(start: jax.Array, end: jax.Array, q_live: jax.Array, k_live: jax.Array,
                     cfg: AttentionConfig) -> Schedule:
    """The schedule of per-query key bounds [start, end) given outright (i32[B, Lp], end <=
    start where a query sees no key; causality already folded in: run it with a non-causal
    config), as `block_ranges` makes it for a causal schedule, from the bounds alone."""
    def ranges(block_q: int, block_kv: int):
        rows = cfg.blocks(block_q) * block_q
        shape = (start.shape[0], cfg.blocks(block_q), block_q)
        a, b = start[:, :rows].reshape(shape), end[:, :rows].reshape(shape)
        has = a < b
        first = jnp.min(jnp.where(has, a, NO_SEGMENT), axis=2)
        last = jnp.max(jnp.where(has, b - 1, -1), axis=2)
        used = last >= 0
        return (jnp.where(used, first // block_kv, 0).astype(jnp.int32),
                jnp.where(used, last // block_kv + 1, 0).astype(jnp.int32))

    lo, hi = ranges(cfg.block_q, cfg.block_kv)
    lo_b, hi_b = ranges(cfg.block_q_bwd, cfg.block_kv_bwd)
    qlo_b, qhi_b = transpose_ranges(lo_b, hi_b, cfg.blocks(cfg.block_kv_bwd))
    return Schedule(start, end, lo, hi, lo_b, hi_b, qlo_b, qhi_b, q_live, k_live, stamp_of(cfg))


def token_bounds(
    segment_offsets: jax.Array,  # int[B, S]
    segment_lengths: jax.Array,  # int[B, S]
    seq_len: int,
    padded_len: int,
) -> tuple[jax.Array, jax.Array]:  # i32[B, Lp], i32[B, Lp]
    """Per token, the [start, end) of its segment; (NO_SEGMENT, 0) on padding and past L.

    O(B * Lp): each non-empty segment marks its start position with its start and end, and a
    running max carries them along the row (segments are in row order and do not overlap, the
    row contract). Length-0 slots are ignored whatever their offset.
    """
    batch = segment_offsets.shape[0]
    offsets = segment_offsets.astype(jnp.int32)
    ends = offsets + segment_lengths.astype(jnp.int32)
    # A slot marks nothing when empty (index padded_len is dropped by the scatter).
    where_ = jnp.where((segment_lengths > 0) & (offsets < seq_len), offsets, padded_len)
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], where_.shape)
    start_mark = jnp.full((batch, padded_len), -1, jnp.int32)
    start_mark = start_mark.at[rows, where_].max(offsets, mode="drop")
    end_mark = jnp.zeros((batch, padded_len), jnp.int32).at[rows, where_].max(ends, mode="drop")
    start = lax.cummax(start_mark, axis=1)
    end = jnp.minimum(lax.cummax(end_mark, axis=1), seq_len)
    pos = jnp.arange(padded_len, dtype=jnp.int32)[None, :]
    inside = (start >= 0) & (pos < end)
    return jnp.where(inside, start, NO_SEGMENT), jnp.where(inside, end, 0)


def block_ranges(
    start: jax.Array,  # i32[B, Lp], token_bounds
    end: jax.Array,  # i32[B, Lp]
    *,
    block_q: int,
    block_kv: int,
    num_q_blocks: int,
    causal: bool,
) -> tuple[jax.Array, jax.Array]:  # lo, hi i32[B, nq]
    """Key-block range [lo, hi) of every query block (lo = hi = 0 for a block without segments)."""
    batch = start.shape[0]
    rows = num_q_blocks * block_q
    start = start[:, :rows].reshape(batch, num_q_blocks, block_q)
    end = end[:, :rows].reshape(batch, num_q_blocks, block_q)
    pos = jnp.arange(rows, dtype=jnp.int32).reshape(1, num_q_blocks, block_q)
    inside = start <= pos
    first = jnp.min(jnp.where(inside, start, NO_SEGMENT), axis=2)
    last = jnp.max(jnp.where(inside, pos if causal else end - 1, -1), axis=2)
    used = last >= 0
    lo = jnp.where(used, first // block_kv, 0)
    hi = jnp.where(used, last // block_kv + 1, 0)
    return lo.astype(jnp.int32), hi.astype(jnp.int32)


def transpose_ranges(
    lo: jax.Array,  # i32[B, nq]
    hi: jax.Array,  # i32[B, nq]
    num_kv_blocks: int,
) -> tuple[jax.Array, jax.Array]:  # qlo, qhi i32[B, nk]
    """Per key block k, the query blocks [qlo, qhi) spanning every i with lo_i <= k < hi_i."""
    num_q_blocks = lo.shape[1]
    k = jnp.arange(num_kv_blocks, dtype=jnp.int32)[None, None, :]
    need = (lo[:, :, None] <= k) & (k < hi[:, :, None])  # [B, nq, nk]
    used = need.any(axis=1)
    first = jnp.argmax(need, axis=1)
    last = num_q_blocks - jnp.argmax(need[:, ::-1], axis=1)
    return (jnp.where(used, first, 0).astype(jnp.int32),
            jnp.where(used, last, 0).astype(jnp.int32))


def step_block(lo, hi, step, num_blocks: int):
    """Block fetched at grid step `step` of a range [lo, hi): lo + step, clamped to the range's
    last block (Pallas issues no copy when the block index repeats) and into [0, num_blocks).

    jnp or numpy scalars / arrays alike: the TPU index maps call it, and so does the host replay
    (`fetched_blocks`) that counts the copies.
    """
    last = jnp.maximum(hi - 1, lo)
    return jnp.clip(jnp.minimum(lo + step, last), 0, num_blocks - 1)


# -- host-side counters (numpy), for tests and benchmarks ---------------------------------------
def visited_pairs(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:  # int[B]
    """Pairs of blocks the kernels compute per row: sum over query blocks of hi - lo."""
    return (np.asarray(hi, np.int64) - np.asarray(lo, np.int64)).sum(axis=1)


def needed_pairs(offsets: np.ndarray, lengths: np.ndarray, *, seq_len: int, block: int,
                 causal: bool) -> np.ndarray:  # bool[B, nq, nk]
    """Brute force: (i, k) holds some query of block i that may see some key of block k."""
    nb = -(-seq_len // block)
    need = np.zeros((offsets.shape[0], nb, nb), bool)
    for b, (offs, lens) in enumerate(zip(np.asarray(offsets), np.asarray(lengths))):
        for o, n in zip(offs.tolist(), lens.tolist()):
            if n <= 0:
                continue
            first, last = o // block, (o + n - 1) // block
            for i in range(first, last + 1):
                top = min(i, last) if causal else last
                need[b, i, first:top + 1] = True
    return need


def pair_bound(offsets: np.ndarray, lengths: np.ndarray, *, block: int,
               causal: bool) -> np.ndarray:  # int[B]
    """Upper bound on visited pairs per row (bq = bk = block): sum over segments of m(m + 1)/2
    (causal) or m^2, m = blocks the segment touches (<= ceil(l / block) + 1)."""
    offsets, lengths = np.asarray(offsets, np.int64), np.asarray(lengths, np.int64)
    first = offsets // block
    last = (offsets + np.maximum(lengths, 1) - 1) // block
    m = np.where(lengths > 0, last - first + 1, 0)
    return (m * (m + 1) // 2 if causal else m * m).sum(axis=1)


def causal_triangle(seq_len: int, block: int) -> int:
    """Pairs per row a masked kernel computes under the causal mask: nq(nq + 1) / 2."""
    nb = -(-seq_len // block)
    return nb * (nb + 1) // 2


def fetched_blocks(lo: np.ndarray, hi: np.ndarray, num_blocks: int) -> np.ndarray:  # int[B]
    """Key-block copies the TPU forward issues per row and head: the host replay of its index
    map (`step_block` over L / bk steps per query block), counting block-index changes."""
    lo, hi = np.asarray(lo), np.asarray(hi)
    steps = np.arange(num_blocks)[None, None, :]
    seq = np.asarray(step_block(lo[:, :, None], hi[:, :, None], steps, num_blocks))
    seq = seq.reshape(lo.shape[0], -1)
    return 1 + (seq[:, 1:] != seq[:, :-1]).sum(axis=1)
