"""One row dtype per run: every example is checked against it; a value it cannot hold raises
`InputError` naming the example (pack_stream, PackIterDataset, the drop-ins), never wraps."""

from __future__ import annotations

import grain
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from seqpack.packer import InputError, PackConfig, pack, pack_ragged, pack_stream
from seqpack.pipelines import datasets

CONFIG = PackConfig(8, max_segments=4, strategy="best_fit")

# (first example, later example, error naming example/element 1); None: packs unchanged
MIXED = [
    (np.array([1, 2], np.uint16), np.array([70000], np.int64), "70000 .* uint16"),
    (np.array([1, 2], np.uint16), np.array([-1], np.int64), "-1 .* negative"),
    (np.array([1, 2], np.int32), np.array([2**33 + 5], np.int64), "8589934597 .* int32"),
    (np.array([1, 2], np.int32), np.array([-1], np.int32), "-1 .* negative"),
    (np.array([1, 2], np.uint16), np.array([5, 65535], np.int64), None),
]


def _parent(examples):
    return grain.MapDataset.source([{"tokens": x} for x in examples]).to_iter_dataset()


def _segments(rows):
    out = {}
    for r in rows:
        for j, src in enumerate(r["segment_source_index"].tolist()):
            if src >= 0:
                o, n = r["tokens_segment_offsets"][j], r["tokens_segment_lengths"][j]
                out[src] = r["tokens"][o : o + n].tolist()
    return out


@pytest.mark.parametrize("first, later, error", MIXED)
def test_pack_stream_and_pack_iter_dataset_never_wrap(first, later, error):
    runs = {
        "pack_stream": lambda: list(pack_stream([first, later], CONFIG)),
        "PackIterDataset": lambda: list(datasets.PackIterDataset(
            _parent([first, later]), PackConfig(8, max_segments=4))),
    }
    for name, run in runs.items():
        if error:
            with pytest.raises(InputError, match=f"(example|element) 1.*{error}"):
                run()
            continue
        rows = run()
        assert {r["tokens"].dtype for r in rows} == {first.dtype}, name
        assert _segments(rows) == {0: first.tolist(), 1: later.tolist()}, name


def test_the_run_dtype_is_fixed_before_the_first_row_and_can_be_given():
    # Rows of every window share the run's dtype, even when later windows hold other dtypes.
    examples = [np.array([3], np.uint8)] + [np.array([7, 8], np.int64)] * 5
    rows = list(pack_stream(examples, CONFIG, window=2))
    assert {r["tokens"].dtype for r in rows} == {np.dtype(np.uint8)}
    ds = datasets.PackIterDataset(_parent(examples), PackConfig(8, max_segments=4),
                                  window=datasets.Window(2))
    assert {r["tokens"].dtype for r in ds} == {np.dtype(np.uint8)}
    wide = list(pack_stream([np.array([3], np.uint8), np.array([300])], CONFIG, dtype=np.int32))
    assert {r["tokens"].dtype for r in wide} == {np.dtype(np.int32)}
    with pytest.raises(InputError, match="example 0: token id 300 .* uint8 .*dtype= of"):
        list(pack_stream([np.array([300])], CONFIG, dtype=np.uint8))
    with pytest.raises(ValueError, match="dtype=float32 must be an integer dtype"):
        datasets.PackIterDataset(_parent(examples), PackConfig(8), dtype=np.float32)


def test_pack_iter_dataset_restores_the_run_dtype():
    examples = [np.array([3], np.uint8)] + [np.arange(i % 5 + 1, dtype=np.int64)
                                           for i in range(40)]
    ds = datasets.PackIterDataset(_parent(examples), PackConfig(8, max_segments=4),
                                  window=datasets.Window(4))
    it = iter(ds)
    for _ in range(3):
        next(it)
    state = it.get_state()
    rest = list(it)
    it2 = iter(ds)
    it2.set_state(state)
    again = list(it2)
    assert len(again) == len(rest)
    for a, b in zip(again, rest, strict=True):
        assert a["tokens"].dtype == b["tokens"].dtype == np.uint8
        np.testing.assert_array_equal(a["tokens"], b["tokens"])


@pytest.mark.parametrize("cls", [datasets.FirstFitPackIterDataset,
                                 datasets.BestFitPackIterDataset])
