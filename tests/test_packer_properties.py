"""Hypothesis properties of every packing strategy and policy: lossless, capped, deterministic."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.packer import (
    PackConfig,
    StreamPlanner,
    assemble,
    pack_ragged,
    pack_stream,
    plan,
    segment_ids_and_positions,
    stats,
    validate,
)
from seqpack.packer.online.state_codec import encode_planner_state
from seqpack.packer.plan import aligned
from tests.helpers.packer import check_lossless, corpus, expected_counters

OFFLINE = ["first_fit", "best_fit", "best_fit_decreasing"]


@st.composite
def configs(draw, strategies=tuple(OFFLINE), overflows=("truncate", "split", "drop")):
    align = draw(st.sampled_from([1, 1, 2, 4]))
    L = align * draw(st.integers(1, 24))
    return PackConfig(
        L,
        max_segments=draw(st.integers(1, 6)),
        strategy=draw(st.sampled_from(list(strategies))),
        overflow=draw(st.sampled_from(list(overflows))),
        segment_alignment=align,
        pad_id=draw(st.sampled_from([0, 7])),
    )


lengths_st = st.lists(st.integers(0, 60), max_size=60)


@settings(max_examples=150, deadline=None)
@given(configs(), lengths_st)
def test_offline_packing_is_lossless_and_within_limits(config, lengths):
    values, offsets = corpus(lengths)
    p = plan(np.diff(offsets), config)
    batch = assemble(values, offsets, p, config)
    validate(batch, config)  # capacity, segment cap, alignment, ids, positions, padding
    check_lossless(batch, values, offsets, config)
    ids, pos = segment_ids_and_positions(
        batch["tokens_segment_lengths"], batch["tokens_segment_offsets"], config.seq_len)
    np.testing.assert_array_equal(ids, batch["tokens_segment_ids"])
    np.testing.assert_array_equal(pos, batch["tokens_positions"])
    for k, v in expected_counters(lengths, config).items():
        assert getattr(p.counters, k) == v, k
    s = stats(batch)
    assert s.num_rows >= s.lower_bound_rows
    assert s.real_tokens == int(p.length.sum())
    # Deterministic: the same input packs to the same bytes.
    again = pack_ragged(values, offsets, config)
    for k in batch:
        np.testing.assert_array_equal(batch[k], again[k])


@settings(max_examples=80, deadline=None)
@given(configs(strategies=("concat_split",), overflows=("error",)), lengths_st)
def test_concat_split_fills_rows_and_loses_nothing(config, lengths):
    values, offsets = corpus(lengths)
    p = plan(np.diff(offsets), config)
    batch = assemble(values, offsets, p, config)
    validate(batch, config)
    check_lossless(batch, values, offsets, config, cut_anywhere=True)
    used = batch["tokens_segment_lengths"].sum(axis=1)
    nseg = (batch["tokens_segment_lengths"] > 0).sum(axis=1)
    # Every row but the last is full in tokens (up to alignment) or in segment slots.
    a = config.segment_alignment
    for r in range(p.num_rows - 1):
        end = batch["tokens_segment_offsets"][r, nseg[r] - 1] + batch["tokens_segment_lengths"][
            r, nseg[r] - 1]
        assert nseg[r] == config.max_segments or -(-int(end) // a) * a == config.seq_len, r
    assert used.sum() == sum(lengths)


@settings(max_examples=80, deadline=None)
@given(
    configs(strategies=("best_fit_decreasing", "best_fit")),
    lengths_st,
    st.integers(1, 9),
    st.integers(0, 3),
    st.integers(0, 4),
    st.sampled_from([0, 1, 3, 128]),
)
def test_stream_packing_is_lossless(config, lengths, window, max_carry, max_open, window_rows):
    values, offsets = corpus(lengths)
    seqs = [values[offsets[i] : offsets[i + 1]] for i in range(len(lengths))]
    rows = list(pack_stream(seqs, config, window=window, max_carry=max_carry,
                            max_open_rows=max_open, window_rows=window_rows))
    if not rows:
        assert all(n == 0 or (n > config.seq_len and config.overflow.value == "drop")
                   for n in lengths)
        return
    batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    validate(batch, config)
    check_lossless(batch, values, offsets, config)


@settings(max_examples=60, deadline=None)
@given(configs(strategies=("best_fit_decreasing",)), lengths_st, st.integers(1, 7),
       st.sampled_from([0, 1, 3, 128]), st.data())
def test_stream_planner_state_restores_exactly(config, lengths, window, window_rows, data):
    ids = np.arange(len(lengths))
    chunks = [(ids[i : i + window], np.asarray(lengths[i : i + window], np.int64))
              for i in range(0, len(lengths), window)]
    make = lambda: StreamPlanner(config, window=window, max_carry=2,  # noqa: E731
                                 window_rows=window_rows)
    full = make()
    expected = [full.add(i, n) for i, n in chunks] + [full.finish()]
    cut = data.draw(st.integers(0, len(chunks)))
    first = make()
    got = [first.add(i, n) for i, n in chunks[:cut]]
    state = first.get_state()
    assert first.get_encoded_state() == encode_planner_state(state)  # the fast path, the same
    second = make()
    second.set_state(state)
    got += [second.add(i, n) for i, n in chunks[cut:]] + [second.finish()]
    assert second.counters == full.counters
    flat = lambda rs: [(r.index.tolist(), r.start.tolist(), r.length.tolist(),  # noqa: E731
                        r.offset.tolist()) for batch in rs for r in batch]
    assert flat(got) == flat(expected)


@settings(max_examples=40, deadline=None)
@given(configs(strategies=("best_fit_decreasing",)), lengths_st,
       st.sampled_from([-10**6, -3, 0, 2**40, 2**62, 2**63 - 10**4]))
def test_stream_planner_rows_do_not_depend_on_the_callers_ids(config, lengths, base):
    """`add(ids, lengths)` takes any int64 ids (negative, huge): the same rows as ids 0..n-1,
    each row within seq_len, under the caller's ids."""
    n = len(lengths)
    rows = []
    for ids in (np.arange(n, dtype=np.int64), base + np.arange(n, dtype=np.int64)):
        planner = StreamPlanner(config, window=4, window_rows=0)
        out = [planner.add(ids[i : i + 4], lengths[i : i + 4]) for i in range(0, n, 4)]
        rows.append([r for batch in out + [planner.finish()] for r in batch])
    assert len(rows[0]) == len(rows[1])
    for a, b in zip(*rows):
        assert (b.index - base).tolist() == a.index.tolist()
        assert (a.offset.tolist(), a.length.tolist()) == (b.offset.tolist(), b.length.tolist())
        assert int((b.offset + aligned(b.length, config.alignment)).max()) <= config.seq_len

