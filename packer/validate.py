"""Checks a packed batch against the row contract (raises ValueError naming row and slot), and
the pieces of many rows against the examples they came from (`coverage`)."""

from __future__ import annotations

import numpy as np

from seqpack.packer.config import PackConfig
from seqpack.packer.contract import SEGMENT_DTYPE, SOURCE_DTYPE


def _fail(msg: str) -> None:
    raise ValueError(f"packed batch violates the row contract: {msg}")


def _first(mask: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(mask)[0])


def validate(batch: dict, config: PackConfig, *, derived: bool = True, padding: bool = True
             ) -> None:
    """Raises ValueError for the first contract violation in `batch` (a `[R, ...]` dict or a row).

    Checked: keys, shapes and dtypes; token ids >= 0; lengths >= 0 with used slots first;
    offsets non-decreasing, aligned, in range and not overlapping; unused slots hold the row's
    used length and source -1;
    segment ids, positions and padding tokens agree with lengths / offsets. `derived=False`:
    the batch need not hold the segment ids and positions (rows as stored, before
    `contract.restore_derived` rebuilds them from these very lengths and offsets).
    `padding=False`: the padding tokens are left to the caller (`seqpack verify` compares every
    position of the rows with what the writer should have written).
    """
    k = config.keys().roles()
    if not derived:
        k = {role: name for role, name in k.items() if role not in ("segment_ids", "positions")}
    arrs = _arrays(batch, k, config)
    lengths = arrs["segment_lengths"].astype(np.int64)
    offsets = arrs["segment_offsets"].astype(np.int64)
    _check_slots(lengths, offsets, arrs["source_index"], arrs["source_start"], config)
    if padding or "segment_ids" in arrs or "positions" in arrs:
        _check_derived(arrs, k, lengths, offsets, config, padding)


def _arrays(batch: dict, k: dict[str, str], config: PackConfig) -> dict[str, np.ndarray]:
    """role -> `[R, ...]` array, after checking keys, shapes and dtypes."""
    L, S = config.seq_len, config.max_segments
    missing = [name for name in k.values() if name not in batch]
    if missing:
        _fail(f"missing keys {missing}; has {sorted(batch)}")
    arrs = {role: np.asarray(batch[name]) for role, name in k.items()}
    single = arrs["values"].ndim == 1
    if single:
        arrs = {role: x[None] for role, x in arrs.items()}
    R = arrs["values"].shape[0]
    for role in ("values", "segment_ids", "positions"):
        if role in arrs and arrs[role].shape != (R, L):
            _fail(f"{k[role]} has shape {arrs[role].shape}, expected {(R, L)}")
    for role in ("segment_lengths", "segment_offsets", "source_index", "source_start"):
        if arrs[role].shape != (R, S):
            _fail(f"{k[role]} has shape {arrs[role].shape}, expected {(R, S)}")
    for role in ("segment_ids", "positions", "segment_lengths", "segment_offsets"):
        if role in arrs and arrs[role].dtype != SEGMENT_DTYPE:
            _fail(f"{k[role]} has dtype {arrs[role].dtype}, expected int32")
    for role in ("source_index", "source_start"):
        if arrs[role].dtype != SOURCE_DTYPE:
            _fail(f"{k[role]} has dtype {arrs[role].dtype}, expected int64")
    if not np.issubdtype(arrs["values"].dtype, np.integer):
        _fail(f"{k['values']} has dtype {arrs['values'].dtype}, expected integer token ids")
    if arrs["values"].dtype.kind == "i" and arrs["values"].size and arrs["values"].min() < 0:
        rc = _first(arrs["values"] < 0)
        _fail(f"row {rc[0]} position {rc[1]}: negative token id {arrs['values'][rc]}")
    return arrs


