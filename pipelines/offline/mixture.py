"""Offline mixtures (`seqpack pack --mix`): which examples of each dataset a run packs, and
how often, so that each dataset gets its weight of the units (tokens, loss tokens, examples).

A mixture is one more kind of input to the same job: its datasets' inputs are the job's inputs
(dataset after dataset), and `select` turns their example lengths into the *mixed stream*, the
examples the job plans, each a reference to a corpus example (a repeated one is referenced more
than once). The plan is made on the stream's lengths; each piece then names its corpus example,
so reading, routing and writing tokens are as without a mixture. Per dataset d of weight w_d
holding A_d units::

    no mix_tokens     T = min_d A_d / w_d: the binding dataset whole, no repetition
    mix_tokens=N      T = N; dataset d is repeated t_d / A_d times, refused past max_repetition
    target            t_d = w_d * T: e_d = floor(t_d / A_d) whole epochs (each in a seeded
                      order), then a seeded sample: the prefix of a seeded permutation whose
                      units come nearest t_d - e_d * A_d (exact within one example)

The stream interleaves the datasets by the share of its target each has reached (every block
of the plan holds the mixture); the rows are then shuffled as ever (`--row-order`). Rows carry
`segment_dataset_id` and the example's index within its dataset (`dataset_columns`); the
manifest's `mixture` records the spec and what each dataset gave (`record`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from seqpack.packer.contract import DATASET_ID, FeatureKeys
from seqpack.packer.mixing import row_units
from seqpack.pipelines.errors import UsageError
from seqpack.pipelines.formats.inputs import LossCount, fingerprint_path

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


def _sample(units: np.ndarray, want: float, rng: np.random.Generator) -> np.ndarray:
    """A seeded prefix of a permutation of the examples whose units come nearest `want`."""
    order = rng.permutation(units.size)
    if want <= 0:
        return order[:0]
    cum = np.cumsum(units[order])
    k = int(np.searchsorted(cum, want, side="left"))  # cum[k - 1] < want <= cum[k]
    if k < cum.size and cum[k] - want <= want - (cum[k - 1] if k else 0):
        k += 1
    return order[:k]


def _targets(spec: MixSpec, available: list[int]) -> tuple[float, list[float]]:
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


def select(spec: MixSpec, lengths: Sequence[np.ndarray], loss: Sequence[np.ndarray]
           ) -> Selection:
    """The mixed stream of datasets whose examples have `lengths[d]` and loss tokens
    `loss[d]` (see the module docstring); the same for the same inputs and spec, wherever it
    runs. Units, tokens and loss tokens are those the rows keep (`MixSpec.kept`; `loss` counted
    within them)."""
    kept = [spec.kept(x) for x in lengths]
    loss = [np.where(k < np.asarray(x), 0, y) if spec.overflow == "drop" else np.asarray(y)
            for x, k, y in zip(lengths, kept, loss)]
    units = [units_of(spec.mix_unit, k, np.asarray(y)) for k, y in zip(kept, loss)]
    available = [int(u.sum()) for u in units]
    total, targets = _targets(spec, available)
    counts = [int(x.size) for x in lengths]
    firsts = np.concatenate(([0], np.cumsum(counts)))
    parts, keys, entries = [], [], []
    for d, (name, paths) in enumerate(spec.datasets):
        rng = np.random.default_rng([spec.seed, d])
        u, t = units[d], targets[d]
        epochs = int((t + 1e-9 * t) // available[d])
        picks = [rng.permutation(u.size) for _ in range(epochs)]
        rest = t - epochs * available[d]  # below rounding noise: none (not empty examples)
        picks.append(_sample(u, rest if rest > 1e-9 * t else 0.0, rng))
        local = np.concatenate(picks).astype(np.int64)
        del picks
        got = u[local]
        # the share of its target reached before each example: the interleaving key
        key = np.cumsum(got)
        key -= got
        keys.append(key / max(t, 1e-300))
        del key
        times = np.bincount(local, minlength=u.size)
        realized = int(got.sum())
        entries.append({
            "name": name, "inputs": [fingerprint_path(p) for p in paths],
            "weight": spec.weights[name], "target": round(t, 3), "units": realized,
            "tokens": int((kept[d] * times).sum()),
            "loss_tokens": int((np.asarray(loss[d], np.int64) * times).sum()),
            "examples": int(local.size), "repetitions": round(realized / available[d], 6),
            "epochs": epochs, "available_units": available[d],
            "available_examples": counts[d], "first_example": int(firsts[d]),
            "unused_examples": int((times == 0).sum())})
        local += firsts[d]
        parts.append(local)
        del got, times, local
    # the stream: by key, ties in dataset order; its temporaries as small as they fit
    dataset = np.repeat(np.arange(len(parts), dtype=np.min_scalar_type(len(parts))),
                        [p.size for p in parts])
    key = np.concatenate(keys)
    del keys
    order = np.lexsort((dataset, key))
    del dataset, key
    ref = np.concatenate(parts)
    del parts
    ref = ref[order]
    del order
    small = max((int(x.max(initial=0)) for x in lengths), default=0) < 2**31
    corpus = np.concatenate([np.asarray(x) for x in lengths]).astype(
        np.int32 if small else np.int64, copy=False)
    record = {**spec.to_dict(), "total": round(total, 3), "datasets": entries}
    return Selection(ref, corpus[ref].astype(np.int64), record)


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


def example_times(record: Mapping | None, lengths: Sequence[np.ndarray],
                  loss_counts: Sequence[np.ndarray | None]) -> tuple[np.ndarray, list[str]]:
    """How often a run takes each corpus example (i64[n]: once each without a mixture, a
    read-only view of one 1 that takes no memory),
    recomputed from the inputs' lengths (and loss counts) as the run made it, and what
    differs from the manifest's `mixture` record (its `inputs` paths aside: verify may read
    the inputs elsewhere)."""
    total = sum(int(np.asarray(x).size) for x in lengths)
    once = np.broadcast_to(np.ones(1, np.int64), (total,))
    if not record:
        return once, []
    try:
        selection = select_inputs(spec_of(record), lengths, loss_counts)
    except ValueError as e:
        return once, [f"the inputs no longer give the manifest's mixture: "
                                          f"{e}"]
    times = np.bincount(selection.ref, minlength=total).astype(np.int64)
    problems = []
    for got, want in zip(selection.record["datasets"], record["datasets"]):
        for key, value in got.items():
            if key != "inputs" and want.get(key) != value:
                problems.append(f"mixture dataset {got['name']!r}: the manifest records {key}="
                                f"{want.get(key)}, the inputs give {value}")
    return times, problems[:3]


def select_inputs(spec: MixSpec, lengths: Sequence[np.ndarray],
                  loss_counts: Sequence[np.ndarray | None]) -> Selection:
    """`select` on a job's inputs (`spec.inputs`: dataset after dataset): each input's example
    lengths and loss counts (None: no labels or masks, every token counts), in input order."""
    cuts = np.cumsum([0, *(len(paths) for _, paths in spec.datasets)])
    assert cuts[-1] == len(lengths), (cuts, len(lengths))
    per_lengths, per_loss = [], []
    for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
        per_lengths.append(np.concatenate([np.zeros(0, np.int64), *(
            np.asarray(x, np.int64) for x in lengths[a:b])]))
        per_loss.append(np.concatenate([np.zeros(0, np.int64), *(
            np.asarray(spec.kept(x) if y is None else y, np.int64)
            for x, y in zip(lengths[a:b], loss_counts[a:b]))]))
    return select(spec, per_lengths, per_loss)


# -- what `seqpack stats` shows of a mixture ---------------------------------------------------

_SHOWN = ("name", "weight", "tokens", "loss_tokens", "examples", "repetitions")


def shares(record: Mapping, tokens: np.ndarray, step_rows: int | None) -> dict:
    """The stats of a mixture: per dataset what the manifest records, its share of the rows'
    tokens and the p5 / p50 / p95 of its share per step of `step_rows` rows (full steps; the
    whole output when it holds less than a step) or per row (None); `tokens`:
    `packer.mixing.row_units` (in tokens) of every row, in output order."""
    step = step_rows or 1
    n = tokens.shape[0] // step
    return step_shares(record, tokens[: n * step].reshape(n, step, tokens.shape[1]).sum(axis=1),
                       tokens.sum(axis=0), step_rows)


def step_shares(record: Mapping, steps: np.ndarray, total: np.ndarray, step_rows: int | None
                ) -> dict:
    """`shares` from each full step's tokens of each dataset (`steps` [n, K]; n = 0: the output
    holds less than a step) and every row's (`total` [K])."""
    n = steps.shape[0]
    if not n:
        steps = np.asarray(total)[None]
    share = steps / np.maximum(steps.sum(axis=1, keepdims=True), 1)
    p5, p50, p95 = np.percentile(share, [5, 50, 95], axis=0)
    whole = max(1, int(total.sum()))
    datasets = [{**{k: d[k] for k in _SHOWN}, "token_share": round(float(t / whole), 6),
                 "step_share": {"p5": round(float(a), 6), "p50": round(float(b), 6),
                                "p95": round(float(c), 6)}}
                for d, t, a, b, c in zip(record["datasets"], total, p5, p50, p95)]
    return {"unit": record["unit"], "step_rows": step_rows, "steps": max(n, 1),
            "whole": not n, "datasets": datasets}


