"""Bad input: a ValueError naming the field, value and fix; validate names the row and slot."""

from __future__ import annotations

import json

import numpy as np
import pytest

from seqpack.packer import (
    MultiStreamPlanner,
    PackConfig,
    StreamPlanner,
    assemble,
    pack,
    pack_ragged,
    pack_stream,
    plan,
    stats,
    step_balance,
    tight_lower_bound,
    validate,
)
from seqpack.packer.bounds import lower_bound


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(seq_len=0), r"seq_len=0 must be in \[1, 2147483647\]"),
        (dict(seq_len=2**31), r"seq_len=2147483648 must be in \[1, 2147483647\]: .* int32"),
        (dict(seq_len=8, max_segments=0), r"max_segments=0 must be >= 1"),
        (dict(seq_len=10, segment_alignment=4), r"segment_alignment=4 must divide seq_len=10"),
        (dict(seq_len=8, strategy="magic"), r"strategy='magic' is not known; use one of"),
        (dict(seq_len=8, overflow="wrap"), r"overflow='wrap' is not known"),
        (dict(seq_len=8.0), r"seq_len=8.0 must be an int"),
        (dict(seq_len=8, pad_id=-1), r"pad_id=-1 must be >= 0"),
        (dict(seq_len=8, feature="a b"), r"feature='a b' must be"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PackConfig(**kwargs)


def test_config_accepts_numpy_ints_and_enums_round_trip():
    cfg = PackConfig(np.int64(16), max_segments=np.int32(4))
    assert cfg.seq_len == 16 and type(cfg.seq_len) is int
    assert json.loads(json.dumps(cfg.to_dict()))["strategy"] == "best_fit_decreasing"


def test_over_length_error_names_example_and_length():
    with pytest.raises(ValueError, match=r"example 2 has length 9 > seq_len=8 \(2 examples are "
                                         r"over-length\).*'truncate'"):
        plan([1, 2, 9, 10], PackConfig(8))
    with pytest.raises(ValueError, match=r"example 1 has length 9 > seq_len=8 \(1 example is "
                                         r"over-length\)"):
        plan([1, 9, 8], PackConfig(8))


@pytest.mark.parametrize(
    "values, offsets, match",
    [
        (np.array([1.5, 2.0]), [0, 2], r"values must hold integer token ids, got dtype float64"),
        (np.zeros((2, 2), np.int32), [0, 2], r"values must be 1-D"),
        (np.array([1, -3, 2]), [0, 3], r"values\[1\]=-3 is a negative token id"),
        (np.array([1, 2, 3]), [0, 2, 1], r"offsets must be non-decreasing: offsets\[1\]=2"),
        (np.array([1, 2, 3]), [0, 5], r"offsets\[-1\]=5 runs past the 3 values"),
        (np.array([1, 2, 3]), [[0, 3]], r"offsets must be 1-D"),
    ],
)
def test_bad_ragged_input(values, offsets, match):
    with pytest.raises(ValueError, match=match):
        pack_ragged(values, offsets, PackConfig(8))


@pytest.mark.parametrize(
    "lengths, match",
    [([1.5], r"lengths must be integers"), ([[1, 2]], r"lengths must be 1-D"),
     ([3, -1], r"lengths\[1\]=-1 must be >= 0")],
)
def test_bad_lengths(lengths, match):
    with pytest.raises(ValueError, match=match):
        plan(lengths, PackConfig(8))


def test_validate_refuses_a_negative_token_id_and_plan_a_length_past_int64():
    config = PackConfig(8)
    batch = pack([np.array([1, 2, 3])], config)
    batch["tokens"][0, 1] = -5
    with pytest.raises(ValueError, match=r"row 0 position 1: negative token id -5"):
        validate(batch, config)
    with pytest.raises(ValueError, match=rf"lengths\[1\]={2**63 + 4} is past int64"):
        plan(np.array([3, 2**63 + 4], np.uint64), config)


def test_bad_sequences():
    with pytest.raises(ValueError, match=r"sequences\[1\] must hold integer token ids"):
        pack([np.array([1]), np.array([0.5])], PackConfig(8))
    with pytest.raises(ValueError, match=r"sequences\[0\] must be 1-D"):
        pack([np.zeros((2, 2), np.int32)], PackConfig(8))
    with pytest.raises(ValueError, match=r"sequences\[0\]\[1\]=-2 is a negative token id"):
        pack([np.array([1, -2])], PackConfig(8))


def test_bad_stream_input_names_the_example():
    with pytest.raises(ValueError, match=r"example 1 must be a 1-D array of integer token ids"):
        list(pack_stream([np.array([1]), np.array([0.5])], PackConfig(8)))
    with pytest.raises(ValueError, match=r"example 0: token id -1 at position 0 is negative"):
        list(pack_stream([np.array([-1])], PackConfig(8)))
    with pytest.raises(ValueError, match=r"example 1 has length 9 > seq_len=8"):
        list(pack_stream([np.array([1]), np.arange(9)], PackConfig(8)))


def test_empty_examples_are_counted_not_segments():
    p = plan([0, 3, 0], PackConfig(4))
    assert p.counters.empty_examples == 2
    assert p.example.tolist() == [1]
    b = pack([], PackConfig(4))
    assert b["tokens"].shape == (0, 4) and b["tokens_segment_lengths"].shape == (0, 64)


def test_plan_and_data_must_match():
    cfg = PackConfig(8)
    p = plan([4, 4], cfg)
    with pytest.raises(ValueError, match="plan and assemble with the same data"):
        assemble(np.arange(5), [0, 2, 5], p, cfg)


def _good_batch():
    cfg = PackConfig(8, max_segments=4, segment_alignment=2)
    return cfg, pack([np.array([5, 6, 7]), np.array([8, 9]), np.array([1])], cfg)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda b: b["tokens_segment_lengths"].__setitem__((0, 0), -1), r"row 0 slot 0"),
        (lambda b: b["tokens_segment_offsets"].__setitem__((0, 1), 1), r"row 0 slot 1"),
        (lambda b: b["tokens_segment_offsets"].__setitem__((0, 3), 8), r"row 0 slot 3: unused"),
        (lambda b: b["tokens_segment_offsets"].__setitem__((0, 2), 5), r"row 0 slot 2: offset 5 "
         r"overlaps"),
        (lambda b: b["segment_source_index"].__setitem__((0, 3), 5), r"row 0 slot 3"),
        (lambda b: b["segment_source_start"].__setitem__((0, 0), -1), r"row 0 slot 0"),
        (lambda b: b["tokens_segment_ids"].__setitem__((0, 0), 2), r"row 0 position 0"),
        (lambda b: b["tokens_positions"].__setitem__((0, 1), 0), r"row 0 position 1"),
        (lambda b: b["tokens"].__setitem__((0, 7), 3), r"row 0 position 7: padding"),
        (lambda b: b.pop("tokens_positions"), r"missing keys \['tokens_positions'\]"),
    ],
)
def test_validate_names_the_violation(mutate, match):
    cfg, batch = _good_batch()
    validate(batch, cfg)
    batch = {k: v.copy() for k, v in batch.items()}
    mutate(batch)
    with pytest.raises(ValueError, match=match):
        validate(batch, cfg)


