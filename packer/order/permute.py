"""A seeded pseudo-random bijection of [0, n), evaluated per index (no table): Feistel network.

`Permutation(n, seed)` maps i -> p(i) and back in O(1) memory, vectorised over index arrays, so
a shard writer can ask where output rows [a, b) come from without building the whole
permutation. Construction: a balanced Feistel network of `_ROUNDS` rounds over 2h-bit words
(2^(2h) >= n, so the domain is below 4n), each round's function a splitmix64 hash of the right
half and a round key derived from (seed, salt); values that land at or past n are put through
the network again (cycle walking) until they fall inside: since the network permutes the whole
domain, this permutes [0, n).

Worked example (n = 10, seed 0; 2h = 4 bits: a domain of 16, values 10..15 walked past)::

    i:         0  1  2  3  4  5  6  7  8  9
    p(i):      2  3  4  8  5  1  7  9  6  0
    p^-1:      the rounds backwards, walking the same way: p^-1(8) = 3
"""

from __future__ import annotations

import numpy as np

_ROUNDS = 6
_M64 = (1 << 64) - 1


def _splitmix(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on u64 arrays (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class Permutation:
    """p: [0, n) -> [0, n), a bijection fixed by (n, seed, salt); see the module docstring."""

    def __init__(self, n: int, seed: int, salt: int = 0) -> None:
        if n < 0:
            raise ValueError(f"n={n} must be >= 0")
        self.n = int(n)
        bits = max(2, (self.n - 1).bit_length())
        bits += bits % 2
        self._half = np.uint64(bits // 2)
        self._mask = np.uint64((1 << (bits // 2)) - 1)
        key = _splitmix((int(seed) & _M64) ^ _splitmix(int(salt) & _M64))
        self._keys = []
        for _ in range(_ROUNDS):
            key = _splitmix(key)
            self._keys.append(np.uint64(key))

    def _rounds(self, x: np.ndarray, inverse: bool) -> np.ndarray:
        left, right = x >> self._half, x & self._mask
        if not inverse:
            for k in self._keys:
                left, right = right, left ^ (_mix(right ^ k) & self._mask)
        else:
            for k in reversed(self._keys):
                left, right = right ^ (_mix(left ^ k) & self._mask), left
        return (left << self._half) | right

    def _walk(self, idx: object, inverse: bool) -> np.ndarray:
        x = np.asarray(idx, np.int64)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise ValueError(f"indices must lie in [0, {self.n}), got "
                             f"[{int(x.min())}, {int(x.max())}]")
        y = self._rounds(x.astype(np.uint64), inverse)
        out = y.astype(np.int64)
        bad = np.flatnonzero(out >= self.n)
        while bad.size:  # cycle walking: terminates, the network permutes the whole domain
            y = self._rounds(out[bad].astype(np.uint64), inverse)
            out[bad] = y.astype(np.int64)
            bad = bad[out[bad] >= self.n]
        return out

    def __call__(self, idx: object) -> np.ndarray:
        """p(i) for every i of `idx` (i64 array)."""
        return self._walk(idx, inverse=False)

    def inverse(self, idx: object) -> np.ndarray:
        """p^-1(j) for every j of `idx`."""
        return self._walk(idx, inverse=True)