def table(mix: Mapping) -> str:
    """A mixture's stats (`shares`, or a manifest's record) as lines of text."""
    per = mix.get("step_rows")
    head = f"mixture in {mix['unit'].replace('_', ' ')}"
    if "steps" in mix:
        count = "the whole output: less than a step" if mix.get("whole") else f"{mix['steps']:,}"
        head += f"; share of tokens per {f'step of {per} rows' if per else 'row'}" \
                f" ({count}): p5 / p50 / p95"
    lines = [head, f"{'dataset':<16}{'weight':>8}{'tokens':>14}{'loss tokens':>14}"
                   f"{'examples':>11}{'repeated':>10}{'share':>9}  per step"]
    total = sum(int(d["tokens"]) for d in mix["datasets"]) or 1
    for d in mix["datasets"]:
        share = d.get("token_share", d["tokens"] / total)
        s = d.get("step_share")
        spread = "" if s is None else \
            f"  {s['p5']:.1%} / {s['p50']:.1%} / {s['p95']:.1%}"
        lines.append(f"{d['name'][:15]:<16}{d['weight']:>8.1%}{d['tokens']:>14,}"
                     f"{d['loss_tokens']:>14,}{d['examples']:>11,}{d['repetitions']:>9.2f}x"
                     f"{share:>9.1%}{spread}")
    return "\n".join(lines)