def test_validate_rejects_misaligned_offsets_and_wrong_dtypes():
    cfg, batch = _good_batch()
    bad = {k: v.copy() for k, v in batch.items()}
    bad["tokens_segment_ids"] = bad["tokens_segment_ids"].astype(np.int64)
    with pytest.raises(ValueError, match="tokens_segment_ids has dtype int64, expected int32"):
        validate(bad, cfg)
    cfg1 = PackConfig(8, max_segments=4, segment_alignment=4)
    with pytest.raises(ValueError, match="not a multiple of segment_alignment 4"):
        validate(batch, cfg1)


def test_validate_accepts_a_single_row():
    cfg, batch = _good_batch()
    validate({k: v[0] for k, v in batch.items()}, cfg)


def test_stats_numbers():
    cfg = PackConfig(10, max_segments=2)
    b = pack([np.arange(1, 7), np.arange(1, 4), np.arange(1, 5), np.arange(1, 3)], cfg)
    s = stats(b)
    assert s.num_rows == 2 and s.real_tokens == 15 and s.num_segments == 4
    assert s.efficiency == pytest.approx(0.75)
    assert s.padding_fraction == pytest.approx(0.25)
    assert s.lower_bound_rows == 2 and s.rows_over_lower_bound == 0.0
    assert s.segments_per_row == [0, 0, 2]
    assert sum(s.row_fill_histogram) == 2
    json.dumps(s.to_dict())
    p = plan([6, 3, 4, 2, 20], PackConfig(10, max_segments=2, overflow="drop"))
    sp = stats(p, seq_len=10, max_segments=2)
    assert sp.counters["dropped_tokens"] == 20 and sp.real_tokens == 15
    with pytest.raises(ValueError, match="needs seq_len= and max_segments="):
        stats(p)


@pytest.mark.parametrize("overflow", ["truncate", "drop", "split"])
def test_a_negative_id_in_tokens_a_policy_cuts_is_still_refused(overflow):
    """pack_stream checks every id of an example, also those truncation or dropping leaves
    out (as `pack` does), naming the example."""
    bad = np.array([5] * 8 + [-1] * 4, np.int32)
    with pytest.raises(ValueError, match=r"example 1: token id -1 at position 8 is negative"):
        list(pack_stream([np.array([1, 2], np.int32), bad], PackConfig(8, overflow=overflow)))


