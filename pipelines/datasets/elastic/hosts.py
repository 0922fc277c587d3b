"""`OnlineHosts`: the top of an online-packing pipeline, whose state restores on any number of
hosts and worker processes.

Its state is the pipeline's (one packer state per worker process, or one), stamped with the
layout that saved it (host h of H, W workers), the steps made and what the run is (`run`: the
data, seed, epochs and packing; another run's state is refused, naming the difference).
`set_state` takes

- its own state, or one of the same host and host count: restored exactly (another worker
  count: that host's consumers' state is merged and dealt to the new workers);
- every host's state of a run on another host count (`{"hosts": [state_0, ..., state_H-1]}`,
  as `read_host_states` reads Orbax's files): merged into one restore state
  (`merge.merge`), of which each new consumer takes its share.

So nothing of the epochs is read twice or skipped, whatever the layouts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import grain

from seqpack.pipelines.datasets.elastic.merge import merge
from seqpack.pipelines.errors import InputError

HOSTS = "hosts"  # the key of every host's state, in process order


class OnlineHosts(grain.IterDataset):
    """Passes its parent (the whole pipeline of online packing) through; see the module
    docstring. `run`: what must be the same for a state to restore (JSON values)."""

    def __init__(self, parent: grain.IterDataset, *, shard_index: int, shard_count: int,
                 workers: int, features: int, datasets: int, mixed: bool,
                 run: dict[str, Any]):
        super().__init__(parent)
        self.host = (int(shard_index), int(shard_count))
        self.workers = int(workers)
        self.features, self.datasets, self.mixed = features, datasets, mixed
        self.run = json.loads(json.dumps(run))  # as a checkpoint holds it

    def __iter__(self) -> OnlineHostsIterator:
        return OnlineHostsIterator(self._parent.__iter__(), self)

    def __str__(self) -> str:
        return f"OnlineHosts(host {self.host[0]} of {self.host[1]}, {self.workers} workers)"


class OnlineHostsIterator(grain.DatasetIterator):
    def __init__(self, parent: grain.DatasetIterator, ds: OnlineHosts):
        super().__init__(parent)
        self._ds = ds
        self._steps = 0
        self._ended = False

    def __next__(self) -> Any:
        try:
            out = next(self._parent)
        except StopIteration:
            self._ended = True
            raise
        self._steps += 1
        return out

    def get_state(self) -> dict[str, Any]:
        ds = self._ds
        return {"online": 1, "run": ds.run, "host": ds.host[0], "hosts": ds.host[1],
                "workers": ds.workers, "steps": self._steps, "ended": self._ended,
                "pipeline": self._parent.get_state()}

    def set_state(self, state: Mapping[str, Any]) -> None:
        ds = self._ds
        h, H = ds.host
        states, every = _host_states(state)
        for k, s in enumerate(states):
            _check_run(s, ds.run, k if every else None)
        if not every:
            s = states[0]
            if (s["host"], s["hosts"]) != (h, H):
                raise ValueError(
                    f"this state was saved by host {s['host']} of {s['hosts']} and is restored "
                    f"as host {h} of {H}: on another host count (or as another host) the "
                    "examples every host held are dealt again, so pass every host's state: "
                    "it.set_state(datasets.read_host_states(checkpoint_dir)), or "
                    "{'hosts': [state_0, ..., state_H-1]} (docs/training.md, \"Many hosts\")")
            mine = s
        else:
            _check_complete(states)
            mine = states[h] if states[0]["hosts"] == H else None
        if mine is not None and mine["workers"] == ds.workers:
            self._parent.set_state(mine["pipeline"])  # the same layout: exact
        else:
            pick = [mine] if mine is not None else states
            consumers = [(c, (s["host"], s["hosts"], w, max(s["workers"], 1)))
                         for s in pick for w, c in enumerate(_worker_states(s))]
            dtypes: dict[str, str] = {}
            for c, _ in consumers:
                dtypes.update(c.get("dtypes", {}))
            restore = merge(consumers, whole=mine is None, features=ds.features,
                            datasets=ds.datasets, mixed=ds.mixed, dtypes=dtypes)
            self._parent.set_state(self._spread(restore))
        self._steps = max(int(s["steps"]) for s in states)
        self._ended = False

    def _spread(self, restore: dict[str, Any]) -> Any:
        """The pipeline state that hands `restore` to every worker process (or the one
        packer)."""
        if not self._ds.workers:
            return restore
        return _with_worker_states(self._parent.get_state(), [restore] * self._ds.workers)

    def __str__(self) -> str:
        return "OnlineHostsIterator"


def _host_states(state: Mapping[str, Any]) -> tuple[list[Mapping[str, Any]], bool]:
    """(the states in `state`, whether they are every host's)."""
    if not isinstance(state, Mapping):
        raise ValueError(f"state={type(state).__name__} must be a dict: this pipeline's state, "
                         "or {'hosts': [...]}, every host's")
    if HOSTS in state and "online" not in state:
        states = list(state[HOSTS])
        if not states:
            raise ValueError("state={'hosts': []} holds no host's state")
        return states, True
    return [state], False


def _check_run(state: Mapping[str, Any], run: Mapping[str, Any], host: int | None) -> None:
    """InputError naming the first difference between the run that saved `state` and this."""
    where = "the state" if host is None else f"host state {host}"
    if isinstance(state, Mapping) and "packing" in state and "shard_count" in state:
        raise InputError(f"{where} was saved by an earlier version of seqpack (online packing "
                         "per host shard); restore it with that version, or start again")
    if not isinstance(state, Mapping) or "online" not in state:
        keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise InputError(f"{where} is not a state of online packing (keys: {keys}); "
                         "restore the state this pipeline's iterator saved")
    saved = state["run"]
    for key in sorted(set(saved) | set(run)):
        if _in_order(saved.get(key)) != _in_order(run.get(key)):
            raise InputError(f"{where} was saved by another run: its {key} is "
                             f"{saved.get(key)!r}, this pipeline's {run.get(key)!r}; restore "
                             "into a pipeline over the same data, seed, epochs and packing")


def _in_order(value: Any) -> Any:
    """A run's field compared with its order (a mixture's datasets: name -> size, in order)."""
    return list(value.items()) if isinstance(value, Mapping) else value


def _check_complete(states: list[Mapping[str, Any]]) -> None:
    """ValueError naming the host that is missing, repeated, or of another step or run."""
    H = states[0]["hosts"]
    for k, s in enumerate(states):
        if s["hosts"] != H:
            raise ValueError(f"host state {k} was saved by a run of {s['hosts']} hosts, host "
                             f"state 0 by a run of {H}: pass the states of one checkpoint")
    have = sorted(s["host"] for s in states)
    if have != list(range(H)):
        missing = sorted(set(range(H)) - set(have))
        twice = sorted({x for x in have if have.count(x) > 1})
        raise ValueError(f"the states of a run of {H} hosts must hold each host once: "
                         f"missing {missing}, repeated {twice}")
    steps = {s["steps"] for s in states if not s.get("ended")}  # an ended host stopped early
    if len(steps) > 1 or steps and any(s["steps"] > max(steps) for s in states):
        first = {s["host"]: s["steps"] for s in states}
        raise ValueError(f"the hosts' states were saved at different steps ({first}): pass "
                         "the states of one checkpoint")
    states.sort(key=lambda s: s["host"])


def grain_worker_states(pipe: Mapping[str, Any]) -> dict[int, Any] | None:
    """worker -> its state, of a state Grain's worker processes saved (its interleave of them,
    or its earlier multiprocess prefetch); None for a state saved without them."""
    if "iterators_in_use_states" in pipe:
        out = dict(zip(pipe["iterators_in_use_indices"], pipe["iterators_in_use_states"]))
        out.update((int(i), s) for i, s in pipe.get("future_states", {}).items())
        return out
    if "workers_state" in pipe:
        return {int(i): s for i, s in pipe["workers_state"].items()}
    return None


def _worker_states(state: Mapping[str, Any]) -> list[Any]:
    """Every worker's packer state of a host state (the one packer without workers)."""
    pipe = state["pipeline"]
    if not state["workers"]:
        return [pipe]
    found = grain_worker_states(pipe)
    if found is None:
        raise ValueError(f"a worker-process state of an unknown form (keys {sorted(pipe)}); "
                         f"this version of Grain ({grain.__version__}) is not supported")
    return [found.get(i) for i in range(state["workers"])]


def _with_worker_states(template: Mapping[str, Any], states: list[Any]) -> dict[str, Any]:
    """A state of Grain's worker processes (the form of `template`) with `states`, the
    workers starting afresh in order."""
    W = len(states)
    if "iterators_in_use_states" in template:
        return {"next_index_in_cycle": 0, "next_index_in_datasets": W,
                "iterators_in_use_indices": list(range(W)),
                "iterators_in_use_states": list(states), "exhausted": [0] * W,
                "future_states": {}}
    if "workers_state" in template:
        return {"workers_state": {str(i): s for i, s in enumerate(states)},
                "iterations_to_skip": {str(i): 0 for i in range(W)},
                "last_worker_index": -1}
    raise ValueError(f"a worker-process state of an unknown form (keys {sorted(template)}); "
                     f"this version of Grain ({grain.__version__}) is not supported")
