"""`Mixture`: several datasets as one stream of examples, weighted in the unit the user names.

Each dataset keeps its own seeded global order (every example, reshuffled every epoch) and
deals its positions to the consumers of the run (host h's worker w of H hosts with W workers
reads positions w H + h, + H W, ...: `elastic.streams`); each consumer draws next from the
dataset furthest below its target share (`packer.mixing.ShortfallMixer`; a schedule's stage
starts count the run's units, all consumers together). The state is what each dataset's
stream has left and unit counts, never a replay: restored under edited weights or an edited
schedule, the stream goes on from the same positions with the new weights, and on another
layout the positions left are dealt again. `PackIterDataset` placed directly on a mixture
checkpoints the examples it holds as (dataset, index) references (`fetch`), so a resume
repeats and loses nothing whatever the new weights or host count.

Example::

    mix = Mixture({"chat": chat_src, "math": math_src}, weights={"chat": 0.5, "math": 0.5},
                  unit="tokens", on_exhausted="stop", seed=0)
    ds = make_training_pipeline(mix, pack=PackConfig(4096), batch=64, shuffle_seed=0,
                                num_epochs=1)
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np

from seqpack.packer.contract import DATASET_ID, SOURCE_START
from seqpack.packer.mixing import (
    UNITS,
    ShortfallMixer,
    carries_loss,
    make_stages,
    row_units,
    slot_counts,
)
from seqpack.pipelines.datasets.elastic import GlobalOrder, Stream, consumer_of, global_order
from seqpack.pipelines.errors import InputError

POLICIES = ("stop", "continue", "repeat")


class Mixture(grain.IterDataset):
    """Examples of several random-access datasets mixed by largest shortfall.

    datasets:     name -> source (`grain.MapDataset`, or `__len__` + `__getitem__`) of example
                  dicts; a dataset's id in `segment_dataset_id` is its position here.
    weights:      name -> weight (normalized); or `schedule=[(0, w0), (T1, w1), ...]`: the
                  weights from T units consumed on (each stage counts from its own start).
    unit:         what the weights share: "tokens" (of `feature`), "loss_tokens" (the tokens
                  where no `labels` column holds -100 and no `mask` column 0; one column name
                  or a list, of either role or both) or "examples".
    on_exhausted: what a dataset does after `num_epochs` passes: "stop" (the stream ends when
                  the rule next picks it), "continue" (it leaves; the others' weights are
                  renormalized) or "repeat" (a new seeded epoch: it never runs out); one policy,
                  or a dict name -> policy.
    seed:         seeds every dataset's per-epoch order (with its name and the epoch).
    feature:      the key of the token ids; None: the packed feature of the `PackConfig` it
                  is packed with (`PackIterDataset`, `make_training_pipeline`), else "tokens".
    num_epochs:   passes over each dataset before it counts as exhausted (None: never).
    shard_index, shard_count: this host's shard of every dataset (`make_training_pipeline`
                  sets them from its `Batching`).
    """

    def __init__(self, datasets: Mapping[str, Any], *,
                 weights: Mapping[str, float] | None = None,
                 schedule: Sequence[tuple[int, Mapping[str, float]]] | None = None,
                 unit: str = "tokens", on_exhausted: str | Mapping[str, str] = "stop",
                 seed: int = 0, feature: str | None = None,
                 labels: str | Sequence[str] | None = None,
                 mask: str | Sequence[str] | None = None, num_epochs: int | None = 1,
                 shard_index: int = 0, shard_count: int = 1):
        super().__init__()
        if not isinstance(datasets, Mapping) or not datasets:
            raise ValueError(f"datasets={datasets!r} must be a non-empty dict name -> source")
        self.names = tuple(str(n) for n in datasets)
        self.sources = tuple(datasets.values())
        for name, src in zip(self.names, self.sources):
            if not (hasattr(src, "__len__") and hasattr(src, "__getitem__")):
                raise ValueError(f"dataset {name!r} is a {type(src).__name__}; a mixture takes "
                                 "random-access sources (len() and [index])")
            if len(src) == 0:
                raise ValueError(f"dataset {name!r} is empty; drop it from the mixture")
        self.sizes = tuple(len(s) for s in self.sources)
        self.stages = make_stages(self.names, weights, schedule)
        if unit not in UNITS:
            raise ValueError(f"unit={unit!r} must be one of {list(UNITS)}")
        self.loss_columns = (*((n, "labels") for n in _names("labels", labels)),
                             *((n, "mask") for n in _names("mask", mask)))
        if unit == "loss_tokens" and not self.loss_columns:
            raise ValueError("unit='loss_tokens' counts the tokens that carry a loss: name "
                             "the labels column (labels='labels', -100 = no loss) or the mask "
                             "column (mask='loss_mask', 0 = no loss), or both")
        if feature is not None and not (isinstance(feature, str) and feature):
            raise ValueError(f"feature={feature!r} must be the key of the token ids, or None "
                             "(the PackConfig's feature)")
        self.unit, self.labels, self.mask = unit, labels, mask
        self.explicit_feature = feature is not None
        self.feature = feature if feature is not None else "tokens"
        self.policies = _policies(self.names, on_exhausted)
        self.num_epochs = _check_epochs(num_epochs)
        self.seed = int(seed)
        if not 0 <= shard_index < shard_count:
            raise ValueError(f"{shard_index=} must be in [0, {shard_count=})")
        self.shard = (int(shard_index), int(shard_count))
        self.worker = (0, 1)  # (index, count) of Grain's worker slice
        self._check_shards()

    def _check_shards(self) -> None:
        j, K = self.consumer()
        for name, n in zip(self.names, self.sizes):
            if n <= j:
                raise ValueError(f"dataset {name!r} ({n} examples) has no example for shard "
                                 f"{self.shard[0]} of {self.shard[1]}, worker "
                                 f"{self.worker[0]} of {self.worker[1]} (its first epoch is "
                                 f"dealt to {K} hosts x workers); use fewer hosts or workers")

    def for_feature(self, feature: str) -> Mixture:
        """This mixture counting `feature` (a packer's): itself, or a copy when its feature was
        not given; ValueError when another one was."""
        if feature == self.feature:
            return self
        if self.explicit_feature:
            raise ValueError(f"Mixture(feature={self.feature!r}) but PackConfig(feature="
                             f"{feature!r}); name the same key, or leave Mixture's feature out "
                             "(it takes the PackConfig's)")
        out = copy.copy(self)
        out.feature = feature
        return out

    def configured(self, *, shard_index: int, shard_count: int,
                   num_epochs: int | None) -> Mixture:
        """A copy for one host of `make_training_pipeline` (its shard, its epochs)."""
        out = copy.copy(self)
        out.shard, out.num_epochs = (int(shard_index), int(shard_count)), _check_epochs(num_epochs)
        out._check_shards()
        return out

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        """Called by Grain in each prefetch worker: the worker reads its positions of every
        dataset's global order (dealt in turn, `sequential_slice` or not) and mixes them by
        the same rule."""
        self.worker = (sl.start or 0, sl.step or 1)
        self._check_shards()

    def consumer(self) -> tuple[int, int]:
        """(this host's worker's consumer index, the run's consumers)."""
        return consumer_of(self.shard, self.worker)

    def orders(self) -> list[GlobalOrder]:
        """Per dataset: position -> example index, reshuffled every epoch, seeded by the
        mixture's seed and the dataset's name."""
        return [global_order(n, zlib.crc32(f"{self.seed}/{name}".encode()))
                for name, n in zip(self.names, self.sizes)]

    def limits(self) -> list[int | None]:
        """Per dataset: the end of its positions (None: endless, `repeat` or no num_epochs)."""
        return [n * self.num_epochs if self.num_epochs is not None and p != "repeat" else None
                for n, p in zip(self.sizes, self.policies)]

    def __iter__(self) -> MixtureIterator:
        return MixtureIterator(self)

    def __str__(self) -> str:
        return f"Mixture({list(self.names)}, unit={self.unit!r})"


def _names(role: str, value: str | Sequence[str] | None) -> tuple[str, ...]:
    """The column names given for `role` (labels= or mask=): one name, a list, or None."""
    names = (value,) if isinstance(value, str) else () if value is None else tuple(value) \
        if isinstance(value, Sequence) else None
    if names is None or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"{role}={value!r} must be a column name, a list of them, or None")
    return names


def _check_epochs(num_epochs: int | None) -> int | None:
    if num_epochs is not None and (isinstance(num_epochs, bool) or num_epochs < 1):
        raise ValueError(f"{num_epochs=} must be >= 1, or None (never exhausted)")
    return num_epochs


def _policies(names: Sequence[str], on_exhausted: Any) -> tuple[str, ...]:
    if isinstance(on_exhausted, str):
        on_exhausted = dict.fromkeys(names, on_exhausted)
    if not isinstance(on_exhausted, Mapping) or set(on_exhausted) != set(names):
        raise ValueError(f"on_exhausted={on_exhausted!r} must be one of {list(POLICIES)}, or a "
                         f"dict giving one for each of {list(names)}")
    for name, policy in on_exhausted.items():
        if policy not in POLICIES:
            raise ValueError(f"on_exhausted[{name!r}]={policy!r} must be one of "
                             f"{list(POLICIES)}")
    return tuple(on_exhausted[n] for n in names)


class MixtureIterator(grain.DatasetIterator):
    """Iterator of `Mixture`; `counters` per dataset, `take_refs` / `fetch` for the packer."""

    def __init__(self, mix: Mixture):
        super().__init__()
        self._mix = mix
        k = len(mix.names)
        self._orders = mix.orders()
        self._limits = mix.limits()
        j, K = mix.consumer()
        self._streams = [Stream.initial(j, K) for _ in range(k)]
        self._mixer = ShortfallMixer(mix.stages, scale=K)
        self._drawn = [0] * k
        self._tokens = [0] * k
        self._loss = [0] * k
        self._refs_d: list[int] = []
        self._refs_i: list[int] = []
        self._cuts: list[int] = []  # refs taken so far where a stage ended (`take_cuts`)
        self.reweighted = False  # set_state: the weights at the restored point were edited

    @property
    def limits(self) -> list[int | None]:
        return list(self._limits)

    def consumer(self) -> tuple[int, int]:
        return self._mix.consumer()

    def layout(self) -> tuple[int, int, int, int]:
        """(host, hosts, worker, workers) of this consumer."""
        return (*self._mix.shard, *self._mix.worker)

    def __next__(self) -> Any:
        mixer = self._mixer
        while True:
            d = mixer.pick()
            if d < 0:
                raise StopIteration
            p = self._streams[d].next(self._limits[d])
            if p is None:
                if self._mix.policies[d] == "stop":
                    raise StopIteration
                mixer.deactivate(d)
                self._cuts.append(len(self._refs_d))
                continue
            break
        index = self._orders[d][p]
        element = self._mix.sources[d][index]
        tokens, loss = self._count(d, index, element)
        stage = mixer.stage
        mixer.add(d, self._in_unit(tokens, loss))
        self._drawn[d] += 1
        self._tokens[d] += tokens
        self._loss[d] += loss
        self._refs_d.append(d)
        self._refs_i.append(index)
        if mixer.stage != stage:  # a schedule's next stage starts after this element
            self._cuts.append(len(self._refs_d))
        return element

    def _count(self, d: int, index: int, element: Any) -> tuple[int, int]:
        """(tokens, loss tokens) of one element; InputError naming it when a key is missing."""
        cols = self._mix.loss_columns
        try:
            tokens = len(element[self._mix.feature])
            if not cols:  # no labels or mask column: every token carries a loss
                return tokens, tokens
            return tokens, int(np.count_nonzero(carries_loss(
                ((np.asarray(element[n]), r) for n, r in cols), tokens)))
        except (KeyError, TypeError, IndexError, ValueError) as e:
            want = [self._mix.feature, *(n for n, _ in cols)]
            raise InputError(f"dataset {self._mix.names[d]!r}, example {index}: lacks one of "
                             f"{want} ({type(e).__name__}: {e})") from None

    # ---- what the packer reads ------------------------------------------------------------

    def ref_of(self, i: int) -> str | None:
        """Where the i-th element since the last `take_refs` came from, for an error."""
        if not 0 <= i < len(self._refs_d):
            return None
        return f"dataset {self._mix.names[self._refs_d[i]]!r}, example {self._refs_i[i]}"

    def take_refs(self) -> tuple[np.ndarray, np.ndarray]:
        """(dataset i32[n], index i64[n]) of the n elements yielded since the last call."""
        out = (np.asarray(self._refs_d, np.int32), np.asarray(self._refs_i, np.int64))
        self._refs_d, self._refs_i = [], []
        return out

    def take_cuts(self) -> list[int]:
        """Where a stage ended among the elements yielded since the last `take_refs` (a
        dataset left, `continue`, or a schedule's next stage began): for each, how many of
        them came before (the new stage starts there). The packer ends its window there, so
        the old stage's last examples leave with the rows drawn under the weights they
        belong to."""
        out, self._cuts = self._cuts, []
        return out

    @property
    def names(self) -> tuple[str, ...]:
        return self._mix.names

    def fetch(self, dataset: int, index: int) -> Any:
        """The element `index` of dataset number `dataset` (a reference from `take_refs`)."""
        return self._mix.sources[dataset][index]

    def _in_unit(self, tokens: int, loss: int) -> int:
        """One element's units in the mixture's unit, from its tokens and loss tokens."""
        unit = self._mix.unit
        return tokens if unit == "tokens" else loss if unit == "loss_tokens" else 1

    def units(self, d: int, index: int, element: Any) -> tuple[int, int]:
        """(units in the mixture's unit, tokens) of `element`, example `index` of dataset `d`."""
        tokens, loss = self._count(d, index, element)
        return self._in_unit(tokens, loss), tokens

    def hold_back(self, units: Sequence[int], count: int) -> float:
        """The current stage counts `units` per dataset (`count` examples) that the packer
        holds back to plan again as drawn in it (`ShortfallMixer.hold_back`); returns the
        units the stage must reach for them to fit the weights."""
        return self._mixer.hold_back(units, count)

    def stage_units(self) -> int:
        """Units drawn in the current stage, with those held back."""
        return self._mixer.stage_units()

    def dataset_units(self, rows: dict[str, np.ndarray]) -> np.ndarray:
        """i64[R, K]: each dataset's units in each of these packed rows, in the mixture's unit
        (loss tokens where the rows carry every loss column, else tokens; examples: their
        first pieces)."""
        mix = self._mix
        lengths = rows[f"{mix.feature}_segment_lengths"]
        loss = None
        if mix.unit == "loss_tokens" and all(n in rows for n, _ in mix.loss_columns):
            marks = carries_loss(((rows[n], r) for n, r in mix.loss_columns),
                                 rows[mix.feature].shape)
            loss = slot_counts(marks, rows[f"{mix.feature}_segment_offsets"], lengths)
        return row_units(mix.unit, rows[DATASET_ID], lengths, rows[SOURCE_START],
                         num_datasets=len(mix.names), loss=loss)

    @property
    def counters(self) -> dict[str, dict[str, int]]:
        """Per dataset: tokens, loss tokens and examples this consumer drew, and the epochs of
        the global order wholly dealt before its next position."""
        out = {}
        for d, name in enumerate(self._mix.names):
            out[name] = {"tokens": self._tokens[d], "loss_tokens": self._loss[d],
                         "examples": self._drawn[d],
                         "epochs": self._streams[d].peek() // self._mix.sizes[d]}
        return out

    # ---- state -----------------------------------------------------------------------------

    def get_state(self) -> dict[str, Any]:
        mix = self._mix
        return {"names": list(mix.names), "sizes": list(mix.sizes), "shard": list(mix.shard),
                "worker": list(mix.worker), "streams": [s.to_state() for s in self._streams],
                "examples": list(self._drawn), "tokens": list(self._tokens),
                "loss_tokens": list(self._loss), "mixer": self._mixer.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        check_compatible(self._mix, state)
        self._refs_d, self._refs_i, self._cuts = [], [], []
        self._mixer = ShortfallMixer(self._mix.stages, scale=self._mix.consumer()[1])
        self._drawn = [int(p) for p in state["examples"]]
        saved = consumer_of(tuple(state["shard"]), tuple(state["worker"])[:2])
        if saved != self.consumer():  # nothing drawn (check_compatible): the first state of
            self._streams = [Stream.initial(*self.consumer()) for _ in self._streams]
            self._tokens = [0] * len(self._drawn)  # a worker, which Grain makes unsliced
            self._loss = [0] * len(self._drawn)
            self.reweighted = self._mixer.set_state(state["mixer"])
            return
        self._streams = [Stream.from_state(st) for st in state["streams"]]
        self._tokens = [int(t) for t in state["tokens"]]
        self._loss = [int(t) for t in state["loss_tokens"]]
        self.reweighted = self._mixer.set_state(state["mixer"])

    def install(self, streams: list[Stream], mixer: Mapping[str, Any],
                counters: Mapping[str, Any] | None) -> None:
        """Goes on from a layout's pooled positions (a restore on another host or worker
        count): `streams` per dataset, the run's units drawn so far (`mixer`: sums over the
        old consumers, shared out evenly) from which a new stage of the weights counts, and
        the old consumers' counters (`counters`: one consumer takes them, None elsewhere)."""
        self._streams = [s.clip(lim) for s, lim in zip(streams, self._limits)]
        self._mixer = ShortfallMixer(self._mix.stages, scale=self._mix.consumer()[1])
        self._mixer.resume_at(mixer["consumed"], mixer["total"], mixer["count"])
        self.reweighted = True
        k = len(self._streams)
        counters = counters or {}
        self._drawn = [int(v) for v in counters.get("examples", [0] * k)]
        self._tokens = [int(v) for v in counters.get("tokens", [0] * k)]
        self._loss = [int(v) for v in counters.get("loss_tokens", [0] * k)]
        self._refs_d, self._refs_i, self._cuts = [], [], []

    def __str__(self) -> str:
        return "MixtureIterator"


def check_compatible(mix: Mixture, state: Mapping[str, Any]) -> None:
    """InputError naming the difference when `state` was saved by another mixture's datasets
    (names, their order, sizes) or another shard/worker layout; weights may differ."""
    names, sizes = list(state["names"]), [int(s) for s in state["sizes"]]
    if names != list(mix.names):
        gone = [n for n in names if n not in mix.names]
        new = [n for n in mix.names if n not in names]
        detail = (f"the state has {gone} that the mixture lacks and the mixture has {new} "
                  "that the state lacks") if gone or new else "the same names in another order"
        raise InputError(f"restoring a mixture: its datasets are {list(mix.names)} but the "
                         f"state's are {names} ({detail}); a dataset's id is its position, so "
                         "restore into the same datasets in the same order")
    for name, have, had in zip(names, mix.sizes, sizes):
        if have != had:
            raise InputError(f"restoring a mixture: dataset {name!r} holds {have} examples but "
                             f"held {had} when the state was saved; its positions would "
                             "point at other examples (restore into the same data)")
    if "streams" not in state:
        raise InputError("restoring a mixture: the state was saved by an earlier version of "
                         "seqpack (positions per host shard, no global order); restore it with "
                         "that version, or start the mixture again")
    if not any(int(p) for p in state["examples"]):
        return  # nothing drawn yet (Grain makes its workers' first states unsliced)
    for key, mine in (("shard", mix.shard), ("worker", mix.worker)):
        if [int(v) for v in state[key]][:2] != [int(v) for v in mine]:
            raise InputError(f"restoring a mixture: the state's {key} is {state[key]} but this "
                             f"pipeline's is {list(mine)}; a state restores the same consumer; "
                             "on another host or worker count restore through "
                             "make_training_pipeline, from every host's state "
                             "(docs/training.md, \"Many hosts\")")
