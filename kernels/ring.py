"""Ring attention over packed rows: `segment_attention(..., context_parallel_axis=)` under
`shard_map`, each of C ranks holding its shard of the load-balanced layout (context_parallel.py).

    step s = 0 .. C-1 on rank r: keys / values of rank r - s and their row positions (passed
    on by `ppermute`)
      schedule   context_parallel.pair_schedule(r, r - s): per query the keys it may see
      compute    the kernels over that schedule (lax.cond: a step whose ranges are all empty
                 issues no kernel), a partial (o_s, lse_s) of these keys
      merge      lse = logaddexp(lse, lse_s); o = o e^(lse_old - lse) + o_s e^(lse_s - lse)

Worked example, C = 2, rows of one long segment: step 0 is rank r against itself, step 1 rank 0
against rank 1's keys (its late chunk sees all of them, its early chunk none) and rank 1 against
rank 0's (its middle chunks see rank 0's early chunk): every step has work on every rank. Rows
of many short segments, each inside one rank's chunks, leave step 1 empty: no kernel runs.

The backward (a `custom_vjp` over the whole ring) walks the same steps: dq accumulates where it
is, dk / dv accumulate in f32 buffers that travel with the keys and values and go home with one
last `ppermute`; each step's kernels take the final output and logsumexp (the flash backward).
Unseen rows carry lse = MASK_VALUE (the kernels write it) so merging never sees -inf - -inf.
Under the TPU interpreter (`pltpu.InterpretParams`), which holds every device at a barrier
before each kernel, a rank that skipped a step would leave the others waiting: there every step
runs its kernels (an empty schedule computes nothing, the counters stay 0).
The reference (`reference_ring`) is the same ring over `context_parallel.reference_step`,
differentiated by autodiff (ppermute transposes to the reverse shift).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from seqpack.kernels.attention_schedule import MASK_VALUE, AttentionConfig, AttentionFamily
from seqpack.kernels.context_parallel import (
    Rows,
    pair_schedule,
    rank_positions,
    reference_step,
    rows_at,
)


class Ring(NamedTuple):
    """Static description of one ring (hashable: a nondiff argument of the custom_vjp)."""

    axis: str  # the mesh axis the row is split over
    size: int  # C, its size
    seq_len: int  # L of the whole row (C x the local length)
    causal: bool
    scale: float
    family: AttentionFamily | None = None  # the kernels that run; None: the reference
    cfg: AttentionConfig | None = None  # the kernels' config: local shapes, non-causal
    count: bool = False  # also return each step's visit counters and ranges (tests)
    skip: bool = True  # False: every step runs its kernels (the TPU interpreter, see below)
    layout: str = "te"  # the layout local_positions computes: "te" or "rotated"


def _shift(x: Any, ring: Ring) -> Any:
    """Every rank's `x` to the next rank (a pytree)."""
    return lax.ppermute(x, ring.axis, [(j, (j + 1) % ring.size) for j in range(ring.size)])


def local_positions(offsets: jax.Array, lengths: jax.Array, ring: Ring) -> jax.Array:
    """This rank's row positions i32[B, L/C] in `ring.layout`, from the metadata."""
    return rank_positions(offsets, lengths, lax.axis_index(ring.axis), seq_len=ring.seq_len,
                          context_parallel=ring.size, layout=ring.layout)


def _rows(offsets: jax.Array, lengths: jax.Array, pos: jax.Array, ring: Ring) -> Rows:
    return rows_at(offsets, lengths, pos, seq_len=ring.seq_len)


def _merge(o: jax.Array, lse: jax.Array, o_s: jax.Array, lse_s: jax.Array):
    """Two partial results (o f32[B, l, H, D], lse f32[B, H, l]) as one."""
    total = jnp.logaddexp(lse, lse_s)
    weight = lambda x: jnp.exp(x - total).transpose(0, 2, 1)[..., None]  # noqa: E731
    return o * weight(lse) + o_s.astype(jnp.float32) * weight(lse_s), total