def test_dropins_never_wrap(cls):
    parent = _parent([np.array([1, 2], np.uint16), np.array([70000], np.int64)])
    with pytest.raises(InputError, match="parent element 1: feature 'tokens': value 70000 .*"
                                         "uint16"):
        list(cls(parent, length_struct={"tokens": 8}, num_packing_bins=2))
    # Values that fit are cast, and every batch has the first element's dtype.
    parent = _parent([np.array([1, 2], np.uint16)] + [np.array([9] * 7, np.int64)] * 3)
    rows = list(cls(parent, length_struct={"tokens": 8}, num_packing_bins=1))
    assert len(rows) == 4 and {r["tokens"].dtype for r in rows} == {np.dtype(np.uint16)}


def test_pad_id_the_dtype_cannot_hold_is_a_value_error():
    with pytest.raises(ValueError, match=r"pad_id=300 does not fit the rows' dtype uint8"):
        pack_ragged(np.array([1, 2], np.uint8), [0, 2], PackConfig(8, pad_id=300))
    with pytest.raises(ValueError, match=r"pad_id=70000 does not fit the rows' dtype uint16"):
        list(pack_stream([np.array([1], np.uint16)], PackConfig(8, pad_id=70000,
                                                                 strategy="best_fit")))
    with pytest.raises(ValueError, match=r"pad_id=300 does not fit the rows' dtype uint8"):
        datasets.PackIterDataset(_parent([]), PackConfig(8, pad_id=300), dtype=np.uint8)


_DTYPES = [np.uint8, np.uint16, np.int32, np.int64, np.uint64]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(_DTYPES),
                          st.lists(st.integers(-2, 70000), min_size=1, max_size=6)),
                min_size=1, max_size=12),
       st.sampled_from([None, np.int32]))
# The run's dtype checks its own examples' signs per batch of rows: a later example of another
# dtype failing at once must not be named before an earlier one waiting for its batch.
@example([(np.int32, [-1]), (np.int64, [-1])], None)
@example([(np.int32, [1]), (np.int32, [5, -2]), (np.int64, [3]), (np.uint16, [70000])], None)
def test_pack_stream_packs_exactly_or_names_the_first_value_that_does_not_fit(examples, dtype):
    arrays = [np.asarray(np.clip(v, *_range(d)), d) for d, v in examples]
    run = np.dtype(dtype or arrays[0].dtype)
    lo, hi = 0, np.iinfo(run).max
    bad = next((i for i, a in enumerate(arrays) if a.min() < lo or a.max() > hi), None)
    if bad is not None:
        with pytest.raises(InputError, match=f"^example {bad}: token id"):
            list(pack_stream(arrays, CONFIG, window=3, dtype=dtype))
        return
    rows = list(pack_stream(arrays, CONFIG, window=3, dtype=dtype))
    assert {r["tokens"].dtype for r in rows} == {run}
    assert _segments(rows) == {i: a.tolist() for i, a in enumerate(arrays)}
    # pack (offline) promotes to one dtype that holds every example: same tokens.
    assert _segments_batch(pack(arrays, CONFIG)) == _segments(rows)


def _range(dtype):
    info = np.iinfo(dtype)
    return info.min, info.max


def _segments_batch(batch):
    return _segments([{k: v[i] for k, v in batch.items()} for i in range(len(batch["tokens"]))])


def test_pack_never_promotes_ids_to_float():
    # numpy's result_type(uint64, int64) is float64: ids beyond 2**53 would lose digits.
    batch = pack([np.array([2**63 + 5], np.uint64), np.array([2], np.int64)], PackConfig(4))
    assert batch["tokens"].dtype == np.uint64
    assert sorted(_segments_batch(batch).values()) == [[2], [2**63 + 5]]
    with pytest.raises(InputError, match=r"sequences\[1\]: token id -2 .* negative"):
        pack([np.array([1], np.uint64), np.array([-2], np.int64)], PackConfig(4))


def test_inputs_of_uint64_and_int64_ids_read_as_uint64(tmp_path):
    import pyarrow as pa

    from seqpack.pipelines.formats.inputs import ReadOptions, read_corpus
    from tests.helpers.files import write_jsonl, write_parquet

    big = 2**63 + 5  # before: both files read into one float64 corpus, the big id rounded
    a = write_parquet(tmp_path / "a.parquet", [[big, 1]], value_type=pa.uint64())
    b = write_jsonl(tmp_path / "b.jsonl", [[2, 3]])
    corpus = read_corpus([a, b], ReadOptions())
    assert corpus.values.dtype == np.uint64 and corpus.values.tolist() == [big, 1, 2, 3]
