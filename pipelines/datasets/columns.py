"""Columns packed with a token feature under its segment layout: labels, masks, per-token values.

A column `c` packed with feature `f` has one value per token of `f` (the same length in every
example) and appears in each row as key `c`: shape `[L]`, its own dtype, its values at the
positions of f's tokens and its pad everywhere else, with no segment ids of its own. That is
the offline contract's extra column (`seqpack pack --column`, `Manifest.columns`). Its values
are any integers in range of its dtype (not token ids: -100 is fine); its role says what it
means for the loss (`loss.LossTokens`). `Columns` names them, and the keys dropped on purpose:

    role     Columns field   default pad   a position counts for the loss where
    labels   labels          -100          label != IGNORE_INDEX (-100, PyTorch / HF)
    mask     masks           0             mask != 0
    values   meta            0             (no say: e.g. per-token weights)

Worked example (L = 8, token feature `tokens`, `Columns(labels={"labels": -100})`)::

    example 0   tokens [11 12 13]   labels [-100 12 13]
    example 1   tokens [21 22]      labels [-100 22]
    row         tokens    11   12   13   21   22    0    0    0
                labels  -100   12   13 -100   22 -100 -100 -100
                tokens_segment_ids  1 1 1 2 2 0 0 0      (no labels_segment_ids)

`check_int` / `check_type` are the checks the option dataclasses of this package share.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from seqpack.packer.contract import IGNORE_INDEX, check_not_packed
from seqpack.packer.inputs import check_pad, fit_dtype
from seqpack.pipelines.errors import InputError

ColumnSpec = Mapping[str, Any] | Sequence[str]  # name -> pad (or (feature, pad)); or names


def check_int(name: str, value: Any, *, low: int) -> None:
    """ValueError `name=value must be an int >= low` (a bool is not an int here)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"{name}={value!r} must be an int >= {low}")


def check_type(name: str, value: Any, kind: type, example: str = "") -> None:
    """ValueError `name=value must be a kind` (with an example of one) unless it is one."""
    if not isinstance(value, kind):
        raise ValueError(f"{name}={value!r} must be a {kind.__name__}{example}")


class Role(enum.Enum):
    """What a packed column means for the loss (see the module docstring)."""

    LABELS = "labels"
    MASK = "mask"
    VALUES = "values"


_DEFAULT_PAD = {Role.LABELS: IGNORE_INDEX, Role.MASK: 0, Role.VALUES: 0}
_FIELD = {Role.LABELS: "labels", Role.MASK: "masks", Role.VALUES: "meta"}


@dataclasses.dataclass(frozen=True)
class Column:
    """One column packed with `feature` (its host): key `name`, padded with `pad`."""

    name: str
    feature: str
    pad: int
    role: Role

    def __post_init__(self) -> None:
        _check_pad(f"Columns.{_FIELD[self.role]}", self.name, self.pad)


def _check_pad(field: str, name: str, pad: Any) -> None:
    if isinstance(pad, bool) or not isinstance(pad, int):
        raise ValueError(f"{field}[{name!r}]: pad={pad!r} must be an int")


def _entries(spec: ColumnSpec, role: Role) -> list[tuple[str, str | None, Any]]:
    """(name, host feature or None for the first packed one, pad) of one field: a list of names
    (default pad) or a dict name -> pad, or name -> (host feature, pad). `meta` keeps its older
    dict form {name: host feature} (pad 0)."""
    if not isinstance(spec, Mapping):
        return [(str(n), None, _DEFAULT_PAD[role]) for n in spec]
    out: list[tuple[str, str | None, Any]] = []
    for name, value in spec.items():
        if role is Role.VALUES and isinstance(value, str):
            host, pad = value, 0  # {meta: host}
        elif isinstance(value, tuple) and len(value) == 2:
            host, pad = value
        else:
            host, pad = None, value
        out.append((str(name), None if host is None else str(host), pad))
    return out