@settings(max_examples=100, deadline=None)
@given(st.one_of(configs(), configs(strategies=("concat_split",), overflows=("error",))),
       lengths_st, st.integers(1, 25))
def test_blocked_plans_are_lossless_ordered_and_match_plan_rows(config, lengths, block_size):
    from seqpack.packer.plan import pieces, plan_rows, plan_rows_many

    values, offsets = corpus(lengths)
    p = plan(np.diff(offsets), config, block_size=block_size)
    batch = assemble(values, offsets, p, config)
    validate(batch, config)
    check_lossless(batch, values, offsets, config,
                   cut_anywhere=config.strategy.value == "concat_split")
    if p.num_pieces:  # a block's rows come after every row of the blocks before it
        block = p.example // block_size
        first_row = np.full(block.max() + 1, p.num_rows)
        np.minimum.at(first_row, block, p.row)
        last_row = np.full(block.max() + 1, -1)
        np.maximum.at(last_row, block, p.row)
        used = np.unique(block)
        assert (last_row[used][:-1] < first_row[used][1:]).all()
    a = plan_rows(np.diff(offsets), config, block_size=block_size)
    example = np.concatenate([e for e, _, _ in pieces(np.diff(offsets), config,
                                                      block_size=block_size)])
    order = np.argsort(a.row, kind="stable")
    assert a.num_rows == p.num_rows and a.counters == p.counters
    np.testing.assert_array_equal(a.row[order], p.row)
    np.testing.assert_array_equal(example[order], p.example)
    again = plan(np.diff(offsets), config, block_size=block_size)  # deterministic
    np.testing.assert_array_equal(again.row, p.row)

    def backwards(fn, calls, count):  # a pool's map: any order of work, results in order
        calls = list(calls)
        assert len(calls) == count and pickle.loads(pickle.dumps(fn)) is fn
        done = [fn(*call) for call in calls[::-1]]
        yield from done[::-1]

    mapped = plan_rows(np.diff(offsets), config, block_size=block_size, map_blocks=backwards)
    assert mapped.num_rows == a.num_rows and mapped.counters == a.counters
    np.testing.assert_array_equal(mapped.row, a.row)
    # several configs through one map (a dry run's strategies): each one's plan_rows, in order
    wider = dataclasses.replace(config, seq_len=config.seq_len + 3 * config.segment_alignment)
    many = list(plan_rows_many(np.diff(offsets), [config, wider, config],
                               block_size=block_size, map_blocks=backwards))
    alone = plan_rows(np.diff(offsets), wider, block_size=block_size)
    assert [m.num_rows for m in many] == [a.num_rows, alone.num_rows, a.num_rows]
    for got, want in zip(many, [a, alone, a]):
        assert got.counters == want.counters and got.block_size == want.block_size
        np.testing.assert_array_equal(got.row, want.row)


