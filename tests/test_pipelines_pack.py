"""PackIterDataset: lossless contract rows, overflow counters, exact restore (also in workers)."""

from __future__ import annotations

import json

import grain
import numpy as np
import pytest

from seqpack import packer
from seqpack.packer import PackConfig
from seqpack.pipelines.datasets import (
    ArraySource,
    Columns,
    PackIterDataset,
    SequentialIterDataset,
    Window,
)
from seqpack.pipelines.errors import InputError
from tests.helpers.pipelines import (
    assert_rows_equal,
    check_restore_every_step,
    iter_source,
    random_lengths,
    stack,
    unique_corpus,
)


def _check_lossless(rows, values, offsets, config: packer.PackConfig, counters: dict):
    """Every kept token appears exactly once, in place; what is missing is what was counted."""
    packer.validate(stack(rows), config)
    f, L = config.feature, config.seq_len
    got: dict[int, list[tuple[int, np.ndarray]]] = {}
    for row in rows:
        for j in np.flatnonzero(row[f"{f}_segment_lengths"]):
            o, m = int(row[f"{f}_segment_offsets"][j]), int(row[f"{f}_segment_lengths"][j])
            e, s = int(row["segment_source_index"][j]), int(row["segment_source_start"][j])
            got.setdefault(e, []).append((s, row[f][o : o + m]))
    truncated = dropped = empty = 0
    for e in range(offsets.size - 1):
        src = values[offsets[e] : offsets[e + 1]]
        pieces = sorted(got.pop(e, []), key=lambda p: p[0])
        if src.size == 0:
            empty += 1
            assert not pieces
            continue
        if src.size > L and config.overflow is packer.Overflow.DROP:
            dropped += src.size
            assert not pieces
            continue
        joined = np.concatenate([p for _, p in pieces])
        if src.size > L and config.overflow is packer.Overflow.TRUNCATE:
            truncated += src.size - L
            src = src[:L]
        np.testing.assert_array_equal(joined, src, err_msg=f"example {e}")
        assert [s for s, _ in pieces] == list(range(0, src.size, L))[: len(pieces)]
    assert not got
    assert counters["truncated_tokens"] == truncated
    assert counters["dropped_tokens"] == dropped
    assert counters["empty_examples"] == empty
    assert counters["rows_emitted"] == len(rows)


CONFIGS = [
    dict(pack=PackConfig(64), window=Window(16)),
    dict(pack=PackConfig(64), window=Window(1)),
    dict(pack=PackConfig(64), window=Window(1000)),
    dict(pack=PackConfig(48, max_segments=3), window=Window(8)),
    dict(pack=PackConfig(64, segment_alignment=8), window=Window(16)),
    dict(pack=PackConfig(64, strategy="best_fit"), window=Window(16)),
    dict(pack=PackConfig(32, overflow="truncate"), window=Window(16), high=90),
    dict(pack=PackConfig(32, overflow="split"), window=Window(16), high=90),
    dict(pack=PackConfig(32, overflow="drop"), window=Window(16), high=90),
    dict(pack=PackConfig(64, pad_id=7), window=Window(16), zero_prob=0.2),
    dict(pack=PackConfig(64), window=Window(16, shuffle_rows=True), seed=4),
]


@pytest.mark.parametrize("case", range(len(CONFIGS)))
def test_rows_are_lossless_contract_rows(case):
    kw = dict(CONFIGS[case])
    high, zero_prob = kw.pop("high", kw["pack"].seq_len), kw.pop("zero_prob", 0.0)
    lengths = random_lengths(np.random.default_rng(case), 300, high=high, zero_prob=zero_prob)
    values, offsets = unique_corpus(lengths)
    it = iter(PackIterDataset(iter_source(values, offsets), **kw))
    rows = list(it)
    _check_lossless(rows, values, offsets, kw["pack"], it.counters)
    assert rows[0]["tokens"].dtype == np.int32
    assert it.counters["examples_read"] == 300


