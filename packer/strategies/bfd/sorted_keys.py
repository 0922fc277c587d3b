"""Sorted lists of distinct ints: the open rows' keys of the two-pool pass, flat or in blocks.

A flat Python list pays for every insert and delete with a move of the list's tail, so a plan
of many rows costs the square of its rows. `BlockKeys` keeps the keys in sorted blocks of at
most `2 * _BLOCK`, each block's last key in `maxes`: an insert or a delete moves one block, found
by a bisection of `maxes`. Below a few thousand keys the flat list is the faster, so
`keys_for(rows)` picks by the rows a plan expects (`_BLOCK_ROWS`).

Both classes have one interface, called once per run of pieces, not once per key: `find` the
first key >= x, `iter_from` there, `delete_from` the first m of those (best fit removes the rows
it has just filled), `pop_ge` (the two at once, for a run of one piece), `add_many` /
`remove_many` for the rows refiled.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Iterator
from itertools import chain, islice

_BLOCK = 512  # keys a block is cut to (blocks hold 1 to 2 * _BLOCK)
_SPLIT = 2 * _BLOCK
_BLOCK_ROWS = 4096  # plans expecting at least this many rows keep their keys in blocks


class FlatKeys:
    """Sorted distinct ints in one list (module docstring)."""

    __slots__ = ("keys",)

    def __init__(self, keys: Iterable[int] = ()) -> None:
        """`keys`: sorted, distinct."""
        self.keys = list(keys)

    def __len__(self) -> int:
        return len(self.keys)

    def tolist(self) -> list[int]:
        return list(self.keys)

    def add(self, key: int) -> None:
        insort(self.keys, key)

    def add_many(self, keys: list[int]) -> None:
        flat = self.keys
        for key in keys:
            insort(flat, key)

    def add_run(self, keys: list[int]) -> None:
        """Inserts `keys` (sorted, none present, no present key between the first and last)."""
        at = bisect_left(self.keys, keys[0])
        self.keys[at:at] = keys

    def remove_many(self, keys: list[int]) -> None:
        flat = self.keys
        for key in keys:
            del flat[bisect_left(flat, key)]

    def find(self, x: int) -> tuple[int, int] | None:
        """Where the smallest key >= x is (for the methods below), or None if there is none."""
        k = bisect_left(self.keys, x)
        return None if k == len(self.keys) else (0, k)

    def iter_from(self, at: tuple[int, int]) -> Iterator[int]:
        """The keys from `at` (`find`) on, in order."""
        return islice(self.keys, at[1], None)

    def pop_at(self, at: tuple[int, int]) -> int:
        """Deletes and returns the key at `at`."""
        return self.keys.pop(at[1])

    def pop_ge(self, x: int) -> int | None:
        """Deletes and returns the smallest key >= x (None if there is none)."""
        keys = self.keys
        k = bisect_left(keys, x)
        return None if k == len(keys) else keys.pop(k)

    def delete_from(self, at: tuple[int, int], m: int) -> None:
        """Deletes the m keys from `at` on."""
        del self.keys[at[1] : at[1] + m]


class BlockKeys:
    """Sorted distinct ints in blocks (module docstring)."""

    __slots__ = ("blocks", "maxes")

    def __init__(self, keys: Iterable[int] = ()) -> None:
        """`keys`: sorted, distinct."""
        flat = list(keys)
        self.blocks = [flat[k : k + _BLOCK] for k in range(0, len(flat), _BLOCK)]
        self.maxes = [block[-1] for block in self.blocks]

    def __len__(self) -> int:
        return sum(map(len, self.blocks))

    def tolist(self) -> list[int]:
        return list(chain.from_iterable(self.blocks))

    def _split(self, b: int) -> None:
        """Cuts block b into blocks of `_BLOCK` once it holds more than twice that."""
        block = self.blocks[b]
        if len(block) > _SPLIT:
            parts = [block[k : k + _BLOCK] for k in range(0, len(block), _BLOCK)]
            self.blocks[b : b + 1] = parts
            self.maxes[b : b + 1] = [part[-1] for part in parts]

    def add(self, key: int) -> None:
        """Inserts `key` (not present)."""
        blocks, maxes = self.blocks, self.maxes
        b = bisect_left(maxes, key)
        if b < len(maxes):
            insort(blocks[b], key)
        elif maxes:  # past every key: the end of the last block
            b -= 1
            blocks[b].append(key)
            maxes[b] = key
        else:
            blocks.append([key])
            maxes.append(key)
            return
        if len(blocks[b]) > _SPLIT:
            self._split(b)

    def add_many(self, keys: list[int]) -> None:
        blocks, maxes = self.blocks, self.maxes
        for key in keys:
            b = bisect_left(maxes, key)
            if b < len(maxes) and len(blocks[b]) < _SPLIT:
                insort(blocks[b], key)  # the common case of `add`, inline
            else:
                self.add(key)

    def add_run(self, keys: list[int]) -> None:
        """Inserts `keys` (sorted, none present, no present key between the first and last)."""
        blocks, maxes = self.blocks, self.maxes
        b = bisect_left(maxes, keys[0])
        if b == len(maxes):
            if not maxes:
                blocks.append([])
                maxes.append(keys[-1])
            b = len(maxes) - 1
        block = blocks[b]
        at = bisect_left(block, keys[0])
        block[at:at] = keys
        maxes[b] = block[-1]
        self._split(b)

    def remove_many(self, keys: list[int]) -> None:
        blocks, maxes = self.blocks, self.maxes
        for key in keys:
            b = bisect_left(maxes, key)
            block = blocks[b]
            if len(block) > 1:
                del block[bisect_left(block, key)]
                maxes[b] = block[-1]
            else:
                del blocks[b], maxes[b]

    def find(self, x: int) -> tuple[int, int] | None:
        """Where the smallest key >= x is (block, offset), or None if there is none."""
        b = bisect_left(self.maxes, x)
        if b == len(self.maxes):
            return None
        return b, bisect_left(self.blocks[b], x)

    def iter_from(self, at: tuple[int, int]) -> Iterator[int]:
        """The keys from `at` (`find`) on, in order."""
        b, off = at
        blocks = self.blocks
        return chain(islice(blocks[b], off, None), chain.from_iterable(islice(blocks, b + 1, None)))

    def pop_at(self, at: tuple[int, int]) -> int:
        """Deletes and returns the key at `at`."""
        b, off = at
        block = self.blocks[b]
        key = block.pop(off)
        if block:
            self.maxes[b] = block[-1]
        else:
            del self.blocks[b], self.maxes[b]
        return key

    def pop_ge(self, x: int) -> int | None:
        """Deletes and returns the smallest key >= x (None if there is none)."""
        at = self.find(x)
        return None if at is None else self.pop_at(at)

    def delete_from(self, at: tuple[int, int], m: int) -> None:
        """Deletes the m keys from `at` on."""
        b, off = at
        blocks, maxes = self.blocks, self.maxes
        while m:
            block = blocks[b]
            k = min(m, len(block) - off)
            del block[off : off + k]
            m -= k
            if block:
                maxes[b] = block[-1]
                b += 1
            else:
                del blocks[b], maxes[b]
            off = 0


Keys = FlatKeys | BlockKeys


def keys_for(rows: int) -> type[FlatKeys] | type[BlockKeys]:
    """The class for the pools of a plan expecting `rows` rows."""
    return BlockKeys if rows >= _BLOCK_ROWS else FlatKeys
