"""What the consumer scripts share: the SFT inputs, read with pyarrow alone (no seqpack).

Each script beside this file reads a `seqpack pack` output the way one consumer does and checks
every segment against the examples it came from; it runs in a process of its own and fails if
seqpack was imported (`done`).
"""

from __future__ import annotations

import sys

import numpy as np
import pyarrow.parquet as pq


def examples(paths: list[str]) -> list[dict[str, np.ndarray]]:
    """Every input example (inputs back to back): input_ids, labels, completion_mask."""
    out = []
    for path in paths:
        table = pq.read_table(path).to_pydict()
        for ids, labels, mask in zip(table["input_ids"], table["labels"],
                                     table["completion_mask"]):
            out.append({"input_ids": np.array(ids, np.int64), "labels": np.array(labels),
                        "completion_mask": np.array(mask)})
    return out


def source(ex: list[dict[str, np.ndarray]], index: int, start: int, length: int, key: str
           ) -> np.ndarray:
    """`key` of the slice [start, start + length) of example `index`."""
    return ex[index][key][start : start + length]


def loss(ex: list[dict[str, np.ndarray]], index: int, start: int, length: int) -> np.ndarray:
    """bool per token of a segment: it takes loss (its label is not -100, its mask not 0)."""
    return (source(ex, index, start, length, "labels") != -100) & (
        source(ex, index, start, length, "completion_mask") != 0)


def done(what: str) -> None:
    assert not any(m == "seqpack" or m.startswith("seqpack.") for m in sys.modules), \
        "a consumer's check imported seqpack"
    print("OK", what)
