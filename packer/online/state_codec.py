"""Compact checkpoint form of a planner state: open rows as one base64(zlib(i64)) string.

`PackIterDataset` states travel with every element under `mp_prefetch` and into checkpoints;
a planner's open rows as nested lists pickle slowly (benchmarks/README.md), one string does not.

Example::

    {"windows": 3, "rows": [{"born": 2, "pieces": [[7, 0, 5], [9, 0, 2]]}], "counters": {...}}
    -> {"windows": 3, "counters": {...}, "piece_width": 3,
        "rows_i64": base64(zlib(i64[2, 2, 7, 0, 5, 9, 0, 2]))}
"""

from __future__ import annotations

import base64
import zlib
from typing import Any

import numpy as np


def encode_planner_state(state: dict[str, Any]) -> dict[str, Any]:
    """Planner state with its open rows as one string: base64(zlib(i64)), cheap to pickle/save.

    rows -> [born, number of pieces, *piece, born, ...], every piece `width` ints
    ((id, start, length) for one feature; (id, length per feature) for several).
    """
    flat: list[int] = []
    width = 0
    for row in state["rows"]:
        flat += (row["born"], len(row["pieces"]))
        for piece in row["pieces"]:
            flat += piece
            width = len(piece)
    raw = zlib.compress(np.asarray(flat, "<i8").tobytes(), 1)
    blob = base64.b64encode(raw).decode("ascii")
    out = {k: v for k, v in state.items() if k != "rows"}
    out.update(rows_i64=blob, piece_width=width)
    return out


def encode_row_arrays(state: dict[str, Any], born: np.ndarray, pieces: np.ndarray,
                      row: np.ndarray) -> dict[str, Any]:
    """`encode_planner_state` of `state` (its scalars) with rows given as arrays: `pieces`
    (i64[P, w]) sorted by `row` (i64[P], 0 .. R - 1, every row holding a piece or not) and
    `born` (i64[R]); the same dict, without building the rows as lists first."""
    num_rows = int(born.size)
    count = np.bincount(row, minlength=num_rows) if num_rows else np.zeros(0, np.int64)
    width = int(pieces.shape[1]) if pieces.size else 0
    size = count * width + 2
    start = np.cumsum(size) - size  # where each row's (born, count) header goes
    flat = np.empty(int(size.sum()), "<i8")
    body = np.ones(flat.size, bool)
    body[start] = body[start + 1] = False
    flat[start], flat[start + 1] = born, count
    flat[body] = pieces[:, :width].ravel() if width else []
    out = {k: v for k, v in state.items() if k != "rows"}
    out.update(rows_i64=base64.b64encode(zlib.compress(flat.tobytes(), 1)).decode("ascii"),
               piece_width=width)
    return out


def decode_planner_state(state: dict[str, Any]) -> dict[str, Any]:
    """Inverse of `encode_planner_state` (a plain planner state passes through)."""
    if "rows_i64" not in state:
        return state
    raw = zlib.decompress(base64.b64decode(state["rows_i64"]))
    flat = np.frombuffer(raw, "<i8").tolist()
    width, rows, i = int(state["piece_width"]), [], 0
    while i < len(flat):
        born, k = flat[i], flat[i + 1]
        i += 2
        rows.append({"born": born,
                     "pieces": [flat[i + j * width : i + (j + 1) * width] for j in range(k)]})
        i += k * width
    out = {k: v for k, v in state.items() if k not in ("rows_i64", "piece_width")}
    out["rows"] = rows
    return out