def _check_slots(lengths: np.ndarray, offsets: np.ndarray, src: np.ndarray,
                 src_start: np.ndarray, config: PackConfig) -> None:
    """Slot order, offsets (range, overlap, alignment, unused slots) and sources; all [R, S]."""
    L, S, a = config.seq_len, config.max_segments, config.alignment
    where = lambda rc: f"row {rc[0]} slot {rc[1]}"  # noqa: E731

    if (lengths < 0).any():
        rc = _first(lengths < 0)
        _fail(f"{where(rc)}: negative length {lengths[rc]}")
    used = lengths > 0
    if S > 1 and (~used[:, :-1] & used[:, 1:]).any():
        rc = _first(~used[:, :-1] & used[:, 1:])
        _fail(f"{where((rc[0], rc[1] + 1))}: used slot after an empty slot; segments go first")
    if ((offsets < 0) | (offsets > L)).any():
        rc = _first((offsets < 0) | (offsets > L))
        _fail(f"{where(rc)}: offset {offsets[rc]} outside [0, {L}]")
    ends = offsets + lengths
    if (ends > L).any():
        rc = _first(ends > L)
        _fail(f"{where(rc)}: segment ends at {ends[rc]} > seq_len {L}")
    if S > 1 and (offsets[:, 1:] < ends[:, :-1]).any():
        rc = _first(offsets[:, 1:] < ends[:, :-1])
        _fail(f"{where((rc[0], rc[1] + 1))}: offset {offsets[rc[0], rc[1] + 1]} overlaps the "
              f"previous segment ending at {ends[rc]}")
    if (used & (offsets % a != 0)).any():
        rc = _first(used & (offsets % a != 0))
        what = f"segment_alignment {a}" if config.context_parallel is None else \
            f"{a} (segment_alignment, 2 x context_parallel={config.context_parallel})"
        _fail(f"{where(rc)}: offset {offsets[rc]} is not a multiple of {what}")
    row_used = np.where(used, ends, 0).max(axis=1)
    bad = ~used & (offsets != row_used[:, None])
    if bad.any():
        rc = _first(bad)
        _fail(f"{where(rc)}: unused slot offset {offsets[rc]} != the row's used length "
              f"{row_used[rc[0]]}")
    bad = (used & (src < 0)) | (~used & (src != -1))
    if bad.any():
        rc = _first(bad)
        _fail(f"{where(rc)}: segment_source_index {src[rc]} (used slots >= 0, unused -1)")
    bad = (src_start < 0) | (~used & (src_start != 0))
    if bad.any():
        rc = _first(bad)
        _fail(f"{where(rc)}: segment_source_start {src_start[rc]} (>= 0, unused 0)")


def _check_derived(arrs: dict[str, np.ndarray], k: dict[str, str], lengths: np.ndarray,
                   offsets: np.ndarray, config: PackConfig, padding: bool) -> None:
    """Segment ids and positions (when the batch holds them) and padding tokens against what
    lengths / offsets give."""
    R, L = arrs["values"].shape
    rows, slots = np.nonzero(lengths > 0)
    starts, ends = offsets[rows, slots], offsets[rows, slots] + lengths[rows, slots]
    want_ids = _runs(rows, starts, ends, slots + 1, R, L)
    checks = [("segment_ids", want_ids)] if "segment_ids" in arrs else []
    if "positions" in arrs:
        seg_start = _runs(rows, starts, ends, starts + 1, R, L) - 1
        checks.append(("positions", np.where(want_ids > 0, np.arange(L)[None, :] - seg_start, 0)))
    for role, want in checks:
        bad = arrs[role] != want
        if bad.any():
            r, p = _first(bad)
            _fail(f"row {r} position {p}: {k[role]} is {arrs[role][r, p]}, expected {want[r, p]} "
                  "from the segment lengths / offsets")
    bad = (want_ids == 0) & (arrs["values"] != config.pad_id) if padding else None
    if bad is not None and bad.any():
        r, p = _first(bad)
        _fail(f"row {r} position {p}: padding holds token {arrs['values'][r, p]}, expected "
              f"pad_id {config.pad_id}")


def _runs(rows: np.ndarray, starts: np.ndarray, ends: np.ndarray, value: np.ndarray, R: int,
          L: int) -> np.ndarray:
    """i64[R, L]: `value[i]` on [starts[i], ends[i]) of row rows[i] (non-empty runs that do not
    overlap), 0 elsewhere: +value at each start, -value at each end, summed along the row (the
    starts are distinct, and so are the ends)."""
    width = L + 1
    delta = np.zeros(R * width, np.int64)
    delta[rows * width + starts] = value
    delta[rows * width + ends] -= value
    return np.cumsum(delta.reshape(R, width), axis=1)[:, :L]


