"""Test helpers: random corpora and the losslessness check shared by the packer tests."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from seqpack.packer import Overflow, PackConfig

# (capacity, max_segments, sizes) for the planners' property tests
instances = st.integers(2, 40).flatmap(lambda L: st.tuples(
    st.just(L), st.integers(1, 6), st.lists(st.integers(1, L), min_size=1, max_size=70)))


def bfd_plan(inst):
    """(L, S, sizes largest first, plain BFD's row per piece as i64, rows) of an `instances` draw:
    the plan the repair's steps start from."""
    from seqpack.packer.strategies.bfd.greedy import bfd_sorted

    L, S, sizes = inst
    desc = np.sort(np.asarray(sizes, np.int64))[::-1]
    rows, n = bfd_sorted(desc, L, S)
    return L, S, desc, np.asarray(rows, np.int64), n


def check_rows(sizes, rows, num_rows, L, S):
    """Every piece in a row; rows 0..num_rows-1 all used; capacity and cap respected."""
    rows = np.asarray(rows)
    assert rows.shape == (len(sizes),)
    assert sorted(set(rows.tolist())) == list(range(num_rows))
    assert np.bincount(rows, weights=sizes).max() <= L
    assert np.bincount(rows).max() <= S


def corpus(lengths: list[int], *, dtype=np.int32) -> tuple[np.ndarray, np.ndarray]:
    """Flat values + offsets where every token is unique (its global position + 1)."""
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = (np.arange(int(offsets[-1])) + 1).astype(dtype)
    return values, offsets


def check_lossless(batch: dict, values, offsets, config: PackConfig, *, cut_anywhere=False) -> None:
    """Every input token appears exactly once, in order, or is accounted for by the policy.

    `batch` holds `[R, ...]` arrays. With `cut_anywhere` (concat_split) examples may be cut into
    pieces at any point; otherwise only overflow="split" cuts, at multiples of seq_len.
    """
    L = config.seq_len
    f = config.feature
    lengths = np.diff(offsets)
    seen: dict[int, list[tuple[int, np.ndarray]]] = {}
    toks = batch[f]
    for r in range(toks.shape[0]):
        for j in range(config.max_segments):
            m = int(batch[f"{f}_segment_lengths"][r, j])
            if m == 0:
                continue
            o = int(batch[f"{f}_segment_offsets"][r, j])
            e = int(batch["segment_source_index"][r, j])
            s = int(batch["segment_source_start"][r, j])
            seen.setdefault(e, []).append((s, toks[r, o : o + m]))
    for e, n in enumerate(lengths.tolist()):
        src = values[offsets[e] : offsets[e + 1]]
        pieces = sorted(seen.pop(e, []), key=lambda p: p[0])
        if n == 0:
            assert not pieces, f"empty example {e} became a segment"
            continue
        if n > L and not cut_anywhere:
            if config.overflow is Overflow.DROP:
                assert not pieces, f"over-length example {e} was not dropped"
                continue
            if config.overflow is Overflow.TRUNCATE:
                src = src[:L]
            if config.overflow is Overflow.SPLIT:
                assert [p[0] for p in pieces] == list(range(0, n, L)), (e, [p[0] for p in pieces])
        elif not cut_anywhere:
            assert len(pieces) == 1, f"example {e} (length {n} <= L) is in {len(pieces)} pieces"
        pos = 0
        for s, t in pieces:
            assert s == pos, f"example {e}: piece starts at {s}, expected {pos}"
            pos += t.size
        got = np.concatenate([t for _, t in pieces]) if pieces else src[:0]
        np.testing.assert_array_equal(got, src, err_msg=f"example {e} tokens differ")
    assert not seen, f"segments point at unknown examples {sorted(seen)}"


def expected_counters(lengths, config: PackConfig) -> dict[str, int]:
    lengths = np.asarray(lengths, np.int64)
    L = config.seq_len
    over = lengths > L
    out = {"empty_examples": int((lengths == 0).sum()), "num_examples": int(lengths.size),
           "input_tokens": int(lengths.sum())}
    if config.overflow is Overflow.TRUNCATE:
        out["truncated_tokens"] = int((lengths[over] - L).sum())
        out["truncated_examples"] = int(over.sum())
    if config.overflow is Overflow.DROP:
        out["dropped_tokens"] = int(lengths[over].sum())
        out["dropped_examples"] = int(over.sum())
    if config.overflow is Overflow.SPLIT:
        out["split_examples"] = int(over.sum())
        out["split_pieces"] = int((-(-lengths[over] // L)).sum())
    return out
