"""Packing for context parallelism: PackConfig(context_parallel=C) aligns every segment to 2C
(offline, streaming, concat_split), and `context_parallel_order` is TransformerEngine's
load-balanced THD layout (checked against a literal transcription of TE's index kernel)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.packer import (
    PackConfig,
    StreamPlanner,
    assemble,
    context_parallel_order,
    pack,
    pack_stream,
    plan,
    rank_work,
    stats,
    tight_lower_bound,
    validate,
)
from seqpack.packer.plan import aligned
from tests.helpers.packer import check_lossless, corpus


def te_partitioned_indices(cu_seqlens: list[int], total_tokens: int, world: int, rank: int):
    """TransformerEngine's thd_partition_indices_kernel, line by line (transformer_engine/common/
    fused_attn/context_parallel.cu at 045b84834454), for one rank: its tokens' global indices."""
    cu = [c // world for c in cu_seqlens]
    out = []
    for token in range(total_tokens // world):
        left, right = 1, len(cu) - 1  # binary_search(token, cu, batch + 1)
        while left < right:
            mid = (left + right) // 2
            if cu[mid] <= token:
                left = mid + 1
            else:
                right = mid
        seq = left - 1
        seq_len = cu[seq + 1] - cu[seq]
        index = token - cu[seq]
        offset = rank if index < seq_len // 2 else (world - 1) * 2 - rank
        out.append(index + cu[seq] * world + seq_len // 2 * offset)
    return out


def _spans(offsets, lengths, L, C):
    used = [(o, n) for o, n in zip(offsets, lengths) if n > 0]
    end = max((o + n for o, n in used), default=0)
    return sorted({0, *(o for o, _ in used), int(aligned(np.int64(end), 2 * C)), L})


def test_worked_example_of_the_docstring():
    order = context_parallel_order([0, 8, 11], [5, 3, 0], seq_len=16, context_parallel=2)
    assert order.tolist() == [0, 1, 6, 7, 8, 11, 12, 15, 2, 3, 4, 5, 9, 10, 13, 14]
    assert order.dtype == np.int32


def _drawn_rows(C, lengths, data):
    """(config, offsets, lengths) of rows packed for C ranks, seq_len a drawn multiple of 2C."""
    config = PackConfig(2 * C * data.draw(st.integers(4, 24)), max_segments=4, overflow="split",
                        context_parallel=C)
    rows = pack([np.arange(n) for n in lengths], config)
    return config, rows["tokens_segment_offsets"], rows["tokens_segment_lengths"]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.lists(st.integers(0, 40), min_size=1, max_size=12), st.data())
def test_order_is_transformer_engines_layout(C, lengths, data):
    config, offs, lens = _drawn_rows(C, lengths, data)
    order = context_parallel_order(offs, lens, seq_len=config.seq_len, context_parallel=C)
    L, local = config.seq_len, config.seq_len // C
    for b in range(offs.shape[0]):
        assert sorted(order[b].tolist()) == list(range(L))  # a permutation
        cu = _spans(offs[b].tolist(), lens[b].tolist(), L, C)
        for r in range(C):
            mine = order[b, r * local : (r + 1) * local].tolist()
            assert mine == te_partitioned_indices(cu, L, C, r)
            assert mine == sorted(mine)  # each rank keeps the row's order


def test_the_layout_permutes_the_rows_and_balances_full_segments():
    C = 4
    config = PackConfig(64, max_segments=4, context_parallel=C)
    rows = pack([np.arange(1, 17), np.arange(1, 25), np.arange(1, 9)], config)
    offs, lens = rows["tokens_segment_offsets"], rows["tokens_segment_lengths"]
    order = context_parallel_order(offs, lens, seq_len=64, context_parallel=C)
    ids = np.take_along_axis(rows["tokens_segment_ids"], order, axis=1)
    pos = np.take_along_axis(rows["tokens_positions"], order, axis=1)
    back = np.argsort(order, axis=1)
    np.testing.assert_array_equal(np.take_along_axis(ids, back, axis=1),
                                  rows["tokens_segment_ids"])
    # segments of a multiple of 2C tokens: every rank does exactly the same causal work
    work = rank_work(offs, lens, seq_len=64, context_parallel=C)
    assert (work == work[:, :1]).all()
    # the work is the positions + 1 of each rank's tokens
    mine = np.where(ids > 0, pos + 1, 0).reshape(ids.shape[0], C, -1).sum(axis=2)
    np.testing.assert_array_equal(work, mine)
    contiguous = rank_work(offs, lens, seq_len=64, context_parallel=C, balanced=False)
    assert contiguous.max() > 1.5 * contiguous.mean()
    assert work.sum() == contiguous.sum()


def test_rank_work_counts_each_tokens_causal_keys():
    offs, lens = np.array([[0, 8, 12]]), np.array([[5, 3, 0]])
    work = rank_work(offs, lens, seq_len=16, context_parallel=2, balanced=False)
    assert work.tolist() == [[1 + 2 + 3 + 4 + 5, 1 + 2 + 3]]


def test_order_refuses_rows_not_packed_for_it():
    with pytest.raises(ValueError, match=r"segment_offsets\[0, 1\]=5 .*context_parallel=2"):
        context_parallel_order([[0, 5]], [[5, 3]], seq_len=16, context_parallel=2)
    with pytest.raises(ValueError, match="seq_len=18 must be a positive multiple"):
        context_parallel_order([[0]], [[5]], seq_len=18, context_parallel=2)
    with pytest.raises(ValueError, match="context_parallel=0"):
        context_parallel_order([[0]], [[5]], seq_len=16, context_parallel=0)


def test_config_checks_and_records_context_parallel():
    assert PackConfig(48, segment_alignment=3, context_parallel=4).alignment == 24
    assert PackConfig(48, segment_alignment=3).alignment == 3
    assert PackConfig(16, context_parallel=np.int64(2)).context_parallel == 2
    for bad in (0, -1, 2.0, True, "2"):
        with pytest.raises(ValueError, match="context_parallel="):
            PackConfig(16, context_parallel=bad)
    with pytest.raises(ValueError, match=r"seq_len=20 must be a multiple of 8 \(2 x "
                                         r"context_parallel=4\); pick seq_len=16"):
        PackConfig(20, context_parallel=4)
    assert "context_parallel" not in PackConfig(16).to_dict()  # None: as before it existed
    cfg = PackConfig(16, context_parallel=2)
    assert cfg.to_dict()["context_parallel"] == 2
    assert PackConfig(**cfg.to_dict()) == cfg


def _check_cp_rows(batch, config: PackConfig) -> None:
    validate(batch, config)
    two_c = 2 * config.context_parallel
    lens, offs = batch["tokens_segment_lengths"], batch["tokens_segment_offsets"]
    assert (offs[lens > 0] % config.alignment == 0).all()
    # spans: to the next segment's start, the last one's end rounded up: multiples of 2C
    for o, n in zip(offs.tolist(), lens.tolist()):
        spans = np.diff(_spans(o, n, config.seq_len, config.context_parallel))
        assert (spans % two_c == 0).all()


@st.composite
def cp_configs(draw):
    C = draw(st.sampled_from([1, 2, 3, 4]))
    align = draw(st.sampled_from([1, 1, 2, 3]))
    a = int(np.lcm(align, 2 * C))
    return PackConfig(a * draw(st.integers(1, 8)), max_segments=draw(st.integers(1, 6)),
                      strategy=draw(st.sampled_from(
                          ["first_fit", "best_fit", "best_fit_decreasing", "concat_split"])),
                      overflow="split", segment_alignment=align, context_parallel=C)


@settings(max_examples=120, deadline=None)
@given(cp_configs(), st.lists(st.integers(0, 60), max_size=50))
def test_every_strategy_aligns_segments_to_2c_and_loses_nothing(config, lengths):
    if config.strategy == "concat_split":
        config = dataclasses.replace(config, overflow="error")
    values, offsets = corpus(lengths)
    p = plan(np.diff(offsets), config)
    batch = assemble(values, offsets, p, config)
    _check_cp_rows(batch, config)
    check_lossless(batch, values, offsets, config,
                   cut_anywhere=config.strategy == "concat_split")
    s = stats(batch)  # the alignment padding is padding: efficiency counts real tokens
    assert s.real_tokens == sum(lengths)
    if s.num_rows:
        assert s.padding_fraction == pytest.approx(1 - sum(lengths) / (s.num_rows * config.seq_len))


@settings(max_examples=60, deadline=None)
@given(cp_configs(), st.lists(st.integers(1, 60), min_size=1, max_size=60), st.integers(1, 16))
def test_streaming_aligns_segments_to_2c(config, lengths, window):
    if config.strategy in ("first_fit", "concat_split"):
        config = dataclasses.replace(config, strategy="best_fit_decreasing")
    values, offsets = corpus(lengths)
    examples = [values[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    rows = list(pack_stream(examples, config, window=window))
    batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    _check_cp_rows(batch, config)
    check_lossless(batch, values, offsets, config)
    assert StreamPlanner(config, window=window).config.alignment == config.alignment


def test_rows_stay_near_the_bound_on_the_padded_lengths():
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(5.5, 1.0, 20000).astype(np.int64) + 1, 4096)
    for C in (2, 8):
        config = PackConfig(4096, max_segments=64, context_parallel=C)
        p = plan(lengths, config)
        bound = tight_lower_bound(aligned(lengths, 2 * C), 4096, 64)
        assert p.num_rows <= bound * 1.002 + 1, (C, p.num_rows, bound)
        plain = plan(lengths, PackConfig(4096, max_segments=64))
        assert p.num_rows >= plain.num_rows  # the padding costs rows, never saves them


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.lists(st.integers(0, 40), min_size=1, max_size=12), st.data(),
       st.sampled_from(["rotated", "balanced"]))
def test_other_layouts_give_each_rank_one_mirrored_pair_of_every_span(C, lengths, data, layout):
    config, offs, lens = _drawn_rows(C, lengths, data)
    order = context_parallel_order(offs, lens, seq_len=config.seq_len, context_parallel=C,
                                   layout=layout)
    L, local = config.seq_len, config.seq_len // C
    for b in range(offs.shape[0]):
        assert sorted(order[b].tolist()) == list(range(L))
        cu = _spans(offs[b].tolist(), lens[b].tolist(), L, C)
        pairs = []
        for r in range(C):
            mine = order[b, r * local : (r + 1) * local]
            assert (np.diff(mine) > 0).all()  # each rank keeps the row's order
            for s, e in zip(cu[:-1], cu[1:]):
                chunk = (e - s) // (2 * C)
                got = sorted({int(t - s) // chunk for t in mine if s <= t < e})
                assert len(got) == 2 and got[0] + got[1] == 2 * C - 1, (r, s, got)
                pairs.append((s, r, got[0]))
        # across the spans the pairs turn: each rank holds a pair other than TE's somewhere
        if layout == "rotated" and C > 1 and len(cu) > 3:
            assert any(p != r for _, r, p in pairs)


def test_other_layouts_even_rows_of_many_short_segments():
    """Chat-like lengths at C = 8: TE's layout leaves the low ranks short (each segment's
    padding lands in its last chunks, theirs); turning the pairs spreads that, dealing them to
    the least loaded ranks evens every row."""
    rng = np.random.default_rng(0)
    C, L = 8, 32768
    config = PackConfig(L, max_segments=L // 16, overflow="split", context_parallel=C)
    rows = pack([np.arange(n) for n in rng.integers(20, 800, 6000)], config)
    offs, lens = rows["tokens_segment_offsets"], rows["tokens_segment_lengths"]

    def spread(layout):
        work = rank_work(offs, lens, seq_len=L, context_parallel=C, layout=layout)
        return work.max(axis=1) / work.mean(axis=1)

    te, rotated, balanced = spread("te"), spread("rotated"), spread("balanced")
    assert rotated.mean() < 1.015 and te.mean() > 1.03, (te.mean(), rotated.mean())
    assert balanced.max() < 1.01 and balanced.max() < rotated.max(), balanced.max()
    with pytest.raises(ValueError, match="layout='thd' must be one of"):
        context_parallel_order(offs, lens, seq_len=L, context_parallel=C, layout="thd")
