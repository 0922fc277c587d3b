"""A mixture's weights in every batch (issue 55's cases), on the shared corpora: per batch of 64
rows x 4096 tokens, each dataset's share (p5 / p95 / worst over batches) against its weight.

Datasets (``../shared/data``):

    tiny:  gsm8k_train's token stream cut into slices of 8-56 tokens (mean 32)
    chat:  chat_dev examples, each cut at 2,048 tokens (mean ~380: 12x tiny)
    long:  chat_dev examples concatenated 6 at a time, cut at 4,096 (mean ~2,100)
    sft / sft_long: chat_sft_dev as chat / long, with labels (-100 on each prompt)

Online cases: `Mixture` + `PackIterDataset(PackConfig(4096, max_segments=256))` (0 worker
processes) or `make_training_pipeline(..., batch=64, prefetch=Prefetch(worker_count=2))`;
`repeat` with 2,000 tiny slices (repeated > 20 times), `stop` and `continue` to the end of
tiny's one epoch (continue: the others go on renormalized; the batch where tiny leaves is
left out), three datasets, units tokens and loss tokens; a resume at batch 4 + 17 rows under
edited weights. Offline cases: `seqpack pack --mix ... --batch-size 64` (and
`--data-parallel 2 --batch-size 32`) against the plain shuffle, per step of 64 rows.

    python -m benchmarks.mixture_batches                 # about 2 minutes on 2 cores
    python -m benchmarks.mixture_batches --batches 16    # quicker
    python -m benchmarks.mixture_bench --cases ...       # the same
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.common import DATA, print_table
from seqpack.packer import PackConfig
from seqpack.packer.mixing import carries_loss, row_units, slot_counts
from seqpack.pipelines.datasets import (
    ArraySource,
    Columns,
    Mixture,
    PackIterDataset,
    Prefetch,
    make_training_pipeline,
)

L, B = 4096, 64


def _load(name: str) -> dict[str, np.ndarray]:
    if not (DATA / f"{name}.npz").is_file():
        raise SystemExit(f"Error: {DATA / name}.npz not found (the shared corpora, "
                         "../shared/data from the repository root)")
    return dict(np.load(DATA / f"{name}.npz"))


def _ragged(values: np.ndarray, starts: np.ndarray, lengths: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets) of the documents values[starts[i] : starts[i] + lengths[i]]."""
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    at = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1])
    return values[at], offsets


def _docs(z: dict, first: int, last: int, group: int, cut: int) -> tuple[np.ndarray, ...]:
    """(starts, lengths) of documents made of `group` consecutive examples in [first, last),
    cut at `cut` tokens."""
    o = z["offsets"].astype(np.int64)
    k = (last - first) // group
    starts = o[first:first + k * group:group]
    ends = o[first + group:first + k * group + 1:group]
    return starts, np.minimum(ends - starts, cut)


def source(doc: tuple) -> ArraySource:
    """An ArraySource of (values, offsets[, labels])."""
    if len(doc) == 2:
        return ArraySource.from_ragged(*doc)
    values, offsets, labels = doc
    return ArraySource({"tokens": (values, offsets), "labels": (labels, offsets)},
                       value_columns=["labels"])


