"""Test helpers for the pipelines tests: random corpora, row comparison, restore-at-every-step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from seqpack.pipelines.datasets import ArraySource, SequentialIterDataset
from seqpack.pipelines.datasets.training import ensure_flags_parsed

ensure_flags_parsed()  # grain's worker processes read absl flags


def random_lengths(rng: np.random.Generator, n: int, *, high: int, zero_prob: float = 0.0):
    """Log-uniform-ish lengths in [1, high] (some 0 with `zero_prob`)."""
    lengths = np.exp(rng.uniform(0, np.log(high + 1), n)).astype(np.int64).clip(1, high)
    if zero_prob:
        lengths[rng.random(n) < zero_prob] = 0
    return lengths


def unique_corpus(lengths, *, dtype=np.int32) -> tuple[np.ndarray, np.ndarray]:
    """Flat values + offsets where every token is unique: its global position + 1."""
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return (np.arange(int(offsets[-1])) + 1).astype(dtype), offsets


def sft_corpus(lengths, seed: int = 0):
    """tokens unique (1..N); labels = tokens but -100 on a random prompt; mask = 1 on answers."""
    values, offsets = unique_corpus(lengths)
    rng = np.random.default_rng(seed)
    labels = values.astype(np.int64)
    for a, b in zip(offsets[:-1], offsets[1:]):
        labels[a : a + int(rng.integers(0, b - a + 1))] = -100
    mask = (labels != -100).astype(np.int8)
    return values, offsets, labels, mask


def sft_source(values, offsets, labels, mask, **extra) -> ArraySource:
    return ArraySource({"tokens": (values, offsets), "labels": (labels, offsets),
                        "mask": (mask, offsets), **extra}, value_columns=["labels", "mask"])


def iter_source(values, offsets, *, feature: str = "tokens") -> SequentialIterDataset:
    return SequentialIterDataset(ArraySource.from_ragged(values, offsets, feature=feature))


def assert_rows_equal(a: list[dict], b: list[dict], *, keys: set[str] | None = None) -> None:
    """Same number of rows, same keys (or `keys` only), equal arrays / meta lists."""
    assert len(a) == len(b), (len(a), len(b))
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        kx = set(x) if keys is None else keys
        if keys is None:
            assert set(x) == set(y), (i, sorted(x), sorted(y))
        for k in kx:
            vx, vy = x[k], y[k]
            if isinstance(vx, list) or (isinstance(vx, np.ndarray) and vx.dtype == object):
                assert list(vx) == list(vy), (i, k)
                continue
            np.testing.assert_array_equal(vx, vy, err_msg=f"row {i} key {k}")
            assert np.asarray(vx).dtype == np.asarray(vy).dtype, (i, k, vx.dtype, vy.dtype)


def stack(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def check_restore_every_step(make_iter: Callable[[], Any], *, max_rows: int | None = None):
    """Restores a fresh iterator from the state at every step; each yields the same tail.

    Returns the uninterrupted rows. States go through a JSON round trip (checkpoint format).
    """
    import json

    it = make_iter()
    states, rows = [it.get_state()], []
    truncated = False
    for row in it:
        rows.append(row)
        states.append(json.loads(json.dumps(it.get_state())))
        if max_rows is not None and len(rows) >= max_rows:
            truncated = True
            break
    for step, state in enumerate(states):
        want = rows[step : step + 3]
        if truncated and not want:
            continue
        restored = make_iter()
        restored.set_state(state)
        tail = []
        for row in restored:
            tail.append(row)
            if len(tail) >= len(want):
                break
        assert_rows_equal(tail, want)  # at the natural end: nothing more either
    return rows


def write_packed(directory, rows: list[dict[str, np.ndarray]], *, seq_len: int, max_segments: int,
                 shard_rows: int, columns: dict[str, int] | None = None,
                 row_order: dict | None = None, roles: dict[str, str] | None = None
                 ) -> list[dict[str, np.ndarray]]:
    """A complete packed directory (what `seqpack pack` writes) holding `rows` in order: shards
    of `shard_rows` without the derived [L] keys, a signed manifest with `columns` ({name: pad};
    with `roles`, each column's, as `seqpack pack` records them) and `row_order`. Returns the
    rows as stored + restored (what a reader yields)."""
    import os

    from array_record.python.array_record_module import ArrayRecordWriter

    from seqpack.packer import PackConfig
    from seqpack.pipelines.formats.manifest import Manifest, file_digest, shard_names
    from seqpack.pipelines.formats.manifest import write_manifest as write
    from seqpack.pipelines.formats.records import encode_row

    config = PackConfig(seq_len, max_segments=max_segments)
    k = config.keys()
    stored = [n for n in k.roles().values() if n not in k.derived] + list(columns or {})
    names = shard_names(len(rows), shard_rows)
    counts = []
    for i, name in enumerate(names):
        w = ArrayRecordWriter(os.path.join(directory, name), "group_size:1")
        part = rows[i * shard_rows : (i + 1) * shard_rows]
        for r in part:
            w.write(encode_row({n: r[n] for n in stored}))
        w.close()
        counts.append(len(part))
    digests = [file_digest(os.path.join(directory, n)) for n in names]
    cols = None if columns is None else [
        {"name": n, "source": n, "dtype": rows[0][n].dtype.str, "pad": int(p),
         **({"role": roles[n]} if roles and n in roles else {})}
        for n, p in columns.items()]
    write(str(directory), Manifest(
        config=config.to_dict(), inputs={}, writer_options="group_size:1", stored_keys=stored,
        shard_rows=shard_rows, num_rows=len(rows), shards=names, shard_num_rows=counts,
        stats={}, example_length_histogram={}, shard_bytes=[b for b, _ in digests],
        shard_sha256=[h for _, h in digests], row_order=row_order, columns=cols))
    return [{n: r[n] for n in [*k.roles().values(), *(columns or {})]} for r in rows]