def _vary(x: Any, ring: Ring) -> Any:
    """Fresh buffers (a pytree) as values that differ per rank, as the ring's carries do (what
    shard_map's check_vma wants of a loop carry or of both branches of a cond)."""
    return lax.pcast(x, ring.axis, to="varying")


def _start(q: jax.Array, ring: Ring):
    batch, local, heads, _ = q.shape
    return _vary((jnp.zeros(q.shape, jnp.float32),
                  jnp.full((batch, heads, local), MASK_VALUE, jnp.float32)), ring)


def reference_ring(q, k, v, offsets, lengths, positions, ring: Ring) -> jax.Array:
    """The ring over dense jnp steps; differentiable by autodiff. `positions`: this rank's
    tokens' row positions, i32[B, L/C] (`local_positions`, or the batch's)."""
    mine = _rows(offsets, lengths, positions, ring)
    o, lse = _start(q, ring)
    kv = (k, v, positions)
    for s in range(ring.size):
        kv = _shift(kv, ring) if s else kv
        theirs = _rows(offsets, lengths, kv[2], ring)
        o_s, lse_s = reference_step(q, *kv[:2], mine, theirs, causal=ring.causal,
                                    scale=ring.scale)
        o, lse = _merge(o, lse, o_s, lse_s)
    return o.astype(q.dtype)


def _steps(step, first_carry, ring: Ring, shift_parts: int):
    """step(s, carry) for s = 0 .. C-1; before each s >= 1 the carry's first `shift_parts`
    entries move one rank on. The kernels are traced twice (step 0, the loop body)."""
    carry = step(0, first_carry)

    def body(s, carry):
        return step(s, (*_shift(carry[:shift_parts], ring), *carry[shift_parts:]))

    return lax.fori_loop(1, ring.size, body, carry)


def _record(log: dict, s, **values) -> dict:
    """The debug log with this step's values at index s (count=True only)."""
    return {k: log[k].at[s].set(values[k].astype(log[k].dtype)) for k in log}


def _scheduler(offsets, lengths, positions, ring: Ring):
    """(key positions, backward) -> (this rank's schedule against the keys it holds at a ring
    step, whether the step runs its kernels: its pass's ranges hold a pair, or the ring never
    skips)."""
    mine = _rows(offsets, lengths, positions, ring)

    def at(key_positions, backward: bool):
        theirs = _rows(offsets, lengths, key_positions, ring)
        sched = pair_schedule(mine, theirs, ring.cfg, causal=ring.causal)
        lo, hi = (sched.lo_bwd, sched.hi_bwd) if backward else (sched.lo, sched.hi)
        return sched, jnp.any(hi > lo) | (not ring.skip)

    return at


def _forward(q, k, v, offsets, lengths, positions, ring: Ring, log: dict):
    schedule = _scheduler(offsets, lengths, positions, ring)
    batch, local, heads, _ = q.shape

    def step(s, carry):
        kv, o, lse, log = carry  # kv: keys, values and their row positions
        sched, ran = schedule(kv[2], False)

        def run(acc):
            out = ring.family.forward(q, *kv[:2], sched, ring.cfg)
            o2, lse2 = _merge(*acc[:2], out[0], out[1].reshape(batch, heads, local))
            return o2, lse2, out[2] if ring.count else acc[2]

        visits = _vary(jnp.zeros((batch, heads, ring.cfg.blocks(ring.cfg.block_q)), jnp.int32),
                       ring)
        o, lse, visits = lax.cond(ran, run, lambda acc: acc, (o, lse, visits))
        if ring.count:
            log = _record(log, s, ran=ran, visits_fwd=visits, lo=sched.lo, hi=sched.hi)
        return kv, o, lse, log

    _, o, lse, log = _steps(step, ((k, v, positions), *_start(q, ring), _vary(log, ring)), ring,
                            1)
    return o.astype(q.dtype), lse, log


