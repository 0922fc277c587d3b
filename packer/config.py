"""Packing configuration: the frozen, validated `PackConfig` and the strategy / overflow enums."""

from __future__ import annotations

import dataclasses
import enum

from seqpack.packer.contract import FeatureKeys

MAX_SEQ_LEN = 2**31 - 1  # segment offsets, lengths and positions are contract.SEGMENT_DTYPE, int32


class Strategy(enum.StrEnum):
    """How examples are assigned to rows (all plan on lengths alone)."""

    FIRST_FIT = "first_fit"  # input order, first row with room
    BEST_FIT = "best_fit"  # input order, tightest row with room
    BEST_FIT_DECREASING = "best_fit_decreasing"  # offline, near-optimal
    CONCAT_SPLIT = "concat_split"  # pretraining: fill every row, cutting examples


class Overflow(enum.StrEnum):
    """What happens to an example longer than `seq_len`."""

    ERROR = "error"  # raise, naming the example and its length
    TRUNCATE = "truncate"  # keep the first seq_len tokens; the rest is counted as truncated
    SPLIT = "split"  # cut into pieces of at most seq_len, each its own segment
    DROP = "drop"  # skip the example; its tokens are counted as dropped


def enum_value(enum_cls: type[enum.Enum], name: str, value: object) -> enum.Enum:
    """`enum_cls(value)`, or a ValueError naming the parameter `name` and the choices."""
    try:
        return enum_cls(value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in enum_cls)
        raise ValueError(f"{name}={value!r} is not known; use one of {choices}") from None


@dataclasses.dataclass(frozen=True)
class PackConfig:
    """Everything a packing run needs besides the data.

    seq_len:            L, tokens per packed row.
    max_segments:       S, the most segments (examples or pieces) one row may hold.
    strategy:           a `Strategy` (or its string value).
    overflow:           an `Overflow` policy for examples longer than L.
    pad_id:             the token written into padding positions.
    segment_alignment:  every segment starts at a multiple of this; must divide seq_len.
    feature:            the name of the packed feature; prefixes the metadata keys.
    """

    seq_len: int
    max_segments: int = 64
    strategy: Strategy | str = Strategy.BEST_FIT_DECREASING
    overflow: Overflow | str = Overflow.ERROR
    pad_id: int = 0
    segment_alignment: int = 1
    feature: str = "tokens"

    def __post_init__(self) -> None:
        for name in ("seq_len", "max_segments", "segment_alignment", "pad_id"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                try:
                    import numpy as np

                    if isinstance(value, np.integer):
                        object.__setattr__(self, name, int(value))
                        continue
                except ImportError:  # pragma: no cover
                    pass
                raise ValueError(f"{name}={value!r} must be an int")
        if not 1 <= self.seq_len <= MAX_SEQ_LEN:
            raise ValueError(f"seq_len={self.seq_len} must be in [1, {MAX_SEQ_LEN}]: segment "
                             "offsets, lengths and positions are int32")
        if self.max_segments < 1:
            raise ValueError(f"max_segments={self.max_segments} must be >= 1")
        if self.segment_alignment < 1:
            raise ValueError(f"segment_alignment={self.segment_alignment} must be >= 1")
        if self.seq_len % self.segment_alignment:
            raise ValueError(
                f"segment_alignment={self.segment_alignment} must divide "
                f"seq_len={self.seq_len}; pick a seq_len that is a multiple of it"
            )
        if self.pad_id < 0:
            raise ValueError(f"pad_id={self.pad_id} must be >= 0")
        if not isinstance(self.feature, str) or not self.feature.isidentifier():
            raise ValueError(f"feature={self.feature!r} must be a non-empty identifier")
        object.__setattr__(self, "strategy", enum_value(Strategy, "strategy", self.strategy))
        object.__setattr__(self, "overflow", enum_value(Overflow, "overflow", self.overflow))

    def keys(self) -> FeatureKeys:
        """The contract's key names for this config's feature."""
        return FeatureKeys.of(self.feature)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["strategy"] = str(self.strategy)  # enum members after __post_init__: their values
        d["overflow"] = str(self.overflow)
        return d
