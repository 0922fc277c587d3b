"""Checks a packed batch against the row contract (raises ValueError naming row and slot), and
the pieces of many rows against the examples they came from (`Coverage`)."""

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


class Coverage:
    """Whether pieces (example `ex`, start `st`, length `ln`: the used slots of a corpus's rows,
    added shard by shard) tile each example's kept tokens [0, kept) `times[e]` times (once, or
    as a mixture takes it), what is not kept being what the overflow policy allows.

    Held per example, not per piece (about 20 bytes an example): the tokens covered, the
    pieces, and a fingerprint, the sum over its pieces of mark(e, start) - mark(e, end) mod
    2**64 (`_marks`: 64-bit hashes). Pieces that are t tilings of [0, c) sum to
    t * (mark(e, 0) - mark(e, c)), their ends telescoping; a gap, an overlap or a piece too
    many or too few leaves other marks in the sum, which then differs but by chance (2**-64 an
    example). No sort: the pieces of a shard are added and dropped. `first`: the number of
    the first example held (pieces and problems name examples by their corpus number)."""

    def __init__(self, lengths: np.ndarray, times: np.ndarray, first: int = 0):
        self.lengths, self.times, self.first = lengths, times, first
        self.covered = np.zeros(lengths.size, np.int64)
        self.pieces = np.zeros(lengths.size, np.int32)
        self.sums = np.zeros(lengths.size, np.uint64)
        self.longest = 0

    def add(self, ex: np.ndarray, st: np.ndarray, ln: np.ndarray) -> None:
        if not ex.size:
            return
        at = ex.astype(np.intp) - self.first
        np.add.at(self.covered, at, ln)
        np.add.at(self.pieces, at, 1)
        np.add.at(self.sums, at, _marks(ex, st) - _marks(ex, st.astype(np.int64) + ln))
        self.longest = max(self.longest, int(ln.max()))

    def check(self, config: PackConfig, chunk: int = 1 << 20
              ) -> tuple[list[str], dict[str, int]]:
        """The problems (at most 3 of each kind) and the `Counters` values the pieces give;
        examples a chunk at a time, so numpy's temporaries stay small."""
        found, counts, want = self.findings(config, chunk)
        return coverage_problems(found, counts), want

    def findings(self, config: PackConfig, chunk: int = 1 << 20
                 ) -> tuple[dict[str, list[str]], dict[str, int], dict[str, int]]:
        """(the first 3 problems of each kind, how many of each kind, the `Counters` values):
        what `check` reports, before `coverage_problems` words it (parts of a corpus checked
        apart, e.g. input by input, merge by kind)."""
        found: dict[str, list[str]] = {"tiling": [], "kept": []}
        counts = {"tiling": 0, "kept": 0}
        want: dict[str, int] = {}
        for lo in range(0, max(self.lengths.size, 1), chunk):
            for key, value in self._check(slice(lo, lo + chunk), config, found, counts).items():
                want[key] = want.get(key, 0) + value
        return found, counts, want

    def _check(self, part: slice, config: PackConfig, found: dict[str, list[str]],
               counts: dict[str, int]) -> dict[str, int]:
        lengths, times = self.lengths[part].astype(np.int64), self.times[part].astype(np.int64)
        covered, npieces = self.covered[part], self.pieces[part].astype(np.int64)
        first = self.first + part.start
        taken = np.maximum(times, 1)
        kept = covered // taken  # each take's tokens, where the pieces are whole takes
        ids = np.arange(first, first + lengths.size, dtype=np.int64)
        whole = times.astype(np.uint64) * (_marks(ids, 0) - _marks(ids, kept))
        bad = (self.sums[part] != whole) | (covered % taken != 0) | (covered > times * lengths)
        counts["tiling"] += int(np.count_nonzero(bad))
        for i in np.flatnonzero(bad)[: 3 - len(found["tiling"])]:
            found["tiling"].append(_tiling_problem(first + int(i), int(npieces[i]),
                                                   int(covered[i]), int(times[i]),
                                                   int(lengths[i])))
        missing = np.where(times > 0, np.maximum(lengths - kept, 0), 0)
        L, policy = config.seq_len, _policy(config)
        cut = np.flatnonzero(missing != 0)
        lost = {"examples": int(times[cut].sum()), "tokens": int((missing * times)[cut].sum())}
        if policy == "truncate":
            allowed = (lengths > L) & (kept == L)
        elif policy == "drop":
            allowed = (lengths > L) & (kept == 0)
        else:
            allowed = np.zeros(lengths.size, bool)
        counts["kept"] += int(np.count_nonzero(~allowed[cut]))
        for i in cut[~allowed[cut]][: 3 - len(found["kept"])]:
            found["kept"].append(f"example {first + int(i)}: {int(missing[i])} of its "
                                 f"{int(lengths[i])} tokens are not in any row, which "
                                 f"overflow={policy!r} does not allow")
        split = npieces > times  # some take of it in more than one piece
        name = {"truncate": "truncated", "drop": "dropped"}.get(policy)
        want = {f"{name}_{k}": v for k, v in lost.items()} if name else {}
        want.update(split_examples=int(times[split].sum()),
                    split_pieces=int(npieces[split].sum()),
                    num_examples=int(times.sum()), input_tokens=int((lengths * times).sum()),
                    empty_examples=int(times[lengths == 0].sum()))
        return want


def coverage_problems(found: dict[str, list[str]], counts: dict[str, int]) -> list[str]:
    """`Coverage.findings`' problems as lines, with "N more" where more were counted."""
    problems = []
    for kind, what in (("tiling", "whose pieces do not tile"), ("kept", "with tokens in no row")):
        problems += found[kind]
        if counts[kind] > len(found[kind]):
            problems.append(f"{counts[kind] - len(found[kind])} more example(s) {what} "
                            f"(the first {len(found[kind])} named)")
    return problems


def _policy(config: PackConfig) -> str:
    return str(config.overflow) if str(config.strategy) != "concat_split" else "split"


def _tiling_problem(e: int, pieces: int, covered: int, times: int, length: int) -> str:
    held = f"example {e}: its {pieces} piece(s) hold {covered} tokens"
    if covered > times * length:
        return (f"{held}, more than the {times * length} the run takes (its {length} tokens "
                f"{times} time(s)): tokens duplicated")
    if covered % times:
        return (f"{held}, not a multiple of the {times} times the run takes it (tokens missing "
                "or duplicated)")
    tile = "do not tile" if times == 1 else f"are not {times} tilings of"
    return (f"{held} but {tile} its tokens [0, {covered // times}) (a gap or an overlap: "
            "tokens missing or duplicated)")


def _marks(ex: np.ndarray, at: np.ndarray | int) -> np.ndarray:
    """A 64-bit hash of each (example, token position) (splitmix64's finalizer)."""
    with np.errstate(over="ignore"):
        x = (np.asarray(ex).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
             + np.asarray(at).astype(np.uint64) + np.uint64(0x632BE59BD9B4E019))
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))