def _backward(q, k, v, offsets, lengths, positions, o, lse, do, ring: Ring, log: dict):
    schedule = _scheduler(offsets, lengths, positions, ring)
    lse = lse.reshape(ring.family.lse_layout.shape(*lse.shape))  # as the family's forward
    f32 = lambda x: _vary(jnp.zeros(x.shape, jnp.float32), ring)  # noqa: E731

    def step(s, carry):
        kv, dkv, dq, log = carry
        sched, ran = schedule(kv[2], True)

        def run(acc):
            out = ring.family.backward(q, *kv[:2], o, lse, do, sched, ring.cfg)
            dq_s, dk_s, dv_s = out[0] if ring.count else out
            counts = out[1:] if ring.count else acc[2]
            return (acc[0] + dq_s, (acc[1][0] + dk_s, acc[1][1] + dv_s), counts)

        counts = _vary((
            jnp.zeros((q.shape[0], q.shape[2], ring.cfg.blocks(ring.cfg.block_q_bwd)), jnp.int32),
            jnp.zeros((k.shape[0], k.shape[2], ring.cfg.blocks(ring.cfg.block_kv_bwd)),
                      jnp.int32)), ring)
        dq, dkv, counts = lax.cond(ran, run, lambda acc: acc, (dq, dkv, counts))
        if ring.count:
            log = _record(log, s, visits_dq=counts[0], visits_dkv=counts[1], lo_bwd=sched.lo_bwd,
                          hi_bwd=sched.hi_bwd)
        return kv, dkv, dq, log

    _, dkv, dq, log = _steps(step, ((k, v, positions), (f32(k), f32(v)), f32(q),
                                    _vary(log, ring)), ring, 2)
    dk, dv = _shift(dkv, ring)  # home: the buffers of rank r + 1's keys reach rank r + 1
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)), log


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def pallas_ring(q, k, v, offsets, lengths, positions, ring: Ring) -> jax.Array:
    """The ring over the kernels of `ring.family`; its backward is the ring's."""
    return _forward(q, k, v, offsets, lengths, positions, ring, {})[0]


def _pallas_ring_fwd(q, k, v, offsets, lengths, positions, ring):
    o, lse, _ = _forward(q, k, v, offsets, lengths, positions, ring, {})
    return o, (q, k, v, offsets, lengths, positions, o, lse)


def _pallas_ring_bwd(ring, residuals, do):
    q, k, v, offsets, lengths, positions, o, lse = residuals
    grads, _ = _backward(q, k, v, offsets, lengths, positions, o, lse, do, ring, {})
    return (*grads, None, None, None)


pallas_ring.defvjp(_pallas_ring_fwd, _pallas_ring_bwd)


def ring_visits(q, k, v, offsets, lengths, positions, do, ring: Ring) -> dict[str, jax.Array]:
    """Debug: the ring's results and, per step, whether it ran, the kernels' visit counters and
    the schedule's ranges (`attention.visited_block_pairs` with a context_parallel_axis)."""
    ring = ring._replace(count=True)
    cfg, C, batch = ring.cfg, ring.size, q.shape[0]
    blocks = lambda b: cfg.blocks(b)  # noqa: E731
    zeros = lambda *shape: jnp.zeros((C, *shape), jnp.int32)  # noqa: E731
    log = {"ran": jnp.zeros((C,), bool), "visits_fwd": zeros(batch, cfg.heads, blocks(cfg.block_q)),
           "lo": zeros(batch, blocks(cfg.block_q)), "hi": zeros(batch, blocks(cfg.block_q))}
    o, lse, log = _forward(q, k, v, offsets, lengths, positions, ring, log)
    blog = {"visits_dq": zeros(batch, cfg.heads, blocks(cfg.block_q_bwd)),
            "visits_dkv": zeros(batch, cfg.kv_heads, blocks(cfg.block_kv_bwd)),
            "lo_bwd": zeros(batch, blocks(cfg.block_q_bwd)),
            "hi_bwd": zeros(batch, blocks(cfg.block_q_bwd))}
    (dq, dk, dv), blog = _backward(q, k, v, offsets, lengths, positions, o, lse, do, ring, blog)
    return {**log, **blog, "o": o, "dq": dq, "dk": dk, "dv": dv}
