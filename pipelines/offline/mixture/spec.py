"""A mixture's spec (`MixSpec`), its targets per dataset, and what its record in a manifest
gives back: the spec, each dataset's first corpus example, a row's units per dataset."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from seqpack.packer.contract import DATASET_ID, FeatureKeys
from seqpack.packer.mixing import row_units
from seqpack.pipelines.errors import UsageError
from seqpack.pipelines.formats.inputs import LossCount

UNITS = ("tokens", "loss_tokens", "examples")
# Past about four epochs, repeated data is worth markedly less than new data (Muennighoff et al.
# 2023, "Scaling Data-Constrained Language Models"): the default bound of `mix_tokens` runs.
DEFAULT_MAX_REPETITION = 4.0


@dataclasses.dataclass(frozen=True)
class MixSpec:
    """A mixture of named datasets (each a list of inputs) and their weights."""

    datasets: Sequence[tuple[str, Sequence[str]]]  # (name, inputs), in order
    weights: Mapping[str, float]  # name -> weight (normalized to add up to 1)
    _: dataclasses.KW_ONLY
    mix_unit: str = "tokens"  # one of UNITS
    mix_tokens: int | None = None  # total units; None: the largest mixture with no repetition
    max_repetition: float = DEFAULT_MAX_REPETITION  # with mix_tokens: most epochs a dataset gets
    seed: int = 0
    # what the rows keep of an example longer than seq_len (the run's overflow, set by the
    # job): "truncate" its first seq_len tokens, "drop" none; None: every token (split, error)
    overflow: str | None = None
    seq_len: int | None = None

    def __post_init__(self) -> None:
        datasets = tuple((str(n), tuple(str(p) for p in paths)) for n, paths in self.datasets)
        names = [n for n, _ in datasets]
        if not names:
            raise UsageError("datasets= is empty: a mixture needs at least one dataset")
        for name, paths in datasets:
            if not name or "=" in name or "," in name:
                raise UsageError(f"datasets: name {name!r} must be non-empty, without '=' or ','")
            if names.count(name) > 1:
                raise UsageError(f"datasets: {name!r} is given twice; give each dataset once "
                                 "(a directory or a quoted glob for many files)")
            if not paths:
                raise UsageError(f"datasets: {name!r} has no input files")
        for name in self.weights:
            if name not in names:
                raise UsageError(f"weights[{name!r}]=...: {name!r} is not a dataset of the "
                                 f"mixture ({', '.join(names)})")
        for name in names:
            if name not in self.weights:
                raise UsageError(f"weights[{name!r}]=... is missing: give every dataset a "
                                 f"weight ({', '.join(names)})")
            w = self.weights[name]
            if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) \
                    or w <= 0:
                raise UsageError(f"weights[{name!r}]={w!r} must be a number > 0 (leave a "
                                 "dataset out rather than weigh it 0)")
        total = math.fsum(float(self.weights[n]) for n in names)
        total = 1.0 if abs(total - 1) < 1e-12 else total  # normalized already (a record's)
        object.__setattr__(self, "datasets", datasets)
        object.__setattr__(self, "weights", {n: float(self.weights[n]) / total for n in names})
        if self.mix_unit not in UNITS:
            raise UsageError(f"mix_unit={self.mix_unit!r} must be one of {list(UNITS)}")
        n = self.mix_tokens
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise UsageError(f"mix_tokens={n!r} must be an int >= 1 (or None)")
        r = self.max_repetition
        if isinstance(r, bool) or not isinstance(r, int | float) or not r >= 1:
            raise UsageError(f"max_repetition={r!r} must be a number >= 1")
        if self.overflow not in (None, "truncate", "drop") or (self.overflow is None) != (
                self.seq_len is None):
            raise UsageError(f"overflow={self.overflow!r}, seq_len={self.seq_len!r}: both None, "
                             "or 'truncate' / 'drop' with the run's seq_len")

    def kept(self, lengths: np.ndarray) -> np.ndarray:
        """i64[n]: the tokens the rows keep of examples of `lengths`."""
        lengths = np.asarray(lengths, np.int64)
        if self.seq_len is None:
            return lengths
        if self.overflow == "truncate":
            return np.minimum(lengths, self.seq_len)
        return np.where(lengths > self.seq_len, 0, lengths)

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.datasets]

    @property
    def inputs(self) -> list[str]:
        """Every dataset's inputs, dataset after dataset: the job's inputs."""
        return [p for _, paths in self.datasets for p in paths]

    def to_dict(self) -> dict:
        out = {"unit": self.mix_unit, "mix_tokens": self.mix_tokens,
               "max_repetition": float(self.max_repetition), "seed": self.seed}
        if self.overflow is not None:  # (absent from records of runs that keep every token)
            out.update(overflow=self.overflow, seq_len=self.seq_len)
        return out


@dataclasses.dataclass(frozen=True)
class Selection:
    """The mixed stream: `ref[m]` is the corpus example at stream position m (inputs back to
    back, dataset after dataset), `lengths[m]` its length; `record` the manifest's `mixture`."""

    ref: np.ndarray  # i64[M]
    lengths: np.ndarray  # i64[M]
    record: dict

    @property
    def num_examples(self) -> int:
        return int(self.ref.size)


