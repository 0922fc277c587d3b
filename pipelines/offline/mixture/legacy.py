"""Selection 1, the mixed stream of manifests whose `mixture` names no `selection`: each
dataset's epochs and sample drawn from seeded permutations, the datasets interleaved by the
share of its target each has reached before an example, all in one place (`select`). Runs now
select with `mixture.hashed`; verify recomputes an older run's stream with this."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from seqpack.pipelines.formats.inputs import fingerprint_path
from seqpack.pipelines.offline.mixture.spec import (
    MixSpec,
    Selection,
    epochs_of,
    example_units,
    targets,
)


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


def select(spec: MixSpec, lengths: Sequence[np.ndarray], loss: Sequence[np.ndarray]
           ) -> Selection:
    """The mixed stream of datasets whose examples have `lengths[d]` and loss tokens
    `loss[d]` (see the module docstring); the same for the same inputs and spec, wherever it
    runs. Units, tokens and loss tokens are those the rows keep (`MixSpec.kept`; `loss` counted
    within them)."""
    kept, loss, units = map(list, zip(*(example_units(spec, x, y)
                                        for x, y in zip(lengths, loss))))
    available = [int(u.sum()) for u in units]
    total, wanted = targets(spec, available)
    counts = [int(x.size) for x in lengths]
    firsts = np.concatenate(([0], np.cumsum(counts)))
    parts, keys, entries = [], [], []
    for d, (name, paths) in enumerate(spec.datasets):
        rng = np.random.default_rng([spec.seed, d])
        u, t = units[d], wanted[d]
        epochs, rest = epochs_of(t, available[d])
        picks = [rng.permutation(u.size) for _ in range(epochs)]
        picks.append(_sample(u, rest, rng))
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
            "loss_tokens": int((loss[d] * times).sum()),
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