@st.composite
def tilings(draw):
    """Examples' lengths, how many times each is taken, and pieces (example, start, length)
    that tile each example's tokens that many times (each take cut alike, or each its own
    way), in a random order."""
    lengths = np.array(draw(st.lists(st.integers(0, 12), min_size=1, max_size=12)), np.int64)
    times = np.array([draw(st.integers(0, 3)) for _ in lengths], np.int64)
    alike = draw(st.booleans())
    pieces = []
    for e, (n, t) in enumerate(zip(lengths, times)):
        for take in range(t):
            if take == 0 or not alike:
                cuts = sorted(draw(st.sets(st.integers(1, max(n - 1, 1)), max_size=3))) \
                    if n > 1 else []
            bounds = [0, *[c for c in cuts if c < n], int(n)]
            pieces += [(e, a, b - a) for a, b in zip(bounds, bounds[1:]) if b > a]
    order = draw(st.permutations(range(len(pieces))))
    return lengths, times, [pieces[i] for i in order]


@given(tilings(), st.sampled_from(["none", "duplicate", "drop", "shift"]), st.data())
@settings(max_examples=150, deadline=None)
def test_coverage_finds_exactly_the_pieces_that_do_not_tile(case, damage, data):
    from seqpack.packer.validate import Coverage

    lengths, times, pieces = case
    if damage != "none" and not pieces:
        return
    if damage != "none":
        i = data.draw(st.integers(0, len(pieces) - 1))
        e, a, n = pieces[i]
        if damage == "duplicate":
            pieces = pieces + [pieces[i]]
        elif damage == "drop":
            pieces = pieces[:i] + pieces[i + 1 :]
        else:
            pieces = pieces[:i] + [(e, a + 1, n)] + pieces[i + 1 :]
    ex, s, ln = (np.array([p[k] for p in pieces], np.int32).reshape(-1) for k in range(3))
    cover = Coverage(lengths, times)  # the pieces added as shards of them come, then checked
    cuts = sorted(data.draw(st.lists(st.integers(0, ex.size), max_size=3)))
    for part in np.split(np.arange(ex.size), cuts):
        cover.add(ex[part], s[part], ln[part])
    problems, counters = cover.check(PackConfig(16, overflow="split"), chunk=data.draw(
        st.integers(1, 13)))
    assert bool(problems) == (damage != "none"), (damage, pieces, problems)
    if damage == "none":
        npieces = np.bincount(ex, minlength=lengths.size)  # every take's
        split = npieces > times  # a take of it in more than one piece
        assert counters == dict(
            split_examples=int(times[split].sum()), split_pieces=int(npieces[split].sum()),
            num_examples=int(times.sum()), input_tokens=int((lengths * times).sum()),
            empty_examples=int(times[lengths == 0].sum()))


def test_coverage_counts_the_problems_past_the_ones_it_names():
    from seqpack.packer.validate import Coverage

    lengths = np.full(10, 4, np.int64)
    cover = Coverage(lengths, np.ones(10, np.int64))
    ex = np.repeat(np.arange(10), 2)
    starts = np.tile([0, 2], 10)
    cover.add(ex, starts, np.tile([2, 1], 10))  # token 3 of every example in no row
    cover.add(np.array([0, 1, 2, 3]), np.array([0, 0, 0, 0]), np.ones(4, np.int64))  # twice
    problems, _ = cover.check(PackConfig(16, overflow="split"), chunk=3)
    assert len(problems) == 8, problems
    assert problems[3] == "1 more example(s) whose pieces do not tile (the first 3 named)"
    assert problems[-1] == "3 more example(s) with tokens in no row (the first 3 named)"
