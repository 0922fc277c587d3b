"""`ElasticExamples`: the examples of a random-access source in one seeded global order, each
consumer (a host's worker process) reading its positions of it (`streams.Stream`).

The global order is every example, shuffled per epoch (seeded, reshuffled every epoch:
`GlobalOrder`), epoch after epoch. Consumer j = w H + h of K = H W reads positions j, j + K, ...
(one host without workers: the order itself).
Its state is what its stream has left, so the positions left by any layout can be pooled and
dealt to another (`streams.pool` / `deal`). The packer above it names the examples it holds by
their index in the source (`take_refs`) and fetches them again on a restore (`fetch`).

Example::

    src = ElasticExamples(ArraySource.from_sequences(seqs), seed=0, num_epochs=1,
                          shard_index=1, shard_count=2)   # host 1 of 2: positions 1, 3, 5, ...
"""

from __future__ import annotations

from typing import Any

import grain
import numpy as np

from seqpack.pipelines.datasets.elastic.streams import Stream


def consumer_of(shard: tuple[int, int], worker: tuple[int, int]) -> tuple[int, int]:
    """(consumer index j = w H + h, consumers K = H W) of host h of H and worker w of W."""
    (h, H), (w, W) = shard, worker
    return w * H + h, H * W


class GlobalOrder:
    """Position p -> the index of the example there: every example of `size`, shuffled per epoch
    (seeded by `seed` and the epoch p // size), epoch after epoch. Up to `HELD` examples an
    epoch's permutation is held (4 bytes an example, the last two epochs touched); past that
    Grain's index shuffle computes each position in O(1) memory (a few microseconds; it takes
    ~100 us a position on a few hundred examples, which a held permutation does not)."""

    HELD = 1 << 20

    def __init__(self, size: int, seed: int):
        self.size, self.seed = int(size), int(seed)
        self._epochs: dict[int, np.ndarray] = {}
        self._shuffle = None if size <= self.HELD else \
            grain.MapDataset.range(size).shuffle(seed=seed % 2**32)

    def __getitem__(self, p: int) -> int:
        if self._shuffle is not None:
            return int(self._shuffle[p]) % self.size
        epoch, i = divmod(p, self.size)
        perm = self._epochs.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.size)
            perm = perm.astype(np.int32)
            if len(self._epochs) >= 2:
                del self._epochs[min(self._epochs)]
            self._epochs[epoch] = perm
        return int(perm[i])


def global_order(size: int, seed: int) -> GlobalOrder:
    """Position -> example index: every example, reshuffled every epoch (`GlobalOrder`)."""
    return GlobalOrder(size, seed)


class ElasticExamples(grain.IterDataset):
    """Examples of `source` in a seeded global order, dealt to hosts and worker processes by
    position (see the module docstring). `num_epochs` None: endless."""

    def __init__(self, source: Any, *, seed: int, num_epochs: int | None, shard_index: int,
                 shard_count: int):
        super().__init__()
        self.source = source
        self.size = len(source)
        self.order = global_order(self.size, seed)
        self.limit = None if num_epochs is None else self.size * num_epochs
        self.shard = (int(shard_index), int(shard_count))
        self.worker = (0, 1)

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        """Called by Grain in each prefetch worker: worker w of W (positions are dealt in turn,
        `sequential_slice` or not)."""
        self.worker = (sl.start or 0, sl.step or 1)

    def consumer(self) -> tuple[int, int]:
        return consumer_of(self.shard, self.worker)

    def __iter__(self) -> ElasticExamplesIterator:
        return ElasticExamplesIterator(self)

    def __str__(self) -> str:
        return (f"ElasticExamples(n={self.size}, shard {self.shard[0]} of {self.shard[1]}, "
                f"worker {self.worker[0]} of {self.worker[1]})")


class ElasticExamplesIterator(grain.DatasetIterator):
    """Reads its consumer's positions; `take_refs` / `fetch` for the packer above it."""

    names = ("examples",)

    def __init__(self, ds: ElasticExamples):
        super().__init__()
        self._ds = ds
        self.stream = Stream.initial(*ds.consumer())
        self._refs: list[int] = []
        self.read = 0

    @property
    def limits(self) -> list[int | None]:
        return [self._ds.limit]

    def consumer(self) -> tuple[int, int]:
        return self._ds.consumer()

    def layout(self) -> tuple[int, int, int, int]:
        """(host, hosts, worker, workers) of this consumer."""
        return (*self._ds.shard, *self._ds.worker)

    def __next__(self) -> Any:
        ds, stream, refs = self._ds, self.stream, self._refs
        source, order, limit = ds.source, ds.order, ds.limit
        while True:
            p = stream.next(limit)
            if p is None:
                raise StopIteration
            index = order[p]
            element = source[index]
            self.read += 1
            if element is not None:
                refs.append(index)
                return element

    def ref_of(self, i: int) -> str | None:
        """Where the i-th element since the last `take_refs` came from, for an error."""
        return f"example {self._refs[i]} of the source" if 0 <= i < len(self._refs) else None

    def take_refs(self) -> tuple[np.ndarray, np.ndarray]:
        """(dataset i32[n] (all 0), index i64[n]) of the n elements yielded since the last call."""
        index = np.asarray(self._refs, np.int64)
        self._refs = []
        return np.zeros(index.size, np.int32), index

    def take_cuts(self) -> list[int]:
        return []

    def fetch(self, dataset: int, index: int) -> Any:
        return self._ds.source[index]

    def install(self, streams: list[Stream]) -> None:
        """Reads `streams[0]` from here (a restore on another layout)."""
        self.stream = streams[0].clip(self._ds.limit)
        self._refs = []

    def get_state(self) -> dict[str, Any]:
        return {"streams": [self.stream.to_state()], "read": self.read,
                "consumer": list(self.consumer())}

    def set_state(self, state: dict[str, Any]) -> None:
        self._refs = []
        self.read = int(state.get("read", 0))
        if not self.read and list(state["consumer"]) != list(self.consumer()):
            self.stream = Stream.initial(*self.consumer())  # an unsliced copy's first state
            return
        self.stream = Stream.from_state(state["streams"][0])

    def __str__(self) -> str:
        return "ElasticExamplesIterator"
