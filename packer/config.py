"""Packing configuration: the frozen, validated `PackConfig` and the strategy / overflow enums."""

from __future__ import annotations

import dataclasses
import enum
import math

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
    context_parallel:   C, the context-parallel ranks a row is split over (None: no split).
                        Every segment then starts at a multiple of 2C and takes a multiple of
                        2C tokens (its length rounded up, the rest padding), and seq_len is a
                        multiple of 2C: what `context_parallel_order` (TransformerEngine's
                        load-balanced THD layout) needs. Together with segment_alignment a,
                        segments are aligned to `alignment` = lcm(a, 2C).
    """

    seq_len: int
    max_segments: int = 64
    strategy: Strategy | str = Strategy.BEST_FIT_DECREASING
    overflow: Overflow | str = Overflow.ERROR
    pad_id: int = 0
    segment_alignment: int = 1
    feature: str = "tokens"
    context_parallel: int | None = None

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
        self._check_context_parallel()
        if self.pad_id < 0:
            raise ValueError(f"pad_id={self.pad_id} must be >= 0")
        if not isinstance(self.feature, str) or not self.feature.isidentifier():
            raise ValueError(f"feature={self.feature!r} must be a non-empty identifier")
        object.__setattr__(self, "strategy", enum_value(Strategy, "strategy", self.strategy))
        object.__setattr__(self, "overflow", enum_value(Overflow, "overflow", self.overflow))

    def _check_context_parallel(self) -> None:
        c = self.context_parallel
        if c is None:
            return
        if type(c).__module__ == "numpy" and hasattr(c, "dtype") and c.dtype.kind in "iu":
            c = int(c)
            object.__setattr__(self, "context_parallel", c)
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"context_parallel={c!r} must be an int >= 1 (the context-parallel "
                             "ranks), or None")
        if self.seq_len % self.alignment:
            also = f" and segment_alignment={self.segment_alignment}" \
                if self.segment_alignment > 1 else ""
            fit = max(self.seq_len // self.alignment, 1) * self.alignment
            raise ValueError(
                f"seq_len={self.seq_len} must be a multiple of {self.alignment} (2 x "
                f"context_parallel={c}{also}); pick seq_len={fit}, for one")

    @property
    def alignment(self) -> int:
        """What every segment's start and span are a multiple of: segment_alignment, with
        context_parallel=C its lcm with 2C."""
        if self.context_parallel is None:
            return self.segment_alignment
        return math.lcm(self.segment_alignment, 2 * self.context_parallel)

    def keys(self) -> FeatureKeys:
        """The contract's key names for this config's feature."""
        return FeatureKeys.of(self.feature)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["strategy"] = str(self.strategy)  # enum members after __post_init__: their values
        d["overflow"] = str(self.overflow)
        if self.context_parallel is None:  # as before it existed: manifests, digests unchanged
            del d["context_parallel"]
        return d
