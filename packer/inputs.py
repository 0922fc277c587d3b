"""Checks and normalises user input (lengths, flat values + offsets, lists of sequences).

The error policy of seqpack: bad data raises `InputError` (a ValueError) whose message names
where the bad value is (file and line / record where known, else the example index); a bad
argument raises a plain ValueError naming the argument, its value and the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np


class InputError(ValueError):
    """Bad input data: the message names the file and line / record (or the example)."""


def check_count(name: str, value: object, low: int = 0) -> int:
    """`value` as an int; ValueError naming the argument `name` unless it is an int (a Python
    or numpy integer: not a bool, nor a float however whole, nor a string) >= `low`."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"{name}={value!r} must be an int >= {low}")
    return int(value)


def check_lengths(lengths: object, *, first: int = 0) -> np.ndarray:
    """Returns `lengths` as i64[n]; raises ValueError for anything that is not n >= 0 integers.

    `first`: the index errors give `lengths[0]` (a block of a longer array)."""
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {arr.shape}; pass one length per example")
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"lengths must be integers, got dtype {arr.dtype}; cast with .astype(int)")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) > 2**63 - 1:
        i = int(np.argmax(arr > 2**63 - 1))
        raise InputError(f"lengths[{first + i}]={int(arr[i])} is past int64")
    arr = arr.astype(np.int64, copy=False)
    bad = np.flatnonzero(arr < 0)
    if bad.size:
        i = int(bad[0])
        raise InputError(f"lengths[{first + i}]={int(arr[i])} must be >= 0")
    return arr