def test_tighter_than_grain_best_fit():
    import grain.experimental as ge

    rng = np.random.default_rng(0)  # chat-like: lognormal, ~5 examples per row
    lengths = rng.lognormal(np.log(90), 0.7, 4000).astype(np.int64).clip(1, 512)
    values, offsets = unique_corpus(lengths)
    ds = iter_source(values, offsets)
    ours = list(PackIterDataset(ds, PackConfig(512), window=Window(256)))
    theirs = list(ge.BestFitPackIterDataset(ds, length_struct={"tokens": 512},
                                            num_packing_bins=256))
    lower_bound = -(-int(lengths.sum()) // 512)
    assert len(ours) < len(theirs)
    assert len(ours) <= lower_bound * 1.005 + 1


@pytest.mark.parametrize("kw", [
    dict(pack=PackConfig(64), window=Window(8)),
    dict(pack=PackConfig(32, overflow="split"), window=Window(8)),
    dict(pack=PackConfig(64), window=Window(8, shuffle_rows=True), seed=1),
    dict(pack=PackConfig(64, max_segments=2), window=Window(4)),
], ids=["carry", "split", "shuffle", "segments"])
def test_restore_at_every_step(kw):
    lengths = random_lengths(np.random.default_rng(5), 120, high=60, zero_prob=0.05)
    values, offsets = unique_corpus(lengths)
    ds = PackIterDataset(iter_source(values, offsets), **kw)
    rows = check_restore_every_step(lambda: iter(ds))
    assert len(rows) > 20


def test_deterministic_restore_after_n_steps_and_state_is_small():
    lengths = random_lengths(np.random.default_rng(6), 3000, high=200)
    values, offsets = unique_corpus(lengths)
    ds = PackIterDataset(iter_source(values, offsets), PackConfig(256), window=Window(64))
    full = list(ds)
    for n in (1, 37, 200, len(full) - 1):
        it = iter(ds)
        for _ in range(n):
            next(it)
        state = json.loads(json.dumps(it.get_state()))
        assert len(json.dumps(state)) < 20_000  # ids and lengths of open rows, no tokens
        restored = iter(ds)
        restored.set_state(state)
        assert_rows_equal(list(restored), full[n:])
        assert restored.counters["rows_emitted"] == len(full)


def test_a_replaying_restore_over_changed_data_is_refused():
    """A restore that replays re-plans the window the state was leaving and skips the rows
    already emitted: over data whose examples there changed size, that would skip other rows
    (before: silently). The state records the window's sizes (a digest); it is checked."""
    rng = np.random.default_rng(8)
    lengths = random_lengths(rng, 400, high=60)
    values, offsets = unique_corpus(lengths)
    window = Window(16, window_rows=4)
    ds = PackIterDataset(iter_source(values, offsets), PackConfig(64), window=window)
    it = iter(ds)
    for _ in range(30):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    assert state["phase"] == "window" and "sizes" in state
    grown = lengths.copy()
    grown[int(state["window_first"]) + 3] += 2  # one example of the window, two tokens longer
    changed = PackIterDataset(iter_source(*unique_corpus(grown)), PackConfig(64), window=window)
    with pytest.raises(InputError, match=r"restoring: the parent's elements from \d+ \(the "
                                         r"window the state was leaving\) have other sizes"):
        iter(changed).set_state(state)
    same = iter(ds)
    same.set_state(state)  # the data it was saved over
    assert_rows_equal(list(same), list(ds)[30:])
    del state["sizes"]  # a state saved before the digest: restored unchecked, as before
    iter(changed).set_state(state)


def test_multi_feature_rows():
    rng = np.random.default_rng(7)
    n = 200
    li, lt = random_lengths(rng, n, high=40), random_lengths(rng, n, high=20)
    vi, oi = unique_corpus(li)
    vt, ot = unique_corpus(lt)
    vt = vt + 100_000
    src = SequentialIterDataset(ArraySource({"inputs": (vi, oi), "targets": (vt, ot)}))
    ds = PackIterDataset(src, [PackConfig(48, max_segments=8, feature="inputs"),
                               PackConfig(24, max_segments=8, feature="targets")],
                         window=Window(16))
    it = iter(ds)
    rows = list(it)
    batch = stack(rows)
    for f, L in (("inputs", 48), ("targets", 24)):
        packer.validate({k.replace(f, "tokens", 1) if k.startswith(f) else k: v
                         for k, v in batch.items()},
                        packer.PackConfig(L, max_segments=8))
    seen = set()
    for row in rows:
        for j in np.flatnonzero(row["segment_source_index"] >= 0):
            e = int(row["segment_source_index"][j])
            for f, v, o in (("inputs", vi, oi), ("targets", vt, ot)):
                a, m = int(row[f"{f}_segment_offsets"][j]), int(row[f"{f}_segment_lengths"][j])
                np.testing.assert_array_equal(row[f][a : a + m], v[o[e] : o[e + 1]])
            assert e not in seen
            seen.add(e)
    assert seen == set(range(n))
    assert len(rows) < n / 2
    check_restore_every_step(lambda: iter(ds), max_rows=40)


def test_multi_feature_overflow_and_empty():
    src = SequentialIterDataset(ArraySource({
        "inputs": (np.arange(1, 31), [0, 10, 20, 30, 30]),
        "targets": (np.arange(1, 15), [0, 2, 12, 13, 14])}))
    packs = lambda **o: [PackConfig(16, feature="inputs", **o),
                         PackConfig(8, feature="targets", **o)]
    kw = dict(window=Window(4))
    with pytest.raises(ValueError, match="example 1 has targets length 10 > 8"):
        list(PackIterDataset(src, packs(), **kw))
    it = iter(PackIterDataset(src, packs(overflow="truncate"), **kw))
    rows = list(it)
    # example 3 has no inputs but a target: dropped, its target token counted
    assert it.counters["truncated_tokens"] == 2 and it.counters["empty_examples"] == 0
    assert (it.counters["dropped_examples"], it.counters["dropped_tokens"]) == (1, 1)
    assert sum(int(r["targets_segment_lengths"].sum()) for r in rows) == 2 + 8 + 1
    for overflow, dropped in (("truncate", (1, 1)), ("drop", (2, 21))):
        it = iter(PackIterDataset(src, packs(overflow=overflow), **kw))
        rows = list(it)
        c = it.counters
        assert (c["dropped_examples"], c["dropped_tokens"]) == dropped
        packed = sum(int(r[f"{f}_segment_lengths"].sum()) for r in rows
                     for f in ("inputs", "targets"))
        assert c["input_tokens"] == 44 == packed + c["truncated_tokens"] + c["dropped_tokens"]
    with pytest.raises(ValueError, match="split"):
        PackIterDataset(src, packs(overflow="split"), **kw)


def test_meta_feature_shares_the_host_layout():
    lengths = random_lengths(np.random.default_rng(8), 100, high=30)
    values, offsets = unique_corpus(lengths)
    mask = (values % 3 == 0).astype(np.int8)
    src = SequentialIterDataset(ArraySource({"tokens": (values, offsets),
                                             "loss_mask": (mask, offsets)}))
    rows = list(PackIterDataset(src, PackConfig(64, overflow="split"), window=Window(8),
                                columns=Columns(meta=["loss_mask"])))
    for row in rows:
        assert row["loss_mask"].dtype == np.int8
        real = row["tokens_segment_ids"] > 0
        np.testing.assert_array_equal(row["loss_mask"][real], row["tokens"][real] % 3 == 0)
        assert not row["loss_mask"][~real].any()
        assert "loss_mask_segment_ids" not in row
    bad = SequentialIterDataset(ArraySource({"tokens": (values, offsets),
                                             "loss_mask": (mask[:-1], offsets - (offsets > 0))}))
    with pytest.raises(ValueError, match="column 'loss_mask' has length 2 but the feature "
                                         "'tokens' it is packed with has 3"):
        list(PackIterDataset(bad, PackConfig(64), columns=Columns(meta=["loss_mask"])))


def test_bad_elements_and_arguments():
    ds = iter_source(*unique_corpus([3, 4, 70]))
    with pytest.raises(ValueError, match="example 2 has length 70 > seq_len=64"):
        list(PackIterDataset(ds, PackConfig(64)))
    with pytest.raises(ValueError, match="element 0 of the parent lacks"):
        list(PackIterDataset(ds, PackConfig(64, feature="inputs")))
    floats = SequentialIterDataset(grain.MapDataset.source([{"tokens": np.ones(3)}] * 2))
    with pytest.raises(ValueError, match="element 0: 'tokens' must be a 1-D array of integer"):
        list(PackIterDataset(floats, PackConfig(64)))
    for first in (0, 1):  # bool is no token id: the first element, or a later one
        elements = [{"tokens": np.ones(3, np.int32)}, {"tokens": np.ones(3, bool)}][first:]
        bools = SequentialIterDataset(grain.MapDataset.source(elements * 2))
        with pytest.raises(ValueError, match=f"element {1 - first}: 'tokens' must be a 1-D "
                                             "array of integer token ids.*dtype bool"):
            list(PackIterDataset(bools, PackConfig(64)))
    with pytest.raises(ValueError, match="must be a PackConfig, or a non-empty list of them"):
        PackIterDataset(ds, [])
    with pytest.raises(ValueError, match="concat_split"):
        PackIterDataset(ds, PackConfig(64, strategy="concat_split"))
    with pytest.raises(ValueError, match="the feature must be a packed feature"):
        PackIterDataset(ds, PackConfig(64), columns=Columns(meta={"mask": "inputs"}))
    with pytest.raises(ValueError, match="window_rows=-1 must be an int >= 0"):
        PackIterDataset(ds, PackConfig(64), window=Window(window_rows=-1))


def _worker_expected(ds_fn, values, offsets, num_workers):
    """In-process equivalent of mp_prefetch: worker i packs slice i::k; outputs round-robin."""
    per = [list(ds_fn(SequentialIterDataset(
        ArraySource.from_ragged(values, offsets)[i::num_workers]))) for i in range(num_workers)]
    out, k = [], 0
    while any(per):
        if per[k % num_workers]:
            out.append(per[k % num_workers].pop(0))
        k += 1
    return out


@pytest.mark.slow
def test_restore_at_every_step_with_worker_processes():
    lengths = random_lengths(np.random.default_rng(9), 40, high=60)
    values, offsets = unique_corpus(lengths)
    pack = lambda d: PackIterDataset(d, PackConfig(128), window=Window(8))
    ds = pack(iter_source(values, offsets)).mp_prefetch(
        grain.MultiprocessingOptions(num_workers=2, per_worker_buffer_size=1))
    want = _worker_expected(pack, values, offsets, 2)
    it = iter(ds)
    rows, states = [], [it.get_state()]
    for row in it:
        rows.append(row)
        states.append(json.loads(json.dumps(it.get_state())))
    it.close()
    assert_rows_equal(rows, want)
    assert len(rows) >= 7
    for step in range(len(rows)):
        restored = iter(ds)
        restored.set_state(states[step])
        tail = [next(restored) for _ in range(min(2, len(rows) - step))]
        restored.close()
        assert_rows_equal(tail, rows[step : step + len(tail)])


@pytest.mark.parametrize("multi", [False, True])
def test_planner_state_encoding_round_trips(multi):
    from seqpack.packer.online.state_codec import decode_planner_state, encode_planner_state

    rng = np.random.default_rng(10)
    lengths = random_lengths(rng, 400, high=60)
    values, offsets = unique_corpus(lengths)
    if multi:
        src = SequentialIterDataset(ArraySource({"a": (values, offsets), "b": (values, offsets)}))
        ds = PackIterDataset(src, [PackConfig(64, feature="a"), PackConfig(128, feature="b")],
                             window=Window(32))
    else:  # S=2: a plan every 128 rows' worth (256 pieces), so states between plans hold rows
        ds = PackIterDataset(iter_source(values, offsets), PackConfig(64, max_segments=2),
                             window=Window(32))
    it = iter(ds)
    checked = 0
    for _ in it:
        raw = it._layout.planner.get_state()
        if raw["rows"]:
            enc = json.loads(json.dumps(encode_planner_state(raw)))
            assert isinstance(enc["rows_i64"], str) and "rows" not in enc
            assert decode_planner_state(enc) == json.loads(json.dumps(raw))
            assert enc == json.loads(json.dumps(it._layout.planner.snapshot()()))
            checked += 1
    assert checked > 10
    assert decode_planner_state({"rows": [], "windows": 0}) == {"rows": [], "windows": 0}


def test_window_and_pack_configs_are_checked():
    ds = iter_source(*unique_corpus([3, 4]))
    with pytest.raises(ValueError, match="window=0 must be an int >= 1"):
        Window(0)
    with pytest.raises(ValueError, match="window=True must be an int >= 1"):
        Window(True)
    with pytest.raises(ValueError, match="shuffle_rows=1 must be a bool"):
        Window(shuffle_rows=1)
    with pytest.raises(ValueError, match="window=16 must be a Window"):
        PackIterDataset(ds, PackConfig(8), window=16)
    with pytest.raises(ValueError, match=r"columns=\['labels'\] must be a Columns"):
        PackIterDataset(ds, PackConfig(8), columns=["labels"])
    with pytest.raises(ValueError, match="pack=8 must be a PackConfig"):
        PackIterDataset(ds, 8)
    with pytest.raises(ValueError, match="pack: feature 'a' is given twice"):
        PackIterDataset(ds, [PackConfig(8, feature="a"), PackConfig(16, feature="a")])
    for field, value, shown in (("max_segments", 8, "8"), ("pad_id", 1, "1"),
                                ("overflow", "drop", "'drop'"), ("segment_alignment", 2, "2")):
        other = PackConfig(16, feature="b", **{field: value})
        with pytest.raises(ValueError, match=f"pack: {field}={shown} for feature 'b' but "
                                             f"{field}=.* for 'a'; packed features differ "
                                             "only in seq_len and feature"):
            PackIterDataset(ds, [PackConfig(8, feature="a"), other])
