"""Encodes one row (name -> numpy array) as a self-describing binary record; decodes it zero-copy.

The offline writer stores each packed row as one ArrayRecord record in this encoding, and the
ArrayRecord sources decode records back to the contract keys with `np.frombuffer` views, so a
decoded row costs no token copies.

Format ``SQP1`` (all integers little-endian, every array's data 8-byte aligned from the record
start)::

    offset  size  field
    0       4     magic b"SQP1"
    4       4     u32 number of arrays n
    then n entries, each:
            2     u16 name length   (UTF-8 bytes, 1..65535)
            1     u8  dtype length  (numpy `dtype.str`, e.g. b"<i4", b"|u1")
            1     u8  ndim          (0..32)
            ...   name bytes, then dtype bytes, then zero padding to a multiple of 8
            8*ndim  i64 shape
            8     u64 data byte length (== prod(shape) * itemsize)
            ...   data, then zero padding to a multiple of 8

Worked example: ``{"tokens": np.array([7, 8], np.int32)}`` encodes to 48 bytes::

    0   b"SQP1" 01000000                       magic, 1 array
    8   0600 03 01 b"tokens" b"<i4" 000000     name/dtype lengths, ndim 1, names, pad to 24
    24  0200000000000000 0800000000000000      shape (2,), 8 data bytes
    40  07000000 08000000                      data (already a multiple of 8)

The offline writer leaves out each packed feature's ``f_segment_ids`` and ``f_positions``: they
are determined by ``f_segment_lengths`` / ``f_segment_offsets`` and would be two thirds of the
bytes. `decode_row` rebuilds them (`packer.contract.restore_derived`), so readers always get the
full contract
row; every stored array is still a zero-copy view.

Only bool, integer and floating dtypes are allowed (no objects). The record must end exactly
after the last entry's padding; anything else is a corrupt record and raises ValueError (the
caller adds the file name and record index).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence

import numpy as np

from seqpack.packer.contract import restore_derived

MAGIC = b"SQP1"
_HEAD = struct.Struct("<4sI")
_ENTRY = struct.Struct("<HBB")
_U64 = struct.Struct("<Q")
_ALLOWED_KINDS = "biuf"


def _pad(n: int) -> int:
    return -n % 8


def encode_row(row: Mapping[str, np.ndarray]) -> bytes:
    """Encodes name -> array (any shape, numeric dtype) as one SQP1 record."""
    parts = [_HEAD.pack(MAGIC, len(row))]
    size = _HEAD.size
    for name, value in row.items():
        arr = np.asarray(value)
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")  # (np.ascontiguousarray would turn 0-d into 1-d)
        if not isinstance(name, str) or not name:
            raise ValueError(f"{name=} must be a non-empty string key")
        if arr.dtype.kind not in _ALLOWED_KINDS:
            raise ValueError(
                f"row[{name!r}] has dtype {arr.dtype}; only bool/int/float arrays can be "
                "encoded, convert it with np.asarray(..., np.int32)"
            )
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        name_b = name.encode("utf-8")
        dtype_b = arr.dtype.str.encode("ascii")
        if len(name_b) > 0xFFFF or arr.ndim > 32:
            raise ValueError(f"row[{name!r}]: name too long or ndim={arr.ndim} > 32")
        head = _ENTRY.pack(len(name_b), len(dtype_b), arr.ndim) + name_b + dtype_b
        head += b"\0" * _pad(size + len(head))
        head += struct.pack(f"<{arr.ndim}q", *arr.shape) + _U64.pack(arr.nbytes)
        data = arr.tobytes()
        parts += [head, data, b"\0" * _pad(len(data))]
        size += len(head) + len(data) + _pad(len(data))
    return b"".join(parts)


def decode_row(buf: bytes | bytearray | memoryview, *, restore: bool = True
               ) -> dict[str, np.ndarray]:
    """Decodes an SQP1 record into name -> read-only array views of `buf` (zero copy).

    With `restore` (the default), packed features stored without their segment ids / positions
    get them rebuilt from the segment lengths and offsets.
    """
    mv = memoryview(buf).cast("B")
    total = mv.nbytes
    if total < _HEAD.size:
        raise ValueError(f"record is {total} bytes, shorter than the 8-byte SQP1 header")
    magic, count = _HEAD.unpack_from(mv, 0)
    if magic != MAGIC:
        raise ValueError(f"record starts with {bytes(magic)!r}, not {MAGIC!r}: not an SQP1 row")
    pos = _HEAD.size
    out: dict[str, np.ndarray] = {}
    for i in range(count):
        if pos + _ENTRY.size > total:
            raise ValueError(f"record truncated in the header of array {i} of {count}")
        name_len, dtype_len, ndim = _ENTRY.unpack_from(mv, pos)
        pos += _ENTRY.size
        end = pos + name_len + dtype_len
        if end > total:
            raise ValueError(f"record truncated in the name of array {i} of {count}")
        try:
            name = bytes(mv[pos : pos + name_len]).decode("utf-8")
            dtype = np.dtype(bytes(mv[pos + name_len : end]).decode("ascii"))
        except (UnicodeDecodeError, TypeError) as e:
            raise ValueError(f"record has a corrupt name/dtype in array {i}: {e}") from None
        if dtype.kind not in _ALLOWED_KINDS or dtype.hasobject:
            raise ValueError(f"record array {name!r} has unsupported dtype {dtype}")
        pos = end + _pad(end)
        shape_end = pos + 8 * ndim + 8
        if shape_end > total:
            raise ValueError(f"record truncated in the shape of array {name!r}")
        shape = struct.unpack_from(f"<{ndim}q", mv, pos)
        (nbytes,) = _U64.unpack_from(mv, pos + 8 * ndim)
        pos = shape_end
        if any(d < 0 for d in shape) or nbytes != int(np.prod(shape)) * dtype.itemsize:
            raise ValueError(
                f"record array {name!r}: {nbytes} data bytes do not match shape {shape} "
                f"of {dtype}"
            )
        if pos + nbytes > total:
            raise ValueError(
                f"record truncated in the data of array {name!r} "
                f"({total - pos} of {nbytes} bytes present)"
            )
        if name in out:
            raise ValueError(f"record holds array {name!r} twice")
        count_items = nbytes // dtype.itemsize if dtype.itemsize else 0
        out[name] = np.frombuffer(mv, dtype, count_items, pos).reshape(shape)
        pos += nbytes + _pad(nbytes)
    if pos != total:
        raise ValueError(f"record has {total - pos} trailing bytes after {count} arrays")
    return restore_derived(out) if restore else out


def decode_batch(raws: Sequence[bytes]) -> dict[str, np.ndarray]:
    """Records of one layout (the same names, dtypes and shapes: every row of a packed run)
    stacked into name -> `[R, ...]` read-only arrays in one pass (views of one buffer holding
    the records back to back), without restoring derived keys.

    The first record is decoded in full (`decode_row`); every other must have its size and all
    its header bytes (everything outside the arrays' data), so each array is a column of one
    `[R, record size]` byte matrix. Records of other layouts are decoded one by one. ValueError
    as `decode_row` for a corrupt record (the caller names the file and record).
    """
    if not raws:
        return {}
    first = decode_row(raws[0], restore=False)
    size = len(raws[0])
    if any(len(r) != size for r in raws):
        return _stack([decode_row(r, restore=False) for r in raws])
    matrix = np.frombuffer(b"".join(raws), np.uint8).reshape(len(raws), size)
    base = np.frombuffer(raws[0], np.uint8).ctypes.data
    header = np.ones(size, bool)
    spans = {}
    for name, view in first.items():
        start = view.ctypes.data - base if view.nbytes else 0
        header[start : start + view.nbytes] = False
        spans[name] = (start, view)
    if not (matrix[:, header] == matrix[0, header]).all():
        return _stack([decode_row(r, restore=False) for r in raws])
    # Views of the byte matrix: a column slice is contiguous within each row (every array's data
    # is 8-byte aligned in its record), so it is viewed in its dtype without a copy.
    return {name: matrix[:, start : start + view.nbytes].view(view.dtype).reshape(
        (len(raws), *view.shape)) for name, (start, view) in spans.items()}


def _stack(rows: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    keys = list(rows[0])
    if any(list(r) != keys for r in rows):
        raise ValueError(f"records hold different arrays ({keys} and others)")
    return {k: np.stack([r[k] for r in rows]) for k in keys}
