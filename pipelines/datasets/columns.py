"""Columns packed with a token feature under its segment layout: labels, masks, per-token values.

A column `c` packed with feature `f` has one value per token of `f` (the same length in every
example) and appears in each row as key `c`: shape `[L]`, its own dtype, its values at the
positions of f's tokens and its pad everywhere else, with no segment ids of its own. That is
the offline contract's extra column (`seqpack pack --column`, `Manifest.columns`). Its values
are any integers in range of its dtype (not token ids: -100 is fine); its role says what it
means for the loss (`loss.LossTokens`):

    role     argument          default pad   a position counts for the loss where
    labels   label_features    -100          label != IGNORE_INDEX (-100, PyTorch / HF)
    mask     mask_features     0             mask != 0
    values   meta_features     0             (no say: e.g. per-token weights)

Worked example (L = 8, token feature `tokens`, `label_features={"labels": -100}`)::

    example 0   tokens [11 12 13]   labels [-100 12 13]
    example 1   tokens [21 22]      labels [-100 22]
    row         tokens    11   12   13   21   22    0    0    0
                labels  -100   12   13 -100   22 -100 -100 -100
                tokens_segment_ids  1 1 1 2 2 0 0 0      (no labels_segment_ids)
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from seqpack.pipelines.errors import InputError

IGNORE_INDEX = -100  # the label of a position that takes no loss (PyTorch, Hugging Face)

ColumnSpec = Mapping[str, Any] | Sequence[str]  # name -> pad (or (feature, pad)); or names


class Role(enum.Enum):
    """What a packed column means for the loss (see the module docstring)."""

    LABELS = "labels"
    MASK = "mask"
    VALUES = "values"


_DEFAULT_PAD = {Role.LABELS: IGNORE_INDEX, Role.MASK: 0, Role.VALUES: 0}
_ARGUMENT = {Role.LABELS: "label_features", Role.MASK: "mask_features",
             Role.VALUES: "meta_features"}


@dataclasses.dataclass(frozen=True)
class Column:
    """One column packed with `feature` (its host): key `name`, padded with `pad`."""

    name: str
    feature: str
    pad: int
    role: Role

    def __post_init__(self) -> None:
        if isinstance(self.pad, bool) or not isinstance(self.pad, int):
            raise ValueError(f"{_ARGUMENT[self.role]}[{self.name!r}]: pad={self.pad!r} must be "
                             "an int")


def _entries(spec: ColumnSpec, role: Role, features: Sequence[str]) -> list[Column]:
    """Columns of one argument: a list of names (default pad, host = the first feature) or a
    dict name -> pad, or name -> (host feature, pad). `meta_features` keeps its older dict
    form {name: host feature} (pad 0)."""
    arg = _ARGUMENT[role]
    if isinstance(spec, (str, bytes)):
        raise ValueError(f"{arg}={spec!r} must be a list of names or a dict name -> pad")
    if not isinstance(spec, Mapping):
        return [Column(str(n), features[0], _DEFAULT_PAD[role], role) for n in spec]
    out = []
    for name, value in spec.items():
        if role is Role.VALUES and isinstance(value, str):
            host, pad = value, 0  # {meta: host}
        elif isinstance(value, tuple) and len(value) == 2:
            host, pad = value
        else:
            host, pad = features[0], value
        out.append(Column(str(name), str(host), pad, role))
    return out


def columns_from(features: Sequence[str], *, label_features: ColumnSpec = (),
                 mask_features: ColumnSpec = (), meta_features: ColumnSpec = ()
                 ) -> tuple[Column, ...]:
    """The columns of a packer's arguments; ValueError for a name given twice, a name that is
    a packed feature, or a host that is not one."""
    cols = [c for spec, role in ((label_features, Role.LABELS), (mask_features, Role.MASK),
                                 (meta_features, Role.VALUES))
            for c in _entries(spec, role, features)]
    seen: dict[str, Role] = {}
    for c in cols:
        if c.feature not in features or c.name in features:
            raise ValueError(
                f"{_ARGUMENT[c.role]}: column {c.name!r} -> feature {c.feature!r}: the feature "
                f"must be a packed feature ({list(features)}) and the column must not be one")
        if c.name in seen:
            raise ValueError(f"column {c.name!r} is given twice ({_ARGUMENT[seen[c.name]]} and "
                             f"{_ARGUMENT[c.role]})")
        seen[c.name] = c.role
    return tuple(cols)


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
            f"with label_features={{{extra[0]!r}: -100}}, mask_features=[{extra[0]!r}] or "
            f"meta_features=[{extra[0]!r}], or drop them on purpose with "
            f"drop_features={extra!r}")


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
                f"element {first + i}: column {name!r} has length {m[i]} but the "
                f"feature {host!r} it is packed with has {h[i]}; they must match per example")
