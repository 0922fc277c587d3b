"""The positions each consumer reads, pooled and dealt again over any sequence of layouts
(`elastic.streams`), and the compact tables states carry (`elastic.flight`)."""

from __future__ import annotations

import collections

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpack.pipelines.datasets.elastic.flight import Flight, decode_table, encode_table
from seqpack.pipelines.datasets.elastic.streams import Stream, deal, pool

LIMIT = 400


def _layout(streams_by_host, reads, rng=None):
    """Every consumer reads a random number of positions (at most `reads`; no rng: all)."""
    seen = []
    for host in streams_by_host:
        for s in host:
            for _ in range(reads if rng is None else int(rng.integers(0, reads + 1))):
                p = s.next(LIMIT)
                if p is None:
                    break
                seen.append(p)
    return seen


@settings(max_examples=200, deadline=None)
@given(layouts=st.lists(st.tuples(st.integers(1, 8), st.integers(1, 4), st.booleans()),
                        min_size=1, max_size=5),
       reads=st.integers(0, 40), seed=st.integers(0, 2**16))
def test_every_position_once_through_any_sequence_of_layouts(layouts, reads, seed):
    """Hosts x workers layouts in turn; a change keeps the host count and only re-deals each
    host's workers (`host`), or pools every consumer (`whole`); each position below the limit
    is read once, in the end, and never twice."""
    rng = np.random.default_rng(seed)
    H, W, _ = layouts[0]
    hosts = [[Stream.initial(w * H + h, H * W) for w in range(W)] for h in range(H)]
    seen = _layout(hosts, reads, rng)
    for H2, W2, only_workers in layouts[1:]:
        if only_workers:  # the same hosts, each dealing its own positions to W2 workers
            hosts = [[deal(pool(host, whole=False), w, W2) for w in range(W2)]
                     for host in hosts]
        else:
            left = pool([s for host in hosts for s in host], whole=True)
            hosts = [[deal(left, w * H2 + h, H2 * W2) for w in range(W2)] for h in range(H2)]
        for host in hosts:
            for s in host:
                s.clip(LIMIT)
        seen += _layout(hosts, reads, rng)
    seen += _layout(hosts, LIMIT + 1)  # every consumer to the end
    counts = collections.Counter(seen)
    assert set(counts.values()) <= {1}
    assert sorted(counts) == list(range(LIMIT))


def test_the_worked_example():
    a, b = Stream.initial(0, 2), Stream.initial(1, 2)
    assert [a.next(None) for _ in range(3)] == [0, 2, 4] and b.next(None) == 1
    left = pool([a, b], whole=True)
    assert left.runs == [[3, 2, 2]] and left.tail == [6, 1]
    firsts = [[deal(left, i, 3).next(None) for _ in range(1)] for i in range(3)]
    s1 = deal(left, 1, 3)
    assert [s1.next(None) for _ in range(3)] == [3, 7, 10]
    assert firsts == [[6], [3], [5]]


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 30), st.integers(1, 5), st.sampled_from([0, 1, 2**20, 2**40]),
       st.booleans(), st.integers(0, 2**16))
def test_tables_round_trip_in_the_narrowest_integers(n, w, span, sort, seed):
    rng = np.random.default_rng(seed)
    table = rng.integers(-span, span + 1, (n, w), dtype=np.int64)
    if sort and n:
        table[:, 0] = np.sort(table[:, 0])
    deltas = (0,) if sort else ()
    assert np.array_equal(decode_table(encode_table(table, deltas=deltas)), table)


def test_examples_in_flight_are_dealt_whole():
    refs = (np.array([3, 5, 9]), (np.array([0, 1, 0], np.int32), np.array([70, 30, 71]),
                                  np.array([7, 74, 3])))
    flight = Flight.of(np.array([5, 3, 5, 9]), np.array([0, 0, 64, 0]),
                       np.array([64, 7, 10, 3]), refs)
    assert flight.index.tolist() == [70, 30, 71] and flight.dataset.tolist() == [0, 1, 0]
    assert flight.size.tolist() == [7, 74, 3]
    back = Flight.decode(flight.encode())
    assert np.array_equal(back.pieces, flight.pieces) and np.array_equal(back.size, flight.size)
    old = flight.encode() | {"examples": encode_table(np.stack([flight.dataset, flight.index], 1))}
    assert Flight.decode(old).size.tolist() == [-1, -1, -1]  # a state saved before sizes
    parts = [flight.share(i, 2) for i in range(2)]
    assert [p.index.tolist() for p in parts] == [[70, 71], [30]]
    assert sorted(parts[1].pieces[:, 1].tolist()) == [0, 64]  # both pieces of example 30
    both = Flight.concat(parts, 1)
    assert both.num_examples == 3 and len(both.pieces) == 4