def datasets() -> dict[str, tuple]:
    """name -> (values, offsets) or (values, offsets, labels)."""
    gsm, chat, sft = _load("gsm8k_train"), _load("chat_dev"), _load("chat_sft_dev")
    rng = np.random.default_rng(0)
    n = gsm["tokens"].size
    lengths = rng.integers(8, 57, n // 8)
    lengths = lengths[: np.searchsorted(np.cumsum(lengths), n)]
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    out = {"tiny": _ragged(gsm["tokens"].astype(np.int32), starts, lengths)}
    half = chat["offsets"].size // 2
    for name, (first, last, group, cut) in {"chat": (0, half, 1, 2048),
                                            "long": (half, 2 * half - 1, 6, L)}.items():
        out[name] = _ragged(chat["tokens"].astype(np.int32),
                            *_docs(chat, first, last, group, cut))
    # SFT: labels -100 on every example's prompt
    o = sft["offsets"].astype(np.int64)
    pos = np.arange(o[-1]) - np.repeat(o[:-1], np.diff(o))
    labels = np.where(pos < np.repeat(sft["prompt_lengths"], np.diff(o)), -100,
                      sft["tokens"].astype(np.int64))
    for name, (first, last, group, cut) in {"sft": (0, half, 1, 2048),
                                            "sft_long": (half, 2 * half - 1, 6, L)}.items():
        starts, lengths = _docs(sft, first, last, group, cut)
        values, offsets = _ragged(sft["tokens"].astype(np.int32), starts, lengths)
        lab, _ = _ragged(labels, starts, lengths)
        out[name] = (values, offsets, lab)
    return out


def _row_units(rows: dict[str, np.ndarray], K: int, unit: str) -> np.ndarray:
    """f64[R, K]: each row's units per dataset (loss tokens from `labels`)."""
    n, loss = rows["tokens_segment_lengths"], None
    if unit == "loss_tokens":
        marks = carries_loss([(rows["labels"], "labels")], rows["tokens"].shape)
        loss = slot_counts(marks, rows["tokens_segment_offsets"], n)
    return row_units(unit, rows["segment_dataset_id"], n, rows["segment_source_start"],
                     num_datasets=K, loss=loss).astype(float)


def _stack(rows: list[dict]) -> dict[str, np.ndarray]:
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def _online(src: dict, weights: dict, policy: str, unit: str, batches: int, workers: int,
            switch: tuple | None = None) -> np.ndarray:
    """f64[batches, K]: units per dataset per batch (`switch`: (units, weights) of a
    schedule's second stage)."""
    K = len(src)
    stages = {"weights": weights} if switch is None else {"schedule": [
        (0, weights), (switch[0], dict(zip(src, switch[1])))]}
    mix = Mixture(src, **stages, unit=unit, on_exhausted=policy, seed=0,
                  labels="labels" if unit == "loss_tokens" else None)
    columns = Columns(labels=["labels"]) if unit == "loss_tokens" else Columns()
    pack = PackConfig(L, max_segments=256)
    per = []
    if workers:
        ds = make_training_pipeline(mix, pack=pack, batch=B, shuffle_seed=0, num_epochs=None,
                                    columns=columns, prefetch=Prefetch(worker_count=workers))
        for _, batch in zip(range(batches), iter(ds)):
            per.append(_row_units(batch, K, unit).sum(0))
    else:
        it = iter(PackIterDataset(mix, pack, columns=columns))
        rows: list[dict] = []
        for row in it:
            rows.append(row)
            if len(rows) == B:
                per.append(_row_units(_stack(rows), K, unit).sum(0))
                rows = []
                if len(per) == batches:
                    break
    return np.array(per)


def _stages(units: np.ndarray, weights: list[float]) -> tuple[np.ndarray, list[int]]:
    """(bool[batches, K]: the datasets still in the mixture per batch, batches left out).
    `continue`: a dataset has left once its share falls under a quarter of its weight; the
    batch in which the set changes is left out, and so are those with one dataset left."""
    share = units / units.sum(1, keepdims=True)
    active = share >= np.asarray(weights) / 4
    change = [b for b in range(len(units) - 1) if (active[b] != active[b + 1]).any()]
    single = np.flatnonzero(active.sum(1) < 2).tolist()
    return active, sorted(set(change) | set(single))


def _rows_of_case(name: str, units: np.ndarray, weights: list[float], *,
                  leaving: bool = False, switch: tuple | None = None) -> list[list[object]]:
    active, skip = _stages(units, weights) if leaving else (units >= 0, [])
    target = np.broadcast_to(np.asarray(weights), units.shape)
    if switch is not None:  # the batch whose units cross the switch holds both stages: left out
        at = int(np.searchsorted(np.cumsum(units.sum(1)), switch[0], side="right"))
        target = np.where(np.arange(len(units))[:, None] < at, target, np.asarray(switch[1]))
        skip = [at]
    keep = np.setdiff1d(np.arange(len(units)), skip)
    u = units[keep]
    w = np.where(active[keep], target[keep], 0.0)
    w = w / w.sum(1, keepdims=True)  # renormalized over the datasets still there (continue)
    share = u / u.sum(1, keepdims=True)
    off = 100 * (share - w)  # points off the batch's target, signed
    dev = np.abs(off)
    within = 100 * np.mean(dev.max(1) <= 2)
    run = units.sum(0) / units.sum()
    out = []
    for k, wk in enumerate(weights):
        after = "" if switch is None else f" -> {switch[1][k]:.2f}"
        out.append([name if k == 0 else "", len(u), f"{wk:.2f}{after}",
                    "-" if leaving or switch else f"{run[k]:.4f}",
                    f"{np.percentile(off[:, k], 5):+.1f}", f"{np.percentile(off[:, k], 95):+.1f}",
                    f"{off[np.argmax(dev[:, k]), k]:+.1f}",
                    f"{np.percentile(dev.max(1), 95):.1f}" if k == 0 else "",
                    f"{within:.0f}%" if k == 0 else ""])
    return out


def _resume(src: dict, batches: int) -> list[object]:
    """Share of `tiny` per batch after a restore at batch 4 + 17 rows, 0.5/0.5 -> 0.2/0.8."""
    make = lambda w: PackIterDataset(  # noqa: E731
        Mixture(src, weights=w, on_exhausted="repeat", seed=0), PackConfig(L, max_segments=256))
    it = iter(make({"tiny": 0.5, "long": 0.5}))
    for _ in range(4 * B + 17):
        next(it)
    resumed = iter(make({"tiny": 0.2, "long": 0.8}))
    resumed.set_state(it.get_state())
    rows = [next(resumed) for _ in range(batches * B)]
    units = _row_units(_stack(rows), 2, "tokens").reshape(batches, B, 2).sum(1)
    tiny = units[:, 0] / units.sum(1)
    late = np.flatnonzero(np.abs(tiny - 0.2) > 0.02)
    holds_from = 1 if not late.size else int(late.max()) + 2
    return [" ".join(f"{s:.3f}" for s in tiny), holds_from]


def _parquet(path: str, doc: tuple) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    values, offsets = doc[:2]
    pq.write_table(pa.table({"tokens": pa.ListArray.from_arrays(
        pa.array(offsets.astype(np.int32)), pa.array(values.astype(np.int32)))}), path)
    return path


def _offline(d: str, files: dict[str, str], weights: dict, *more: object) -> np.ndarray:
    """f64[steps, K]: tokens per dataset per step of 64 rows of `seqpack pack --mix`."""
    from seqpack.pipelines.offline.shards import read_shard

    out = f"{d}/out"
    mix = [a for name, path in files.items() for a in ("--mix", f"{name}={path}")]
    subprocess.run([sys.executable, "-m", "seqpack.cli", "pack", *mix, "--weights",
                    ",".join(f"{k}={v}" for k, v in weights.items()), "--seq-len", str(L),
                    "--max-segments", "256", "--workers", "2", "--mix-tokens", "12000000",
                    "-o", out, "--overwrite", *map(str, more)],
                   check=True, capture_output=True, text=True)
    m = json.loads(open(f"{out}/manifest.json").read())
    shards = [read_shard(out, n) for n in m["shards"]]
    rows = {k: np.concatenate([s[k] for s in shards]) for k in shards[0]}
    u = _row_units(rows, len(files), "tokens")
    steps = len(u) // B
    return u[:steps * B].reshape(steps, B, -1).sum(1)


ONLINE = {  # name: (datasets, weights, on_exhausted, unit, workers[, switch])
    "tiny vs chat, repeat (2,000 tiny slices)": (("tiny2k", "chat"), (.5, .5), "repeat",
                                                 "tokens", 0),
    "tiny vs chat, repeat, 2 worker processes": (("tiny2k", "chat"), (.5, .5), "repeat",
                                                 "tokens", 2),
    "tiny vs chat, stop (tiny's one epoch)": (("tiny", "chat"), (.2, .8), "stop", "tokens", 0),
    "three: tiny / chat / long, stop": (("tiny", "chat", "long"), (.2, .3, .5), "stop",
                                        "tokens", 0),
    "three: tiny / chat / long, continue": (("tiny", "chat", "long"), (.2, .3, .5), "continue",
                                            "tokens", 0),
    "sft vs sft_long, loss tokens, repeat": (("sft", "sft_long"), (.3, .7), "repeat",
                                             "loss_tokens", 0),
    # a schedule: the second stage from 12.5 batches' tokens on
    "three, schedule: .2/.3/.5 -> .5/.3/.2": (("tiny", "chat", "long"), (.2, .3, .5), "repeat",
                                              "tokens", 0, (25 * B * L // 2, (.5, .3, .2))),
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=32, help="batches per online case (at most)")
    ap.add_argument("--no-offline", action="store_true")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    data = datasets()
    data["tiny2k"] = (data["tiny"][0], data["tiny"][1][:2001])
    means = {k: np.diff(v[1]).mean() for k, v in data.items()}
    print("documents: " + ", ".join(f"{k} {len(v[1]) - 1:,} (mean {means[k]:.0f})"
                                    for k, v in data.items()))
    header = ["case", "batches / steps", "weight", "run share", "p5 (pts off)", "p95", "worst",
              "worst dataset: p95 (pts)", "batches within 2 pts"]
    table = []
    for name, (names, weights, policy, unit, workers, *switch) in ONLINE.items():
        src = {n: source(data[n]) for n in names}
        at = switch[0] if switch else None
        units = _online(src, dict(zip(names, weights)), policy, unit, a.batches, workers, at)
        table += _rows_of_case(name, units, list(weights), leaving=policy == "continue",
                               switch=at)
    print_table(f"Online, per batch of {B} x {L} tokens (share of each dataset, in the unit)",
                header, table)
    print_table("Resume at batch 4 + 17 rows, tiny / long 0.5 / 0.5 -> 0.2 / 0.8 (repeat)",
                ["share of tiny in batches 1..6 after the restore", "holds from batch"],
                [_resume({"tiny": source(data["tiny"]), "long": source(data["long"])}, 6)])
    if not a.no_offline:
        with tempfile.TemporaryDirectory() as d:
            files = {n: _parquet(f"{d}/{n}.parquet", data[n]) for n in ("tiny", "chat")}
            w = {"tiny": 0.3, "chat": 0.7}
            table = []
            for name, more in {"--row-order shuffle (no steps)": (),
                               "--batch-size 64": ("--batch-size", 64),
                               "--data-parallel 2 --batch-size 32": ("--data-parallel", 2,
                                                                     "--batch-size", 32)
                               }.items():
                table += _rows_of_case(name, _offline(d, files, w, *more), [.3, .7])
            print_table(f"Offline, `seqpack pack --mix tiny=... --mix chat=... --weights "
                        f"tiny=0.3,chat=0.7 --mix-tokens 12000000`, per step of {B} rows",
                        header, table)
    print(f"\n{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
