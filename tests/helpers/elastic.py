"""Online packing run on a layout of hosts (simulated with `Batching(shard_index, shard_count)`)
and worker processes, saved, and restored on another (tests/test_pipelines_elastic_online.py).

Example i's tokens are 10**6 + 1000 i + position, so every segment of every row is checked
against the reference it carries (`segment_source_index`, `segment_source_start`), and a run
is judged by the tokens of each example it packed: every one once per epoch, no more.
"""

from __future__ import annotations

import collections
import json

import numpy as np

from seqpack.packer import PackConfig
from seqpack.pipelines.datasets import (
    ArraySource,
    Batching,
    Prefetch,
    Window,
    make_training_pipeline,
)

PACK = PackConfig(32, max_segments=8, overflow="split")
WINDOW = Window(16, window_rows=4)


def examples(n: int = 240, *, high: int = 50, seed: int = 0, grow: int = 0) -> ArraySource:
    """n examples of 0..high tokens (some longer than PACK's rows: split), tokens naming them;
    `grow`: each that many tokens longer (the same examples, changed)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, high + 1, n) + grow
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    ex = np.repeat(np.arange(n), lengths)
    values = 10**6 + ex * 1000 + (np.arange(offsets[-1]) - offsets[ex])
    return ArraySource.from_ragged(values.astype(np.int32), offsets)


def segments(batch: dict[str, np.ndarray], feature: str = "tokens") -> list[tuple[int, int, int]]:
    """(example, start, length) of every segment of a batch, checked against its tokens."""
    out = []
    for r in range(len(batch[feature])):
        for i, s, n, o in zip(batch["segment_source_index"][r], batch["segment_source_start"][r],
                              batch[f"{feature}_segment_lengths"][r],
                              batch[f"{feature}_segment_offsets"][r]):
            if n:
                want = 10**6 + int(i) * 1000 + int(s) + np.arange(n)
                np.testing.assert_array_equal(batch[feature][r, o:o + n], want)
                out.append((int(i), int(s), int(n)))
    return out


def tokens_per_example(seen: list[tuple[int, int, int]]) -> collections.Counter:
    out: collections.Counter = collections.Counter()
    for i, _, n in seen:
        out[i] += n
    return out


def lengths(src) -> dict[int, int]:
    return {i: len(src[i]["tokens"]) for i in range(len(src))}


def pipeline(src, host: int, hosts: int, *, workers: int = 0, batch: int = 2,
             epochs: int | None = 1, pack: PackConfig = PACK, window: Window = WINDOW, **kw):
    return make_training_pipeline(
        src, pack=pack, batch=Batching(batch, drop_remainder=False, shard_index=host,
                                       shard_count=hosts),
        shuffle_seed=5, num_epochs=epochs, window=window,
        prefetch=Prefetch(worker_count=workers), **kw)


def run(src, hosts: int, *, steps: int | None, state=None, workers: int = 0,
        collect=segments, **kw) -> tuple[list, list[dict], list[list]]:
    """`steps` synchronous steps of every host (None: until all end), restored from `state`
    first; (what `collect` found in every batch, each host's state after them through a JSON
    round trip, each step's host batches as collected)."""
    its = [iter(pipeline(src, h, hosts, workers=workers, **kw)) for h in range(hosts)]
    try:
        if state is not None:
            for it in its:
                it.set_state(state)
        seen: list = []
        steps_seen: list[list] = []
        k = 0
        while steps is None or k < steps:
            batches = [next(it, None) for it in its]
            if all(b is None for b in batches):
                break
            step = [collect(b) if b is not None else None for b in batches]
            steps_seen.append(step)
            seen += [x for s in step if s is not None for x in s]
            k += 1
        states = [json.loads(json.dumps(it.get_state())) for it in its]
    finally:
        for it in its:
            it.close()
    return seen, states, steps_seen
