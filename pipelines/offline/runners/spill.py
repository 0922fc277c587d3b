"""The offline writer's token spill: every input's tokens, as read, in raw files on local disk.

Pass 1 of `seqpack pack` reads each input once, in order, and appends its tokens to raw files
(`SpillWriter`, one file per input and token dtype: a run); the plan is then made on the lengths
alone. Pass 2 reads each shard's pieces straight from those files into the shard's rows
(`SpillReader.read_into`, one positioned read per piece, from the page cache while the spill
fits in it), so no process ever holds more than one shard's tokens. Ids are spilled in the
narrowest unsigned dtype that holds them (2 bytes a token for a vocabulary under 65536, whatever
the input's type); the spill lives in the output directory's ``spill.tmp/``, removed when the
run ends. A spill the disk cannot hold fails the run with `RunFailed` naming the file.

Positions are global: token `p` of the corpus (inputs back to back, in the order given) lives in
the run whose [start, start + num_tokens) holds `p`; `ExampleStarts` gives each example's first
position from the lengths, at half a byte an example beyond them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import BinaryIO

import numpy as np

from seqpack.pipelines.errors import RunFailed


@dataclasses.dataclass(frozen=True)
class Run:
    """One spill file: `num_tokens` ids of one dtype, back to back."""

    path: str
    dtype: str  # numpy dtype string, e.g. "<u2"
    num_tokens: int


class SpillWriter:
    """Appends one input's tokens (or one extra column's values: `signed`) to run files named
    ``{prefix}-{k}.bin``."""

    def __init__(self, directory: str, prefix: str, *, signed: bool = False):
        self.directory, self.prefix, self.signed = directory, prefix, signed
        self.runs: list[Run] = []
        self._file: BinaryIO | None = None

    def __call__(self, tokens: np.ndarray) -> None:
        if not tokens.size:
            return
        # The narrowest dtype that holds the values (unsigned for token ids, >= 0), never
        # narrower than the current run's: a vocabulary under 65536 spills 2 bytes a token
        # whatever its Parquet type, labels in [-100, 30000] 2 bytes too. The rows' dtype is
        # decided elsewhere; the values are the same.
        need = _narrowest(int(tokens.min()) if self.signed else 0, int(tokens.max()))
        if self.runs and np.dtype(self.runs[-1].dtype).itemsize >= need.itemsize:
            need = np.dtype(self.runs[-1].dtype)
        if need.itemsize < tokens.dtype.itemsize:
            tokens = tokens.astype(need)
        dtype = tokens.dtype.str
        try:
            if not self.runs or self.runs[-1].dtype != dtype:
                self._close_file()
                path = os.path.join(self.directory, f"{self.prefix}-{len(self.runs):04d}.bin")
                self.runs.append(Run(path, dtype, 0))
                self._file = open(path, "wb")
            assert self._file is not None
            self._file.write(np.ascontiguousarray(tokens).data)
        except OSError as e:
            raise RunFailed.of(e, self.runs[-1].path, "cannot write the spill of the inputs' "
                               "tokens") from None
        last = self.runs[-1]
        self.runs[-1] = dataclasses.replace(last, num_tokens=last.num_tokens + int(tokens.size))

    def close(self) -> list[Run]:
        """Closes the current file; returns the runs written, in order."""
        self._close_file()
        return self.runs

    def _close_file(self) -> None:
        if self._file is not None:
            f, self._file = self._file, None
            try:
                f.close()  # flushes: a full disk may show only here
            except OSError as e:
                raise RunFailed.of(e, f.name, "cannot write the spill of the inputs' tokens") \
                    from None


def _narrowest(lo: int, hi: int) -> np.dtype:
    """The narrowest integer dtype holding [lo, hi]: unsigned when lo >= 0, else signed."""
    kinds = (np.uint8, np.uint16, np.uint32, np.uint64) if lo >= 0 else \
        (np.int8, np.int16, np.int32, np.int64)
    return next(np.dtype(t) for t in kinds if np.iinfo(t).min <= lo and hi <= np.iinfo(t).max)


class SpillReader:
    """Gathers pieces of the corpus (global token positions) from the runs of every input."""

    def __init__(self, runs: list[Run]):
        self.runs = runs
        sizes = np.array([r.num_tokens for r in runs], np.int64)
        self.starts = np.concatenate(([0], np.cumsum(sizes)))

    def read_into(self, out: np.ndarray, dst: np.ndarray, src: np.ndarray,
                  length: np.ndarray) -> None:
        """Reads pieces [src[i], src[i] + length[i]) of the corpus into out[dst[i]:][:length[i]]
        (`out` 1-D; cast to its dtype), one positioned read per piece: no memory map, whose
        fault-around would put 64 KiB of page cache into this process's resident set per piece.

        A piece lies inside one example, so inside one run."""
        src = np.asarray(src, np.int64)
        length = np.asarray(length, np.int64)
        keep = length > 0
        src, dst, length = src[keep], np.asarray(dst, np.int64)[keep], length[keep]
        which = np.searchsorted(self.starts, src, side="right") - 1
        for r in np.unique(which).tolist():
            run = self.runs[r]
            dtype = np.dtype(run.dtype)
            mine = np.flatnonzero(which == r)
            pos = ((src[mine] - self.starts[r]) * dtype.itemsize).tolist()
            n = length[mine]
            direct = dtype == out.dtype
            # Straight into the rows, or into one buffer of the run's dtype, widened at once.
            buf = out if direct else np.empty(int(n.sum()), dtype)
            at = dst[mine] if direct else np.cumsum(n) - n
            fd = os.open(run.path, os.O_RDONLY)
            try:
                for a, m, p in zip(at.tolist(), n.tolist(), pos):
                    view = buf[a : a + m].data
                    if os.preadv(fd, [view], p) != view.nbytes:
                        raise OSError(f"{run.path}: short read at byte {p}")
            finally:
                os.close(fd)
            if not direct:
                for d, a, m in zip(dst[mine].tolist(), at.tolist(), n.tolist()):
                    out[d : d + m] = buf[a : a + m]


@dataclasses.dataclass(frozen=True)
class ExampleStarts:
    """Where each example's tokens start in the spill: the lengths (4 bytes an example while
    they fit in i32) and every `GROUP`-th example's start (half a byte an example), instead of
    an i64 start per example; a query adds up at most `GROUP - 1` lengths per example asked.

        lengths  3 0 5 | 2 ...       GROUP = 3 (16 in use)
        every    0     | 8 ...       start of example 4 = every[1] + lengths[3] = 10
    """

    GROUP = 16

    lengths: np.ndarray  # i32/i64[n]
    every: np.ndarray  # i64[ceil(n / GROUP) + 1]: start of examples 0, GROUP, 2 * GROUP, ...

    @classmethod
    def of(cls, lengths: np.ndarray) -> ExampleStarts:
        sums = np.add.reduceat(lengths, np.arange(0, lengths.size, cls.GROUP), dtype=np.int64) \
            if lengths.size else np.zeros(0, np.int64)
        every = np.zeros(sums.size + 1, np.int64)
        np.cumsum(sums, out=every[1:])
        return cls(lengths, every)

    def __call__(self, example: np.ndarray) -> np.ndarray:
        """i64: the first token position of each of these examples."""
        example = np.asarray(example, np.int64)
        group, within = np.divmod(example, self.GROUP)
        out = self.every[group]
        first = group * self.GROUP
        for j in range(self.GROUP - 1):  # lengths[first .. example - 1]
            more = np.flatnonzero(within > j)
            if not more.size:
                break
            out[more] += self.lengths[first[more] + j]
        return out
