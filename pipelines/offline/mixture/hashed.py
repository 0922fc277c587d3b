"""The mixed stream in steps over inputs and chunks (selection "hashed"), so that nothing per
example meets in one place: the Beam and Spark jobs run each step on their workers, and
`select_inputs` runs them one after the other here (the same functions: the same stream).

Every take of an example has a seeded 64-bit hash (`hashes`: a bijection of the example's index
in its dataset, so no two tie). Per dataset d (n_d examples, A_d units, target t_d)::

    epochs   e_d = floor(t_d / A_d): every example once per epoch
    sample   then each example whose sample hash is below `below_d`: the prefix of the
             sample-hash order whose units come nearest t_d - e_d A_d (within one example).
             `tally` sums each input's units per bucket of that hash, `crossings` finds the
             bucket the target ends in, `members` gives that bucket's examples, `plan` the cut.
    stream   each take has a place in [0, 1): its dataset's units before it over all it takes,
             estimated from its hash; chunk g of G = ceil(M / block_size) takes the places
             [g/G, (g+1)/G) (`picks`), and inside a chunk (`chunk`) the datasets interleave
             by the share of the chunk's units each has reached before an example, exactly.

The stream is the chunks back to back, then cut into blocks of `block_size` as a corpus is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from seqpack.pipelines.formats.inputs import fingerprint_path
from seqpack.pipelines.offline.mixture.spec import (
    MixSpec,
    Selection,
    epochs_of,
    example_units,
    targets,
)

NAME = "hashed"  # the record's `selection`
UNITS, TOKENS, LOSS, EXAMPLES = range(4)  # the rows of a tally
_MASK = (1 << 64) - 1
_SAMPLE = _MASK  # the sample's "epoch" in `key`
_BUCKET_EXAMPLES = 16  # log2 of the examples a crossing bucket holds, about


def _mix(x: int) -> int:
    """splitmix64's finalizer on a Python int."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


def key(seed: int, dataset: int, epoch: int) -> int:
    """The hash key of one epoch (`_SAMPLE`: the sample) of one dataset."""
    return _mix(_mix(_mix(seed & _MASK) ^ dataset) ^ (epoch & _MASK))


def hashes(k: int, first: int, n: int) -> np.ndarray:
    """u64[n]: the hashes of examples first..first+n-1 of a dataset under key `k`; distinct
    for distinct examples (splitmix64's finalizer is a bijection)."""
    x = np.arange(first, first + n, dtype=np.uint64)
    x += np.uint64(k)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def sample_hashes(seed: int, dataset: int, first: int, n: int) -> np.ndarray:
    """u64[n]: the sample hashes of examples first..first+n-1 of a dataset."""
    return hashes(key(seed, dataset, _SAMPLE), first, n)


def bucket_bits(count: int) -> int:
    """The tally's bucket bits for a dataset of `count` examples: 0 to 16."""
    return min(16, max(0, int(count).bit_length() - _BUCKET_EXAMPLES))


def _buckets(h: np.ndarray, bits: int) -> np.ndarray:
    return (h >> np.uint64(64 - bits)).astype(np.int64) if bits else np.zeros(h.size, np.int64)