def coverage(ex: np.ndarray, st: np.ndarray, ln: np.ndarray, lengths: np.ndarray,
             times: np.ndarray, config: PackConfig) -> tuple[list[str], dict[str, int]]:
    """Whether pieces (example `ex`, start `st`, length `ln`; the used slots of a corpus's
    rows) tile each example's kept tokens [0, kept) `times[e]` times (once, or as a mixture
    takes it), what is not kept being what `config.overflow` allows. Returns the problems
    (at most 3 of each kind) and the `Counters` values the pieces give. Only the pieces of
    examples cut or taken other than once are sorted (memory: a few bytes per piece)."""
    problems: list[str] = []
    npieces = np.bincount(ex, minlength=lengths.size)
    many = ~((npieces == 1) & (times == 1))[ex]
    for i in np.flatnonzero(~many & (st != 0))[:3]:
        problems.append(f"example {ex[i]}: a piece starts at token {st[i]} where the pieces "
                        "before it end elsewhere (tokens missing or duplicated)")
    # Tokens and pieces of each example, each distinct piece counted once.
    covered = np.zeros(lengths.size, np.int64)
    covered[ex] = ln
    sub = ex[many], st[many], ln[many]
    del many
    found, (dex, dln) = _tiling(*sub, times)
    problems += found
    covered[sub[0]] = 0
    np.add.at(covered, dex, dln)
    np.subtract.at(npieces, sub[0], 1)
    np.add.at(npieces, dex, 1)
    del sub
    missing = np.where(times > 0, lengths - covered, 0)
    L = config.seq_len
    policy = str(config.overflow) if str(config.strategy) != "concat_split" else "split"
    cut = np.flatnonzero(missing != 0)
    lost = {"examples": int(times[cut].sum()), "tokens": int((missing * times)[cut].sum())}
    if policy == "truncate":
        allowed = (lengths > L) & (covered == L)
        want = {f"truncated_{k}": v for k, v in lost.items()}
    elif policy == "drop":
        allowed = (lengths > L) & (covered == 0)
        want = {f"dropped_{k}": v for k, v in lost.items()}
    else:
        allowed = np.zeros(lengths.size, bool)
        want = {}
    for i in cut[~allowed[cut]][:3]:
        problems.append(f"example {i}: {missing[i]} of its {lengths[i]} tokens are not in any "
                        f"row, which overflow={policy!r} does not allow")
    split = npieces > 1
    want.update(split_examples=int(times[split].sum()),
                split_pieces=int((npieces * times)[split].sum()),
                num_examples=int(times.sum()), input_tokens=int((lengths * times).sum()),
                empty_examples=int(times[lengths == 0].sum()))
    return problems, want


def _tiling(ex: np.ndarray, st: np.ndarray, ln: np.ndarray, times: np.ndarray
            ) -> tuple[list[str], tuple[np.ndarray, np.ndarray]]:
    """The problems of some examples' pieces (each distinct piece must come `times[e]` times,
    the distinct pieces must tile from token 0), and the distinct pieces' (example, length)."""
    problems = []
    order = np.lexsort((ln, st, ex))
    ex, st, ln = ex[order], st[order], ln[order]
    new = np.ones(ex.size, bool)
    new[1:] = (ex[1:] != ex[:-1]) | (st[1:] != st[:-1]) | (ln[1:] != ln[:-1])
    count = np.diff(np.append(np.flatnonzero(new), ex.size))
    ex, st, ln = ex[new], st[new], ln[new]  # each piece once, `count` times
    for i in np.flatnonzero(count != times[ex])[:3]:
        problems.append(f"example {ex[i]}: its tokens [{st[i]}, {st[i] + ln[i]}) are in "
                        f"{count[i]} segment(s), the run takes the example {times[ex[i]]} "
                        "time(s) (tokens missing or duplicated)")
    first = np.ones(ex.size, bool)
    first[1:] = ex[1:] != ex[:-1]
    contiguous = ~first
    contiguous[1:] &= st[1:] != st[:-1] + ln[:-1]
    for i in np.union1d(np.flatnonzero(first & (st != 0)), np.flatnonzero(contiguous))[:3]:
        problems.append(f"example {ex[i]}: a piece starts at token {st[i]} where the pieces "
                        "before it end elsewhere (tokens missing or duplicated)")
    return problems, (ex, ln)
