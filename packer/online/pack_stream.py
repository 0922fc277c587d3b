"""`pack_stream`: the whole online packer over an iterable of token arrays.

`StreamPlanner` plans the examples' lengths window by window; this holds the tokens of the
examples that open rows may still need and writes each final row with the one row writer
(`assemble.build_rows`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

import numpy as np

from seqpack.packer.assemble import build_rows
from seqpack.packer.config import PackConfig
from seqpack.packer.inputs import InputError, check_pad, fit_dtype, row_dtype
from seqpack.packer.online.stream import StreamPlanner
from seqpack.packer.plan import PackPlan


def pack_stream(
    iterable: Iterable[object], config: PackConfig, *, window: int = 1024,
    dtype: object = None, **planner_kwargs
) -> Iterator[dict[str, np.ndarray]]:
    """Packs token arrays online; yields one row dict (`[L]` / `[S]` arrays) as rows become final.

    `segment_source_index` holds each example's position in `iterable`. Memory is bounded by
    the window (or `window_rows` rows' worth, the larger) and the open rows (`StreamPlanner`).

    One token dtype for every row: `dtype`, else the first non-empty example's. Every example is
    checked against it: an id it cannot hold (or a negative one) raises `InputError` naming the
    example, never wraps.
    """
    planner = StreamPlanner(config, window=window, **planner_kwargs)
    held: dict[int, np.ndarray] = {}  # tokens of examples that may still be in open rows
    order: deque[int] = deque()
    ids: list[int] = []
    run_dtype = None if dtype is None else row_dtype(dtype)
    origin = ""
    if run_dtype is not None:
        check_pad(config.pad_id, run_dtype)
        origin = " (dtype= of pack_stream)"

    def emit(p: PackPlan) -> Iterator[dict[str, np.ndarray]]:
        if not p.num_rows:
            return
        pieces = [held[e][s : s + m] for e, s, m in
                  zip(p.example.tolist(), p.start.tolist(), p.length.tolist())]
        batch = build_rows(pieces, p, config, dtype=run_dtype or np.dtype(np.int32))
        tokens = batch[config.feature]
        if tokens.dtype.kind == "i" and tokens.size and tokens.min() < 0:
            name_first_bad()  # checked once per batch of rows instead of once per example
        keys = list(batch)
        cols = [batch[k] for k in keys]
        for i in range(p.num_rows):
            yield {k: c[i] for k, c in zip(keys, cols)}

    def name_first_bad() -> None:
        # Ids of the run's dtype are checked as rows are built: the first bad may be one held.
        if run_dtype is None:  # only empty examples so far
            return
        for e in sorted(held):
            fit_dtype(held[e], run_dtype, f"example {e}", origin=origin)

    def release() -> None:
        # Every id seen so far is planned; only those in open rows are still needed.
        oldest = planner.oldest_open_id()
        while order and (oldest is None or order[0] < oldest):
            held.pop(order.popleft())

    for i, seq in enumerate(iterable):
        arr = np.asarray(seq)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ValueError(
                f"example {i} must be a 1-D array of integer token ids, got shape {arr.shape} "
                f"dtype {arr.dtype}"
            )
        if arr.size:
            if run_dtype is None:
                run_dtype = arr.dtype
                check_pad(config.pad_id, run_dtype)
                origin = " (the first example's dtype; pass dtype= for a wider one)"
            elif arr.dtype != run_dtype or arr.size > config.seq_len and arr.dtype.kind == "i" \
                    and int(arr.min()) < 0:  # same dtype: checked per batch, but for cut tokens
                try:
                    arr = fit_dtype(arr, run_dtype, f"example {i}", origin=origin)
                except InputError:
                    name_first_bad()  # an earlier, still unchecked example comes first
                    raise
        held[i] = arr
        order.append(i)
        ids.append(i)
        if len(ids) == window:
            p = planner.add_plan(ids, [held[j].size for j in ids])
            ids = []
            yield from emit(p)
            release()
    if ids:
        yield from emit(planner.add_plan(ids, [held[j].size for j in ids]))
    yield from emit(planner.finish_plan())