@dataclasses.dataclass(frozen=True)
class Columns:
    """The keys of the elements besides the packed features: columns packed with them, keys
    dropped on purpose, and how `loss_tokens` counts (see the module docstring).

    labels:          per-token label columns (any integers, such as -100): a list (pad -100,
                     host: the first packed feature) or {name: pad} or {name: (host, pad)}.
    masks:           the same for 0/1 loss masks (default pad 0).
    meta:            the same for other per-token values (pad 0): a list or {name: host}.
    drop:            keys of the elements left out on purpose. Any other key that is neither
                     packed nor a column raises `InputError` on element 0.
    next_token_loss: how `make_training_pipeline` counts `loss_tokens` (loss.py): position p
                     against the label of p + 1 (True) or its own (False: labels pre-shifted).
    """

    labels: ColumnSpec = ()
    masks: ColumnSpec = ()
    meta: ColumnSpec = ()
    drop: Sequence[str] = ()
    next_token_loss: bool = True

    def __post_init__(self) -> None:
        seen: dict[str, str] = {}
        for role, field in _FIELD.items():
            spec = getattr(self, field)
            if isinstance(spec, str | bytes) or not isinstance(spec, Mapping | Iterable):
                raise ValueError(f"{field}={spec!r} must be a list of names or a dict name -> "
                                 "pad")
            object.__setattr__(self, field, dict(spec) if isinstance(spec, Mapping)
                               else tuple(spec))
            for name, _, pad in _entries(getattr(self, field), role):
                _check_pad(field, name, pad)
                if name in seen:
                    raise ValueError(f"column {name!r} is given twice ({seen[name]} and "
                                     f"{field})")
                seen[name] = field
        if isinstance(self.drop, str | bytes) or not isinstance(self.drop, Iterable):
            raise ValueError(f"drop={self.drop!r} must be a list of names")
        object.__setattr__(self, "drop", tuple(str(n) for n in self.drop))
        check_type("next_token_loss", self.next_token_loss, bool)

    def names(self) -> tuple[str, ...]:
        """The columns' names (labels, masks, meta), in that order."""
        return tuple(n for role, field in _FIELD.items()
                     for n, _, _ in _entries(getattr(self, field), role))

    def explicit_pads(self) -> set[str]:
        """The label / mask columns given with a pad of their own (a dict)."""
        return {n for spec in (self.labels, self.masks) if isinstance(spec, Mapping)
                for n in spec}

    def of(self, features: Sequence[str]) -> tuple[Column, ...]:
        """The columns packed with `features` (the packed feature names); ValueError for a
        name that is a packed feature, or a host that is not one."""
        cols = tuple(Column(name, features[0] if host is None else host, pad, role)
                     for role, field in _FIELD.items()
                     for name, host, pad in _entries(getattr(self, field), role))
        for c in cols:
            if c.feature not in features or c.name in features:
                raise ValueError(
                    f"Columns.{_FIELD[c.role]}: column {c.name!r} -> feature {c.feature!r}: "
                    f"the feature must be a packed feature ({list(features)}) and the column "
                    "must not be one")
        return cols


def loss_feature(features: Sequence[str], columns: Iterable[Column]) -> str:
    """The packed feature the loss is counted on: the host of the label / mask columns (one
    host for all of them), else the first packed feature."""
    hosts = {c.feature for c in columns if c.role is not Role.VALUES}
    if len(hosts) > 1:
        raise ValueError(f"label / mask columns ride on several features {sorted(hosts)}; the "
                         "loss is counted on one: put them on the same feature")
    return hosts.pop() if hosts else features[0]


def check_declared(element: Any, declared: Iterable[str], drop: Iterable[str], where: str
                   ) -> None:
    """InputError when `element` (a dict) holds a key that is neither packed nor dropped on
    purpose: nothing a source holds disappears without a word."""
    if not isinstance(element, Mapping):
        return
    extra = sorted(set(element) - set(declared) - set(drop))
    if extra:
        raise InputError(
            f"{where} holds {extra}, which would not reach the rows: pack per-token columns "
            f"with Columns(labels={{{extra[0]!r}: -100}}), Columns(masks=[{extra[0]!r}]) or "
            f"Columns(meta=[{extra[0]!r}]), or drop them on purpose with "
            f"Columns(drop={extra!r})")


def value_kinds(token_ids: bool) -> str:
    """The numpy dtype kinds a packed array may have: token ids are never bool."""
    return "iu" if token_ids else "iub"


def as_values(v: Any, where: str, *, token_ids: bool) -> np.ndarray:
    """`v` as a 1-D integer array (an empty one as int32); InputError naming `where` else."""
    arr = np.asarray(v)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in value_kinds(token_ids)):
        what = "integer token ids" if token_ids else "integers"
        raise InputError(f"{where} must be a 1-D array of {what}, got shape {arr.shape} "
                         f"dtype {arr.dtype}")
    return arr if arr.size else arr.astype(np.int32)