def test_assemble_refuses_a_plan_made_under_another_config():
    values, offsets = np.arange(1, 9), np.array([0, 3, 8])
    p = plan(np.diff(offsets), PackConfig(16, max_segments=4))  # one row: offsets 0 and 3
    for config, match in ((PackConfig(16, segment_alignment=8), "an offset off segment_align"),
                          (PackConfig(16, max_segments=1), "slot 1 >= max_segments=1"),
                          (PackConfig(4), "a piece ends at 8 > seq_len=4")):
        with pytest.raises(ValueError, match=f"the plan does not fit the config: {match}"):
            assemble(values, offsets, p, config)
    validate(assemble(values, offsets, p, PackConfig(8)), PackConfig(8))  # it fits


@pytest.mark.parametrize("name", ["window", "max_open_rows", "max_carry", "window_rows"])
@pytest.mark.parametrize("value", [1024.0, 1.5, "8", True, None, -1])
def test_stream_planner_counts_must_be_ints(name, value):
    """Each count is checked up front (not after the input is read, nor by a raw comparison):
    an int, not a float however whole, a string or a bool. (max_open_rows=None: the window.)"""
    if name == "max_open_rows" and value is None:
        assert StreamPlanner(PackConfig(64), max_open_rows=None).max_open_rows == 1024
        return
    low = 1 if name == "window" else 0
    with pytest.raises(ValueError, match=rf"^{name}={value!r} must be an int >= {low}$"):
        StreamPlanner(PackConfig(64, max_segments=8), **{name: value})
    stream = pack_stream(iter(()), PackConfig(64), **{name: value})
    with pytest.raises(ValueError, match=rf"^{name}={value!r} must be an int"):
        next(stream)


@pytest.mark.parametrize("name, value, low", [("window", 8.0, 1), ("window", 0, 1),
                                               ("max_open_rows", "4", 0), ("max_carry", 2.5, 0)])
def test_multi_stream_planner_counts_must_be_ints(name, value, low):
    with pytest.raises(ValueError, match=rf"^{name}={value!r} must be an int >= {low}$"):
        MultiStreamPlanner(("inputs", "targets"), (8, 4), max_segments=4, **{name: value})


def test_stream_planner_takes_numpy_ints():
    p = StreamPlanner(PackConfig(64), window=np.int64(8), max_open_rows=np.int32(4),
                      max_carry=np.int64(2), window_rows=np.int16(0))
    assert (p.window, p.max_open_rows, p.max_carry, p.window_rows) == (8, 4, 2, 0)
    assert all(type(v) is int for v in (p.window, p.max_open_rows, p.max_carry, p.window_rows))


@pytest.mark.parametrize("kwargs, match", [
    (dict(capacity=8, max_segments=0), r"max_segments=0 must be an int >= 1"),
    (dict(capacity=0, max_segments=2), r"capacity=0 must be an int >= 1"),
    (dict(capacity=8, max_segments=2.0), r"max_segments=2.0 must be an int >= 1"),
])
def test_tight_lower_bound_checks_its_limits(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tight_lower_bound([1, 3], **kwargs)
    with pytest.raises(ValueError, match=match.replace("capacity", "seq_len")):
        lower_bound(4, 2, kwargs["capacity"], kwargs["max_segments"])


@pytest.mark.parametrize("args, match", [
    (([1, 2, 3, 4, 5], 2.5), r"data_parallel=2.5 must be an int >= 1"),
    (([1, 9], True), r"data_parallel=True must be an int >= 1"),
    (([1, 9], 0), r"data_parallel=0 must be an int >= 1"),
    (([1, 9], 1, 1.0), r"batch_size=1.0 must be an int >= 1"),
    (([np.nan, 2.0], 2), r"costs must be finite: row 0 costs nan"),
    (([1.0, np.inf, 2.0, 2.0], 2), r"costs must be finite: row 1 costs inf"),
    (([[1.0, 2.0]], 1), r"costs must be 1-D"),
])
def test_step_balance_refuses_what_it_cannot_measure(args, match):
    """As `balance_slices` and `RowOrder` do: a count that is not an int is refused, not
    truncated (2.5 ran as 2, True as 1); a NaN cost is refused, not reported as a perfect 1.0."""
    with pytest.raises(ValueError, match=match):
        step_balance(*args)
    assert step_balance([1, 3, 2, 2], np.int64(2)).tolist() == [1.5, 1.0]
