"""The segment-attention block schedule: per-token bounds, key-block ranges, transposed ranges.

Pure jnp / numpy (no kernel runs): the ranges must hold exactly the block pairs some query may
attend from (brute force over the segments), stay within the bound of the docstring, and the
TPU index maps' replay must issue no copy on the steps past a range.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.kernels import attention_schedule as sched
from seqpack.kernels import reference
from tests.helpers.kernels import metadata, random_rows, zero_padded

L, S = 200, 8
BLOCK = 32  # the fast cases share one compiled schedule per `causal` (B = 4, L, S, BLOCK)
# Many short segments; one segment filling the row; an empty row; gaps and a segment ending at L.
ROWS = [
    [(0, 3), (3, 5), (8, 1), (9, 20), (29, 7), (36, 4), (40, 60), (130, 5)],
    [(0, L)],
    [],
    [(2, 50), (60, 70), (150, 50)],
]


_segment_index = jax.jit(reference.segment_index, static_argnums=2)


@functools.partial(jax.jit, static_argnames=("seq_len", "bq", "bk", "causal"))
def _schedule(offsets, lengths, *, seq_len, bq, bk, causal):
    padded = max(-(-seq_len // bq) * bq, -(-seq_len // bk) * bk)
    start, end = sched.token_bounds(offsets, lengths, seq_len, padded)
    lo, hi = sched.block_ranges(start, end, block_q=bq, block_kv=bk,
                                num_q_blocks=-(-seq_len // bq), causal=causal)
    qlo, qhi = sched.transpose_ranges(lo, hi, -(-seq_len // bk))
    return start, end, lo, hi, qlo, qhi


def _pairs(lo, hi, num_kv_blocks):
    """bool[B, nq, nk]: the pairs a range schedule visits."""
    k = np.arange(num_kv_blocks)[None, None, :]
    return (np.asarray(lo)[:, :, None] <= k) & (k < np.asarray(hi)[:, :, None])


def test_worked_example_of_the_docstring():
    offsets, lengths = metadata([[(0, 6), (6, 1), (8, 7)]], 3)
    _, _, lo, hi, qlo, qhi = _schedule(offsets, lengths, seq_len=16, bq=4, bk=4, causal=True)
    assert lo.tolist() == [[0, 0, 2, 2]] and hi.tolist() == [[1, 2, 3, 4]]
    assert qlo.tolist() == [[0, 1, 2, 3]] and qhi.tolist() == [[2, 2, 4, 4]]
    assert sched.visited_pairs(lo, hi).tolist() == [6]
    assert sched.pair_bound(offsets, lengths, block=4, causal=True).tolist() == [7]
    assert sched.causal_triangle(16, 4) == 10
    assert sched.fetched_blocks(lo, hi, 4).tolist() == [4]  # blocks 0, 1, 2, 3: once each


@pytest.mark.parametrize("padding", ["contract", "zero_offsets"])
def test_token_bounds_match_the_segment_of_each_token(padding):
    offsets, lengths = metadata(ROWS, S)
    if padding == "zero_offsets":
        offsets, lengths = zero_padded(offsets, lengths)
    start, end, *_ = _schedule(offsets, lengths, seq_len=L, bq=BLOCK, bk=BLOCK, causal=True)
    ids = np.asarray(_segment_index(offsets, lengths, L))
    rows = np.arange(len(ROWS))[:, None]
    inside = ids < S
    slot = np.where(inside, ids, 0)
    want_start = np.where(inside, offsets[rows, slot], sched.NO_SEGMENT)
    want_end = np.where(inside, offsets[rows, slot] + lengths[rows, slot], 0)
    np.testing.assert_array_equal(np.asarray(start)[:, :L], want_start)
    np.testing.assert_array_equal(np.asarray(end)[:, :L], want_end)
    assert np.all(np.asarray(start)[:, L:] == sched.NO_SEGMENT)  # past L: outside every segment


def _check_exact(offsets, lengths, seq_len, block, causal):
    *_, lo, hi, qlo, qhi = _schedule(offsets, lengths, seq_len=seq_len, bq=block, bk=block,
                                     causal=causal)
    nb = -(-seq_len // block)
    visited = _pairs(lo, hi, nb)
    need = sched.needed_pairs(offsets, lengths, seq_len=seq_len, block=block, causal=causal)
    np.testing.assert_array_equal(visited, need)  # nothing needed is skipped, nothing else visited
    counts = sched.visited_pairs(lo, hi)
    assert np.all(counts <= sched.pair_bound(offsets, lengths, block=block, causal=causal))
    # The transposed ranges hold every visited pair (and, inside them, nothing but empty blocks).
    i = np.arange(nb)[None, :, None]
    spans = (np.asarray(qlo)[:, None, :] <= i) & (i < np.asarray(qhi)[:, None, :])
    assert np.all(spans >= visited)
    used = np.asarray(hi) > np.asarray(lo)
    assert not np.any(spans & ~visited & used[:, :, None])
    return counts


SLOW_BLOCKS = [pytest.param(b, marks=pytest.mark.slow) for b in (16, 64, 128)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block", [BLOCK, *SLOW_BLOCKS])
def test_ranges_are_exactly_the_needed_pairs(block, causal):
    offsets, lengths = metadata(ROWS, S)
    counts = _check_exact(offsets, lengths, L, block, causal)
    assert counts[2] == 0  # the empty row visits nothing
    if causal:  # one segment filling the row needs the whole triangle; short segments far less
        assert counts[1] == sched.causal_triangle(L, block)
        assert counts[0] < sched.causal_triangle(L, block)


@pytest.mark.slow
@pytest.mark.parametrize(("bq", "bk"), [(64, 32), (32, 64), (128, 16)])
def test_unequal_blocks_cover_the_needed_pairs(bq, bk):
    offsets, lengths = metadata(ROWS, S)
    *_, lo, hi, _, _ = _schedule(offsets, lengths, seq_len=L, bq=bq, bk=bk, causal=True)
    # Needed pairs at the token level, mapped to (query block, key block).
    ids = np.asarray(_segment_index(offsets, lengths, L))
    r, c = np.meshgrid(np.arange(L), np.arange(L), indexing="ij")
    visited = _pairs(lo, hi, -(-L // bk))
    for b in range(len(ROWS)):
        allowed = (ids[b][:, None] == ids[b][None, :]) & (ids[b][:, None] < S) & (c <= r)
        need = np.zeros_like(visited[b])
        need[r[allowed] // bq, c[allowed] // bk] = True
        assert np.all(visited[b] >= need)


def test_steps_past_a_range_issue_no_copy():
    offsets, lengths = metadata(ROWS, S)
    *_, lo, hi, _, _ = _schedule(offsets, lengths, seq_len=L, bq=BLOCK, bk=BLOCK, causal=True)
    nb = -(-L // BLOCK)
    fetched = sched.fetched_blocks(lo, hi, nb)
    # At most one copy per visited pair, plus one for a query block without any (its first step).
    empty = (np.asarray(hi) == np.asarray(lo)).sum(axis=1)
    assert np.all(fetched <= sched.visited_pairs(lo, hi) + empty)
    assert np.all(fetched < nb * nb)  # far from one copy per grid step


@pytest.mark.parametrize("causal", [True, False])
def test_random_rows(causal):
    rng = np.random.default_rng(0)
    for alignment in (1, 8, 32):
        offsets, lengths = random_rows(rng, len(ROWS), L, S, alignment=alignment)
        _check_exact(offsets, lengths, L, BLOCK, causal)


@st.composite
def _rows(draw):
    """A batch of valid rows of L = 200: up to S segments with gaps between them."""
    rows = []
    for _ in range(len(ROWS)):
        segments, pos = [], 0
        for _ in range(draw(st.integers(0, S))):
            start = pos + draw(st.integers(0, 20))
            if start >= L:
                break
            length = draw(st.integers(1, min(L - start, 90)))
            segments.append((start, length))
            pos = start + length
        rows.append(segments)
    return rows


@settings(max_examples=40, deadline=None)
@given(rows=_rows(), causal=st.booleans())
def test_schedule_property(rows, causal):
    offsets, lengths = metadata(rows, S)
    _check_exact(offsets, lengths, L, BLOCK, causal)


# --- one schedule for every layer (segment_attention_schedule, schedule=) -------------------


def _qk(heads=2, kv_heads=1, dim=32):
    import jax.numpy as jnp

    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.normal(size=(len(ROWS), L, heads, dim)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(len(ROWS), L, kv_heads, dim)), jnp.float32)
    return q, k


@pytest.mark.parametrize("impl", ["pallas_tpu", pytest.param("pallas_gpu", marks=pytest.mark.slow)])
def test_a_schedule_made_once_is_the_one_the_layers_run(impl):
    """segment_attention(schedule=) gives what it computes itself (and its gradients); and
    it runs the schedule it is handed (one that visits nothing gives 0): a layer computes none."""
    import jax.numpy as jnp

    from seqpack import kernels

    offsets, lengths = metadata(ROWS, S)
    q, k = _qk()
    kw = dict(impl=impl, interpret=True)
    schedule = kernels.segment_attention_schedule(
        jax.ShapeDtypeStruct(q.shape, q.dtype), k, offsets, lengths, **kw)
    attend = lambda q, k, s: kernels.segment_attention(  # noqa: E731
        q, k, k, offsets, lengths, schedule=s, **kw)
    run = (lambda s: attend(q, k, s)) if impl == "pallas_tpu" else (  # the backward: one family
        lambda s: jax.value_and_grad(lambda q, k: attend(q, k, s).sum(), argnums=(0, 1))(q, k))
    for got, want in zip(jax.tree.leaves(run(schedule)), jax.tree.leaves(run(None))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    empty = schedule._replace(lo=jnp.zeros_like(schedule.lo), hi=jnp.zeros_like(schedule.hi))
    out = kernels.segment_attention(q, k, k, offsets, lengths, schedule=empty, **kw)
    assert not np.asarray(out).any()


def test_a_schedule_of_another_call_is_refused():
    from seqpack import kernels

    offsets, lengths = metadata(ROWS, S)
    q, k = _qk()
    small = kernels.GpuAttentionBlockSizes(32, 32, 32, 32)
    schedule = kernels.segment_attention_schedule(q, k, offsets, lengths, impl="pallas_gpu",
                                                  interpret=True, block_sizes=small)
    with pytest.raises(ValueError, match="schedule= was made for another call"):
        kernels.segment_attention(q, k, k, offsets, lengths, impl="pallas_gpu", interpret=True,
                                  schedule=schedule)
    for other in (dict(causal=False, block_sizes=small),  # the same shapes, other ranges
                  dict(block_sizes=kernels.GpuAttentionBlockSizes(32, 16, 32, 32))):
        with pytest.raises(ValueError, match="another L, causality, block sizes"):
            kernels.segment_attention(q, k, k, offsets, lengths, impl="pallas_gpu",
                                      interpret=True, schedule=schedule, **other)
    assert kernels.segment_attention_schedule(q, k, offsets, lengths, impl="reference") is None
    heads_second = [jax.ShapeDtypeStruct((x.shape[0], x.shape[2], x.shape[1], x.shape[3]),
                                         x.dtype) for x in (q, k)]
    bhld = kernels.segment_attention_schedule(*heads_second, offsets, lengths, layout="bhld",
                                              impl="pallas_gpu", interpret=True,
                                              block_sizes=small)
    for a, b in zip(bhld, schedule):  # a schedule depends on the metadata, not the layout
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="not for a call with a context_parallel_axis"):
        kernels.segment_attention(q, k, k, offsets, lengths, schedule=schedule,
                                  context_parallel_axis="cp")
