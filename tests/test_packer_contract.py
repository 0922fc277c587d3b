"""The contract module: key names, derived arrays from lengths/offsets, ragged arange."""

from __future__ import annotations

import numpy as np
import pytest

from seqpack.packer import PackConfig, pack
from seqpack.packer.contract import (
    SOURCE_INDEX,
    SOURCE_START,
    keys,
    packed_features,
    ragged_arange,
    restore_derived,
    segment_ids_and_positions,
)


def test_key_names_follow_the_feature():
    k = keys("inputs")
    assert k.per_token == ("inputs", "inputs_segment_ids", "inputs_positions")
    assert k.per_slot == ("inputs_segment_lengths", "inputs_segment_offsets")
    assert (k.source_index, k.source_start) == (SOURCE_INDEX, SOURCE_START)
    assert set(k.roles().values()) == {*k.per_token, *k.per_slot, SOURCE_INDEX, SOURCE_START}
    assert PackConfig(8, feature="inputs").keys() == k


def test_every_packed_batch_has_exactly_the_contract_keys():
    batch = pack([np.arange(3), np.arange(5), np.arange(2)], PackConfig(8, max_segments=2))
    assert set(batch) == set(keys().roles().values())
    assert packed_features(batch) == ["tokens"]


def test_derived_arrays_are_rebuilt_exactly():
    batch = pack([np.arange(1, 4), np.arange(1, 6), np.arange(1, 3), np.arange(1, 8)],
                 PackConfig(8, max_segments=3, segment_alignment=2))
    k = keys()
    ids, pos = segment_ids_and_positions(batch[k.segment_lengths], batch[k.segment_offsets], 8)
    np.testing.assert_array_equal(ids, batch[k.segment_ids])
    np.testing.assert_array_equal(pos, batch[k.positions])
    stored = {name: v for name, v in batch.items() if name not in k.derived}
    restored = restore_derived(dict(stored))
    for name in k.derived:
        np.testing.assert_array_equal(restored[name], batch[name])


def test_empty_slots_are_ignored_whatever_their_offset():
    lengths = np.array([[3, 0, 2, 0]], np.int32)
    offsets = np.array([[0, 0, 4, 0]], np.int32)  # zero-padded metadata, as other packers write
    ids, pos = segment_ids_and_positions(lengths, offsets, 8)
    np.testing.assert_array_equal(ids, [[1, 1, 1, 0, 3, 3, 0, 0]])
    np.testing.assert_array_equal(pos, [[0, 1, 2, 0, 0, 1, 0, 0]])


def test_overlapping_metadata_is_refused():
    with pytest.raises(ValueError, match="corrupt"):
        segment_ids_and_positions(np.array([[3, 2]]), np.array([[0, 2]]), 8)
    with pytest.raises(ValueError, match="negative.*corrupt"):  # not read as an unused slot
        segment_ids_and_positions(np.array([[-2, 3]]), np.array([[0, 0]]), 8)


def test_ragged_arange_matches_slicing():
    values = np.arange(100, 200, dtype=np.int32)
    starts, lengths = np.array([5, 0, 90, 40]), np.array([3, 0, 10, 1])
    want = np.concatenate([values[s : s + m] for s, m in zip(starts, lengths)])
    np.testing.assert_array_equal(values[ragged_arange(starts, lengths)], want)
    assert ragged_arange(np.array([4]), np.array([0])).size == 0