def units_of(unit: str, lengths: np.ndarray, loss: np.ndarray) -> np.ndarray:
    """i64[n]: each example's units (`loss`: its loss tokens)."""
    if unit == "examples":
        return np.ones(lengths.size, np.int64)
    return np.asarray(loss if unit == "loss_tokens" else lengths, np.int64)


def example_units(spec: MixSpec, lengths: np.ndarray, loss: np.ndarray, *,
                  count_empty: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """i64[n] each, for examples of `lengths` with `loss` loss tokens: the tokens the rows keep
    (`MixSpec.kept`), the loss tokens among them, and their units (`count_empty` False: an
    example the rows keep no token of is no example either, as the rows count it)."""
    lengths = np.asarray(lengths, np.int64)
    kept = spec.kept(lengths)
    loss = np.asarray(loss, np.int64)
    if spec.overflow == "drop":
        loss = np.where(kept < lengths, 0, loss)
    units = units_of(spec.mix_unit, kept, loss)
    if spec.mix_unit == "examples" and not count_empty:
        units = (kept > 0).astype(np.int64)
    return kept, loss, units


def targets(spec: MixSpec, available: list[int]) -> tuple[float, list[float]]:
    """(total units, each dataset's target); UsageError when a dataset holds no units, or
    would be repeated more than max_repetition."""
    weights = [spec.weights[n] for n in spec.names]
    for name, a in zip(spec.names, available):
        if a <= 0:
            raise UsageError(f"mixture dataset {name!r} holds no {spec.mix_unit.replace('_', ' ')}"
                             " (with loss_tokens: no label other than -100, no mask other than"
                             " 0); drop it from the mixture")
    total = float(spec.mix_tokens) if spec.mix_tokens is not None else \
        min(a / w for a, w in zip(available, weights))
    targets = [w * total for w in weights]
    need, name, a = max(zip([t / a for t, a in zip(targets, available)], spec.names, available))
    if spec.mix_tokens is not None and need > spec.max_repetition * (1 + 1e-12):
        raise UsageError(
            f"mixture dataset {name!r} would be repeated {need:.3g} times for its "
            f"{spec.weights[name]:.4g} of mix_tokens={spec.mix_tokens} (it holds {a:,} "
            f"{spec.mix_unit.replace('_', ' ')}), more than max_repetition="
            f"{spec.max_repetition:g}; pass max_repetition={math.ceil(need * 100) / 100:g} "
            "or more, or a smaller mix_tokens=")
    return total, targets


def epochs_of(target: float, available: int) -> tuple[int, float]:
    """(whole epochs, the units the sample after them wants) of a dataset holding `available`
    units for its `target`: a rest below rounding noise is none (not empty examples)."""
    epochs = int((target + 1e-9 * target) // available)
    rest = target - epochs * available
    return epochs, rest if rest > 1e-9 * target else 0.0


# -- rows and outputs of a mixture ------------------------------------------------------------


def firsts_of(record: Mapping | None) -> np.ndarray | None:
    """i64[K]: the first corpus example of each dataset of a manifest's `mixture` (None: no
    mixture)."""
    if not record:
        return None
    return np.array([d["first_example"] for d in record["datasets"]], np.int64)


def piece_units(unit: str, table: np.ndarray, firsts: np.ndarray, num_rows: int) -> np.ndarray:
    """i64[num_rows, K]: each row's units (`row_units`, loss tokens as tokens) per dataset, from
    pieces as a [4, P] table (corpus example, start, length, row: `offline.core`'s rows);
    `firsts`: each dataset's first example."""
    example, start, length, row = table
    dataset = np.searchsorted(firsts, np.asarray(example, np.int64), side="right") - 1
    return row_units(unit, dataset, length, start, num_datasets=firsts.size, row=row,
                     num_rows=num_rows)


def corpus_index(dataset_id: np.ndarray, source_index: np.ndarray, record: Mapping
                 ) -> np.ndarray:
    """The inverse of `dataset_columns` for a manifest's `mixture` record: each used slot's
    corpus example; -1 unused, and -1 where the dataset or the index within it is out of
    range (verify names such a segment)."""
    firsts = firsts_of(record)
    assert firsts is not None
    counts = np.array([d["available_examples"] for d in record["datasets"]], np.int64)
    dataset_id, index = np.asarray(dataset_id, np.int64), np.asarray(source_index, np.int64)
    ok = (dataset_id >= 0) & (dataset_id < firsts.size)
    d = np.where(ok, dataset_id, 0)
    ok &= (index >= 0) & (index < counts[d])
    return np.where(ok, firsts[d] + index, -1)


def corpus_sources(batch: dict[str, np.ndarray], record: Mapping | None, keys: FeatureKeys
                   ) -> list[str]:
    """A mixed shard's rows (`batch`, from its encoding) with `segment_source_index` made the
    corpus example again (`corpus_index`), in place; what is wrong with its dataset ids."""
    if not record:
        return []
    used = batch[keys.segment_lengths] > 0
    problems = [] if np.array_equal(batch[DATASET_ID] >= 0, used) else \
        [f"{DATASET_ID} is not -1 exactly on the unused slots"]
    batch[keys.source_index] = corpus_index(batch[DATASET_ID], batch[keys.source_index], record)
    return problems


def spec_of(record: Mapping) -> MixSpec:
    """The `MixSpec` a manifest's `mixture` record was made with."""
    return MixSpec([(d["name"], d["inputs"]) for d in record["datasets"]],
                   {d["name"]: d["weight"] for d in record["datasets"]}, mix_unit=record["unit"],
                   mix_tokens=record["mix_tokens"], max_repetition=record["max_repetition"],
                   seed=record["seed"], overflow=record.get("overflow"),
                   seq_len=record.get("seq_len"))


def loss_columns_of(record: Mapping | None, columns: Sequence[Mapping] | None
                    ) -> LossCount | None:
    """What a mixture's scans count as loss tokens (`PackJob.mix_loss_columns`), from a
    manifest's `mixture` and `columns`; None otherwise."""
    if not record:
        return None
    roles = {c["source"]: c["role"] for c in columns or () if c["role"] in ("labels", "mask")}
    return loss_count(roles, spec_of(record)) if roles else None


def loss_count(roles: Mapping[str, str], spec: MixSpec) -> LossCount:
    """The scans' `LossCount` for a mixture: within the tokens a truncating run keeps."""
    return LossCount(dict(roles), spec.seq_len if spec.overflow == "truncate" else None)