def _id_array(values: object, name: str) -> np.ndarray:
    """`values` as an array, if it is 1-D and (unless empty) of an integer dtype."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D token ids, got shape {arr.shape}; flatten it first")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"{name} must hold integer token ids, got dtype {arr.dtype}; "
            "tokenize first or cast with .astype(np.int32)"
        )
    return arr


def check_values(values: object, *, name: str = "values") -> np.ndarray:
    """Returns `values` as a 1-D integer array of non-negative token ids (dtype kept)."""
    arr = _id_array(values, name)
    if arr.size == 0 and not np.issubdtype(arr.dtype, np.integer):
        arr = arr.astype(np.int32)
    if arr.size and np.issubdtype(arr.dtype, np.signedinteger):
        lo = int(arr.min())
        if lo < 0:
            i = int(np.argmax(arr < 0))
            raise InputError(f"{name}[{i}]={int(arr[i])} is a negative token id; ids must be >= 0")
    return arr


def check_offsets(offsets: object, num_values: int) -> np.ndarray:
    """Returns example offsets as i64[n + 1] (Arrow list layout) after checking them."""
    arr = np.asarray(offsets)
    if arr.ndim != 1 or arr.size < 1:
        raise ValueError(
            f"offsets must be 1-D with n + 1 entries (Arrow list layout), got shape {arr.shape}"
        )
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"offsets must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr[0] < 0:
        raise ValueError(f"offsets[0]={int(arr[0])} must be >= 0")
    steps = np.diff(arr)
    bad = np.flatnonzero(steps < 0)
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"offsets must be non-decreasing: offsets[{i}]={int(arr[i])} > "
            f"offsets[{i + 1}]={int(arr[i + 1])}"
        )
    if arr[-1] > num_values:
        raise ValueError(
            f"offsets[-1]={int(arr[-1])} runs past the {num_values} values; "
            "offsets must index into values"
        )
    return arr


def ragged_from_sequences(sequences: Sequence[object]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenates a list of 1-D integer arrays into (values, offsets)."""
    arrays = [_id_array(seq, f"sequences[{i}]") for i, seq in enumerate(sequences)]
    lengths = np.fromiter((a.size for a in arrays), np.int64, len(arrays))
    offsets = np.zeros(len(arrays) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    nonempty = [a for a in arrays if a.size]
    if nonempty:
        dtype = common_id_dtype([a.dtype for a in nonempty])
        if dtype == np.uint64:  # int64 examples cast to it: a negative id must not wrap
            nonempty = [fit_dtype(a, dtype, f"sequences[{i}]")
                        for i, a in enumerate(arrays) if a.size]
        values = np.concatenate(nonempty).astype(dtype, copy=False)
    else:
        values = np.zeros(0, np.int32)
    if values.size and np.issubdtype(values.dtype, np.signedinteger) and values.min() < 0:
        k = int(np.argmax(values < 0))  # one pass over all tokens; name the sequence on failure
        i = int(np.searchsorted(offsets, k, side="right")) - 1
        raise InputError(f"sequences[{i}][{k - int(offsets[i])}]={int(values[k])} is a negative "
                         "token id")
    return values, offsets


def common_id_dtype(dtypes: Sequence[np.dtype]) -> np.dtype:
    """The dtype that holds token ids of all `dtypes` (integer): numpy's promotion, except that
    uint64 with a signed dtype gives uint64 (ids are >= 0), not numpy's float64."""
    dtype = np.result_type(*dtypes)
    return np.dtype(np.uint64) if dtype.kind == "f" else dtype


def row_dtype(dtype: object, *, name: str = "dtype") -> np.dtype:
    """`dtype` as the numpy dtype of a run's token rows; ValueError unless it is an integer one."""
    try:
        dt = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError:
        raise ValueError(f"{name}={dtype!r} is not a numpy dtype; pass e.g. np.int32") from None
    if dt.kind not in "iu":
        raise ValueError(f"{name}={dt} must be an integer dtype for token ids, e.g. np.int32")
    return dt


def _bounds(dtype: np.dtype) -> tuple[int, int]:
    if dtype.kind == "b":
        return 0, 1
    info = np.iinfo(dtype)
    return int(info.min), int(info.max)


def fit_dtype(arr: np.ndarray, dtype: np.dtype, where: str, *, token_ids: bool = True,
              origin: str = "") -> np.ndarray:
    """`arr` as `dtype`, the one row dtype of a run; never a silent wrap.

    Raises `InputError` naming `where` (e.g. "example 7") when a value does not fit `dtype`,
    or, for token ids, is negative. `origin` says where the run's dtype came from.
    """
    if arr.dtype == dtype:
        bad_neg = token_ids and arr.dtype.kind == "i" and arr.size and int(arr.min()) < 0
        if not bad_neg:
            return arr
    elif dtype.kind not in "iub":
        return arr.astype(dtype)  # float rows (Grain features that are not token ids)
    elif arr.dtype.kind not in "iub":
        raise InputError(f"{where}: values of dtype {arr.dtype} cannot go into rows of {dtype}"
                         f"{origin}; pass integer arrays")
    lo, hi = _bounds(dtype)
    if token_ids:
        lo = max(lo, 0)
    if arr.size:
        # Compared as Python ints, so no dtype promotion can wrap the check itself.
        small, large = int(arr.min()), int(arr.max())
        if small < lo or large > hi:
            k = int(np.argmax(arr < lo)) if small < lo else int(np.argmax(arr > hi))
            v = int(arr[k])
            if token_ids and v < 0:
                raise InputError(f"{where}: token id {v} at position {k} is negative; ids "
                                 "must be >= 0")
            what = "token id" if token_ids else "value"
            raise InputError(f"{where}: {what} {v} at position {k} does not fit the rows' "
                             f"dtype {dtype} (values must be in [{lo}, {hi}]){origin}")
    return arr.astype(dtype, copy=False)


def check_range(values: np.ndarray | list[int], dtype: np.dtype, where: Callable[[int], str],
                *, token_ids: bool = True) -> np.ndarray:
    """`values` (an integer array, or a list of Python ints of any size) as a `dtype` array.

    Raises `InputError` "{where(k)}={v} is not a valid token id for {dtype} ..." for the first
    value `dtype` cannot hold, and for token ids (`token_ids`) the first negative one; compared
    as Python ints, never wrapped.
    """
    lo, hi = _bounds(dtype)
    if token_ids:
        lo = max(lo, 0)
    if len(values):
        arr = isinstance(values, np.ndarray)
        small = int(values.min() if arr else min(values))  # type: ignore[union-attr]
        large = int(values.max() if arr else max(values))  # type: ignore[union-attr]
        if small < lo or large > hi:
            k = next(k for k, v in enumerate(values) if not lo <= int(v) <= hi)
            what = ("token id", "ids") if token_ids else ("value", "values")
            raise InputError(f"{where(k)}={int(values[k])} is not a valid {what[0]} for {dtype} "
                             f"({what[1]} must be in [{lo}, {hi}])")
    return np.asarray(values, dtype)


def check_pad(pad: object, dtype: object, *, name: str = "pad_id") -> None:
    """ValueError when an integer `pad` does not fit the integer row dtype `dtype`."""
    dt = np.dtype(dtype)  # type: ignore[call-overload]
    if dt.kind in "iub" and isinstance(pad, (int, np.integer)) and not isinstance(pad, bool):
        lo, hi = _bounds(dt)
        if not lo <= int(pad) <= hi:
            raise ValueError(f"{name}={int(pad)} does not fit the rows' dtype {dt} (range "
                             f"[{lo}, {hi}]); pick a {name} in range or wider token ids")