def check_negative(batch: Mapping[str, np.ndarray], held: Mapping[str, dict[int, list]],
                   features: Sequence[str], window: int) -> None:
    """Token ids are >= 0: one pass over a window's rows; InputError naming the first bad
    element of `held` (feature -> window number -> that window's values) where one is not."""
    for f in features:
        rows = batch.get(f)
        if rows is None or rows.dtype.kind != "i" or not rows.size or rows.min() >= 0:
            continue
        for k in sorted(held[f]):
            for i, v in enumerate(held[f][k]):
                if v is not None and v.size and v.min() < 0:
                    fit_dtype(v, v.dtype, f"element {k * window + i}: {f!r}")


def check_lengths(cols: Mapping[str, list], hosts: Mapping[str, str], first: int) -> None:
    """InputError naming the element and both lengths when a column's value is not as long as
    its host feature's (`cols`: name -> values of a window whose first element is `first`)."""
    for name, host in hosts.items():
        n = len(cols[name])
        m = np.fromiter(map(len, cols[name]), np.int64, n)
        h = np.fromiter(map(len, cols[host]), np.int64, n)
        bad = np.flatnonzero(m != h)
        if bad.size:
            i = int(bad[0])
            raise InputError(
                f"example {first + i}: column {name!r} has length {m[i]} but the "
                f"feature {host!r} it is packed with has {h[i]}; they must match per example")


class RunValues:
    """The values a packer reads, checked, in one dtype per name for the whole run: the dtype
    given, else the first non-empty element's (restored from a state). `features` hold token
    ids (>= 0); the other names are columns (any integers in range), padded with `pads`."""

    def __init__(self, *, features: tuple[str, ...], names: tuple[str, ...],
                 drop: tuple[str, ...], pad_id: int, pads: Mapping[str, int],
                 given: Mapping[str, np.dtype]):
        self.features, self.names, self.drop = features, names, drop
        self.pad_id, self.pads, self.given = pad_id, pads, set(given)
        self.dtypes: dict[str, np.dtype] = dict(given)
        self._source: tuple[Any, int] = (None, 0)  # the parent's `ref_of`, the window's first

    def _ref(self, ident: int) -> str:
        """Where element `ident` came from, when the parent says (`ref_of`: its example in
        the source, or its dataset and example), as " (...)"; else ""."""
        ref_of, first = self._source
        ref = ref_of(ident - first) if ref_of is not None else None
        return f" ({ref})" if ref else ""

    def check_first(self, element: Any) -> None:
        """The parent's first element: not packed already, and every key declared."""
        check_not_packed(element, self.features, "element 0 of the parent")
        if isinstance(element, Mapping) and all(n in element for n in self.names):
            check_declared(element, self.names, self.drop, "element 0 of the parent")

    def bad_element(self, ident: int, e: Exception) -> None:
        raise InputError(f"element {ident} of the parent{self._ref(ident)} lacks one of the "
                         f"features {list(self.names)} ({type(e).__name__}: {e}); elements must be "
                         "dicts of 1-D token arrays") from None

    def values(self, v: Any, ident: int, name: str) -> np.ndarray:
        return as_values(v, f"element {ident}{self._ref(ident)}: {name!r}",
                         token_ids=name in self.features)

    def read(self, parent: Iterator[Any], count: int, first: int
             ) -> tuple[dict[str, list], bool]:
        """Up to `count` elements of `parent` (the first of them element `first` of the run),
        checked and cast: (their values per name, whether the parent ended)."""
        self._source = (getattr(parent, "ref_of", None), first)
        cols: dict[str, list] = {n: [] for n in self.names}
        ended = False
        if len(self.names) == 1:  # the common case, element by element with no inner loop
            vals = cols[self.names[0]]
            append, key = vals.append, self.names[0]
            try:
                if first == 0:
                    element = next(parent)
                    self.check_first(element)
                    append(element[key])
                for _ in range(count - (first == 0)):
                    append(next(parent)[key])
            except StopIteration:
                ended = True
            except (KeyError, TypeError, IndexError) as e:
                self.bad_element(first + len(vals), e)
        else:
            try:
                for n in range(count):
                    element = next(parent)
                    if first + n == 0:
                        self.check_first(element)
                    try:
                        for name in self.names:
                            cols[name].append(element[name])
                    except (KeyError, TypeError, IndexError) as e:
                        self.bad_element(first + n, e)
            except StopIteration:
                ended = True
        self.window(cols, first)
        return cols, ended

    def window(self, cols: Mapping[str, list], first: int) -> None:
        """Checks and casts (in place) the values of a window whose first element is `first`."""
        for n, col in cols.items():
            if not all(type(v) is np.ndarray and v.ndim == 1 for v in col):
                col[:] = [self.values(v, first + i, n) for i, v in enumerate(col)]
            elif col:
                kinds = value_kinds(n in self.features)
                if not all(v.dtype.kind in kinds for v in col):
                    i = next(i for i, v in enumerate(col) if v.dtype.kind not in kinds)
                    self.values(col[i], first + i, n)
        for n, col in cols.items():
            self.fit(col, n, first)

    def fit(self, col: list, name: str, first: int) -> None:
        """Casts values of `name` to the run's dtype (fixed by the first non-empty element
        unless given); InputError naming the element for a value it cannot hold."""
        dtype = self.dtypes.get(name)
        token_ids = name in self.features
        if dtype is None:
            nonempty = next((v for v in col if v.size), None)
            if nonempty is None:
                return
            dtype = self.dtypes[name] = nonempty.dtype
            if token_ids:
                check_pad(self.pad_id, dtype)
            else:
                check_pad(self.pads[name], dtype, name=f"the pad of column {name!r}")
        origin = " (dtype= of PackIterDataset)" if name in self.given else \
            " (the first element's dtype; pass dtype= for a wider one)"
        for i, v in enumerate(col):
            if v.dtype != dtype and v.size:
                col[i] = fit_dtype(v, dtype, f"element {first + i}: {name!r}",
                                   token_ids=token_ids, origin=origin)