@dataclasses.dataclass(frozen=True)
class Input:
    """One input of a mixture: its dataset, its first example in it and in the corpus, and its
    examples' lengths and loss tokens."""

    dataset: int
    first: int
    corpus_first: int
    lengths: np.ndarray
    loss: np.ndarray | None  # None: every kept token counts

    def sample_hashes(self, seed: int) -> np.ndarray:
        return sample_hashes(seed, self.dataset, self.first, self.lengths.size)

    def sums(self, spec: MixSpec) -> np.ndarray:
        """i64[4, n]: each example's units, kept tokens, loss tokens and 1."""
        kept, loss, units = self.units(spec)
        return np.stack([units, kept, loss, np.ones_like(kept)])

    def units(self, spec: MixSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`spec.example_units` of its examples."""
        kept = spec.kept(self.lengths)
        return example_units(spec, self.lengths, kept if self.loss is None else self.loss,
                             count_empty=False)


def inputs_of(spec: MixSpec, lengths: Sequence[np.ndarray], loss: Sequence[np.ndarray | None]
              ) -> list[Input]:
    """The job's inputs (`spec.inputs`, dataset after dataset) as `Input`s; `loss` None: every
    kept token counts."""
    assert len(lengths) == len(loss) == len(spec.inputs), (len(lengths), len(spec.inputs))
    where = places_of(spec, [np.asarray(x).size for x in lengths])
    return [Input(*where.of(i), np.asarray(x), None if y is None else np.asarray(y))
            for i, (x, y) in enumerate(zip(lengths, loss))]


@dataclasses.dataclass(frozen=True)
class Places:
    """Where each input of a mixture sits (i64[n] each): its dataset, its first example in it
    and in the corpus; and each dataset's examples (i64[K])."""

    dataset: np.ndarray
    first: np.ndarray
    corpus: np.ndarray
    examples: np.ndarray

    def of(self, index: int) -> tuple[int, int, int]:
        """(dataset, first example in it, first in the corpus) of input `index`."""
        return int(self.dataset[index]), int(self.first[index]), int(self.corpus[index])


def places_of(spec: MixSpec, counts: Sequence[int]) -> Places:
    """The `Places` of the job's inputs (`spec.inputs`) holding `counts` examples."""
    n = np.asarray(counts, np.int64)
    ends = np.cumsum([len(paths) for _, paths in spec.datasets])
    dataset = np.searchsorted(ends, np.arange(n.size), side="right")
    corpus = np.concatenate(([0], np.cumsum(n)))
    starts = corpus[np.concatenate(([0], ends[:-1]))]  # each dataset's first corpus example
    return Places(dataset, corpus[:-1] - starts[dataset], corpus[:-1],
                  np.bincount(dataset, n, len(spec.datasets)).astype(np.int64))


def tally(spec: MixSpec, item: Input, count: int) -> np.ndarray:
    """i64[4, 2**bits]: the input's units, kept tokens, loss tokens and examples per bucket of
    the sample hash (`count`: its dataset's examples, which set the bits); tallies add up."""
    bits = bucket_bits(count)
    b = _buckets(item.sample_hashes(spec.seed), bits)
    out = np.zeros((4, 1 << bits), np.int64)
    for row, s in zip(out, item.sums(spec)):
        if int(s.sum()) < 2**53:  # float64 adds these integers exactly
            row[:] = np.bincount(b, s, row.size).round()
        else:
            np.add.at(row, b, s)
    return out


@dataclasses.dataclass(frozen=True)
class Crossing:
    """Where one dataset's sample ends: its epochs, the units its sample wants, and the tally
    bucket the wanted units are reached in (-1: no sample) with the sums before it."""

    epochs: int
    rest: float
    target: float
    bits: int
    bucket: int
    before: np.ndarray  # i64[4]
    available: np.ndarray  # i64[4]: the dataset's units, kept tokens, loss tokens, examples


def crossings(spec: MixSpec, tallies: Sequence[np.ndarray]) -> tuple[float, list[Crossing]]:
    """(the total units, each dataset's `Crossing`) from its tally (the inputs' summed);
    UsageError as `spec.targets` refuses the mixture."""
    total, wanted = targets(spec, [int(t[UNITS].sum()) for t in tallies])
    out = []
    for t, want in zip(tallies, wanted):
        available = t.sum(axis=1)
        epochs, rest = epochs_of(want, int(available[UNITS]))
        bucket = int(np.searchsorted(np.cumsum(t[UNITS]), rest, side="left")) if rest else -1
        before = t[:, : max(bucket, 0)].sum(axis=1)
        out.append(Crossing(epochs, rest, want, int(t.shape[1]).bit_length() - 1, bucket,
                            before, available))
    return total, out


def members(spec: MixSpec, cross: Crossing, item: Input) -> tuple[np.ndarray, np.ndarray]:
    """The input's examples in its dataset's crossing bucket: (u64 sample hashes, i64[4, m]
    sums as `Input.sums`)."""
    if cross.bucket < 0:
        return np.zeros(0, np.uint64), np.zeros((4, 0), np.int64)
    h = item.sample_hashes(spec.seed)
    inside = np.flatnonzero(_buckets(h, cross.bits) == cross.bucket)
    return h[inside], item.sums(spec)[:, inside]


@dataclasses.dataclass(frozen=True)
class MixPlan:
    """What a mixture takes of each dataset (`epochs`, then the sample: sample hash below
    `below`; 2**64: every example) and the manifest's `mixture` record."""

    epochs: list[int]
    below: list[int]
    available: list[int]  # each dataset's units
    sample: list[int]  # the units of each dataset's sample
    record: dict

    @property
    def num_examples(self) -> int:
        return sum(int(d["examples"]) for d in self.record["datasets"])

    def chunks(self, block_size: int) -> int:
        """The stream's chunks: about a block each."""
        return max(1, -(-self.num_examples // block_size))

    def times(self, seed: int, dataset: int, first: int, n: int) -> np.ndarray:
        """i64[n]: how often examples first..first+n-1 of a dataset are taken."""
        return _taken(sample_hashes(seed, dataset, first, n), self.below[dataset]).astype(
            np.int64) + self.epochs[dataset]


def _taken(h: np.ndarray, below: int) -> np.ndarray:
    """bool[n]: whether sample hashes `h` are below `below` (2**64: all are)."""
    return h < np.uint64(below) if below <= _MASK else np.ones(h.size, bool)


def _cut(cross: Crossing, found: Sequence[tuple[np.ndarray, np.ndarray]]
         ) -> tuple[int, np.ndarray]:
    """(below, i64[4] sums of the sample) of one dataset from its crossing bucket's examples:
    the prefix of the sample-hash order whose units come nearest the rest (`legacy._sample`'s
    rule)."""
    if cross.bucket < 0:
        return 0, np.zeros(4, np.int64)
    h = np.concatenate([np.zeros(0, np.uint64), *(f[0] for f in found)])
    sums = np.concatenate([np.zeros((4, 0), np.int64), *(f[1] for f in found)], axis=1)
    order = np.argsort(h)
    h, sums = h[order], sums[:, order]
    cum = cross.before[UNITS] + np.cumsum(sums[UNITS])
    k = int(np.searchsorted(cum, cross.rest, side="left"))  # cum[k - 1] < rest <= cum[k]
    assert k < cum.size, (k, cum.size)
    prev = cum[k - 1] if k else cross.before[UNITS]
    k += bool(cum[k] - cross.rest <= cross.rest - prev)
    end = (cross.bucket + 1) << (64 - cross.bits)  # the bucket's end: past each hash in it
    return int(h[k]) if k < h.size else end, cross.before + sums[:, :k].sum(axis=1)


def plan(spec: MixSpec, total: float, cross: Sequence[Crossing],
         found: Sequence[Sequence[tuple[np.ndarray, np.ndarray]]]) -> MixPlan:
    """The mixture's `MixPlan` from each dataset's `Crossing` and its crossing bucket's
    examples (`members` of each of its inputs)."""
    entries, epochs, below, available, sample = [], [], [], [], []
    first = 0
    for d, ((name, paths), c) in enumerate(zip(spec.datasets, cross)):
        cut, got = _cut(c, found[d])
        taken = c.epochs * c.available + got
        a = int(c.available[UNITS])
        entries.append({
            "name": name, "inputs": [fingerprint_path(p) for p in paths],
            "weight": spec.weights[name], "target": round(c.target, 3),
            "units": int(taken[UNITS]), "tokens": int(taken[TOKENS]),
            "loss_tokens": int(taken[LOSS]), "examples": int(taken[EXAMPLES]),
            "repetitions": round(int(taken[UNITS]) / a, 6), "epochs": c.epochs,
            "available_units": a, "available_examples": int(c.available[EXAMPLES]),
            "first_example": first, "sample_below": hex(cut),
            "unused_examples": 0 if c.epochs else int(c.available[EXAMPLES] - got[EXAMPLES])})
        first += int(c.available[EXAMPLES])
        epochs.append(c.epochs)
        below.append(cut)
        available.append(a)
        sample.append(int(got[UNITS]))
    record = {**spec.to_dict(), "selection": NAME, "total": round(total, 3),
              "datasets": entries}
    return MixPlan(epochs, below, available, sample, record)


def plan_of(record: Mapping) -> MixPlan:
    """The `MixPlan` a manifest's `mixture` record (selection "hashed") was made with."""
    datasets = record["datasets"]
    return MixPlan([d["epochs"] for d in datasets], [int(d["sample_below"], 16) for d in datasets],
                   [d["available_units"] for d in datasets],
                   [d["units"] - d["epochs"] * d["available_units"] for d in datasets],
                   dict(record))


@dataclasses.dataclass(frozen=True)
class Picks:
    """Some takes of one dataset's examples in one epoch, bound for one chunk of the stream."""

    dataset: int
    epoch: int  # the sample's: the dataset's epochs
    hash: np.ndarray  # u64: each take's hash in that epoch
    ref: np.ndarray  # i64: its corpus example
    length: np.ndarray  # its length (i32 where lengths and units fit, else i64)
    units: np.ndarray  # its units (as `length`)


def picks(spec: MixSpec, mix: MixPlan, chunks: int, item: Input) -> list[tuple[int, Picks]]:
    """The input's takes, as (chunk, Picks) per epoch and chunk of the stream they land in."""
    d, n = item.dataset, item.lengths.size
    a, e = mix.available[d], mix.epochs[d]
    total = max(1, e * a + mix.sample[d])
    units = item.units(spec)[2]
    small = max(int(item.lengths.max(initial=0)), int(units.max(initial=0))) < 2**31
    lengths = item.lengths.astype(np.int32 if small else np.int64, copy=False)
    units = units.astype(lengths.dtype, copy=False)
    out: list[tuple[int, Picks]] = []

    def emit(epoch: int, h: np.ndarray, place: np.ndarray, take: np.ndarray | None) -> None:
        place *= chunks
        chunk = place.astype(np.int64)
        del place
        np.minimum(chunk, chunks - 1, out=chunk)
        order = np.argsort(chunk, kind="stable")
        present, starts = np.unique(chunk[order], return_index=True)
        for g, i, j in zip(present.tolist(), starts.tolist(), [*starts[1:].tolist(), h.size]):
            run = order[i:j]
            at = run if take is None else take[run]
            out.append((g, Picks(d, epoch, h[run], item.corpus_first + at, lengths[at],
                                 units[at])))

    for j in range(e):  # place: the units before the take, over `total`, estimated
        h = hashes(key(spec.seed, d, j), item.first, n)
        emit(j, h, (h / 2.0**64 + j) * (a / total), None)
    if mix.below[d]:
        h = item.sample_hashes(spec.seed)
        take = np.flatnonzero(_taken(h, mix.below[d]))
        h = h[take]
        emit(e, h, (h / float(mix.below[d]) * mix.sample[d] + e * a) / total, take)
    return out


def chunk(found: Sequence[Picks]) -> tuple[np.ndarray, np.ndarray]:
    """One chunk of the stream from its takes (any order): (lengths in the takes' dtype, i64
    corpus examples), each dataset in its takes' order (epoch, then hash), the datasets
    interleaved by the share of the chunk's units each has reached before a take (ties: in
    dataset order)."""
    shares, lengths, refs = [], [], []
    for d in sorted({p.dataset for p in found}):
        mine = [p for p in found if p.dataset == d]
        h, ref, length, units = (np.concatenate([getattr(p, f) for p in mine]) for f in
                                 ("hash", "ref", "length", "units"))
        epoch = np.concatenate([np.full(p.hash.size, p.epoch, np.int32) for p in mine])
        order = np.lexsort((h, epoch))
        del epoch, h
        units = units[order]
        before = np.cumsum(units)
        before -= units
        shares.append(before / max(1, int(units.sum())))
        lengths.append(length[order])
        refs.append(ref[order])
    if not shares:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    # by share; a stable sort keeps the datasets' order, then each one's, on a tie
    order = np.argsort(np.concatenate(shares), kind="stable")
    return np.concatenate(lengths)[order], np.concatenate(refs)[order]


def select_inputs(spec: MixSpec, lengths: Sequence[np.ndarray],
                  loss: Sequence[np.ndarray | None], block_size: int) -> Selection:
    """The mixed stream of a job's inputs (`spec.inputs`), each input's example lengths and
    loss tokens (None: every kept token counts), the steps run one after the other here."""
    items = inputs_of(spec, lengths, loss)
    mix = plan_inputs(spec, items)
    chunks = mix.chunks(block_size)
    found: dict[int, list[Picks]] = {}
    for item in items:
        for g, p in picks(spec, mix, chunks, item):
            found.setdefault(g, []).append(p)
    stream = np.empty(mix.num_examples, np.int64)
    ref = np.empty(mix.num_examples, np.int64)
    at = 0
    for g in sorted(found):  # each chunk's takes freed once it is made
        part = chunk(found.pop(g))
        stream[at : at + part[0].size], ref[at : at + part[0].size] = part
        at += part[0].size
    assert at == mix.num_examples, (at, mix.num_examples)
    return Selection(ref, stream, mix.record)


def plan_inputs(spec: MixSpec, items: Sequence[Input]) -> MixPlan:
    """`plan` of inputs at hand: their tallies summed, the crossings, their members."""
    counts = np.bincount([i.dataset for i in items], [i.lengths.size for i in items],
                         len(spec.datasets)).astype(np.int64)
    tallies = [np.zeros((4, 1 << bucket_bits(c)), np.int64) for c in counts]
    for item in items:
        tallies[item.dataset] += tally(spec, item, counts[item.dataset])
    total, cross = crossings(spec, tallies)
    found: list[list] = [[] for _ in cross]
    for item in items:
        found[item.dataset].append(members(spec, cross[item.dataset], item))
    return plan(spec, total, cross, found)