def check_packed_columns(source: Any, columns: Sequence[Column], *,
                         explicit_pads: Iterable[str]) -> list[Column]:
    """The `columns` given for a packed source, checked against its manifest (each must be a
    key of the rows; a pad given explicitly must be the manifest's), plus the manifest's columns
    that carry a "role" ("labels" / "mask" / "values"). A manifest column with neither is a
    ValueError: what it means for `loss_tokens` is never guessed."""
    manifest = getattr(source, "manifest", None)
    listed = {str(c["name"]): c for c in (getattr(manifest, "columns", None) or [])}
    keys = set(getattr(manifest, "stored_keys", None) or []) | set(listed)
    explicit = set(explicit_pads)
    for c in columns:
        if manifest is not None and c.name not in keys:
            raise ValueError(f"column {c.name!r} is not in the packed rows (their keys: "
                             f"{sorted(keys)})")
        pad = listed.get(c.name, {}).get("pad")
        if c.name in explicit and pad is not None and int(pad) != c.pad:
            raise ValueError(f"column {c.name!r}: pad={c.pad} given but the packed rows' "
                             f"manifest says pad={int(pad)}")
    given = {c.name for c in columns}
    feature = str(getattr(source, "feature", "tokens"))
    held = getattr(source, "columns", None)  # the [L] columns the rows hold as decoded
    out = list(columns)
    for name, entry in listed.items():
        if name in given:
            continue
        if held is not None and name not in held and entry.get("role") in ("labels", "mask"):
            if any(c.role in (Role.LABELS, Role.MASK) for c in out):
                continue  # the caller said how to count loss tokens from what the rows hold
            encoding = getattr(manifest, "encoding", None) or "arrayrecord"
            if encoding == "hf" and "labels" in held:  # TRL's labels: every column folded in
                out.append(Column("labels", feature, -100, Role.LABELS))
                continue
            raise ValueError(
                f"the packed rows ({encoding} format) do not hold the {entry['role']} column "
                f"{name!r} they were packed with (they hold {sorted(held)}); train from an "
                "arrayrecord, parquet or hf output, or say how to count loss tokens: "
                "Megatron's loss_mask is already shifted, "
                "Columns(masks=['loss_mask'], next_token_loss=False)")
        if entry.get("role") not in {r.value for r in Role}:
            raise ValueError(
                f"the packed rows hold the column {name!r} (pad {entry.get('pad')}); say what "
                f"it means for loss_tokens: Columns(labels=[{name!r}]) (-100 takes no loss), "
                f"Columns(masks=[{name!r}]) (0 takes no loss) or Columns(meta=[{name!r}])")
        out.append(Column(name, feature, int(entry["pad"]), Role(entry["role"])))
    return out
