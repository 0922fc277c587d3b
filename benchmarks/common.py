"""Benchmark helpers: load the shared corpora (or a synthetic one), time calls, print tables,
read the attention kernels' block-size options (one syntax for every benchmark)."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

LOSS_HEAD_PRESETS = {  # name -> (N tokens, H, V): the loss head's sizes in the issues
    "16k": (16384, 4096, 128256),
    "8k": (8192, 2048, 256000),
    "64k": (65536, 4096, 128256),
    "gemma": (8192, 2304, 256000),  # the GPU issue's second size (Gemma-2 2B's head)
}
DATA = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data"


def pin_one_core() -> str:
    """Pins this process to one CPU core (the anchors are one-core figures); returns a note."""
    try:
        core = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {core})
        return f"pinned to core {core}"
    except (AttributeError, OSError):  # not on Linux
        return "not pinned"


def corpora(names: list[str] | None = None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{name: (tokens, offsets)} from ../shared/data/*.npz, or a synthetic lognormal corpus."""
    out = {}
    paths = sorted(DATA.glob("*.npz")) if DATA.is_dir() else []
    for p in paths:
        if names and p.stem not in names:
            continue
        z = np.load(p)
        out[p.stem] = (z["tokens"], z["offsets"].astype(np.int64))
    if not out:
        rng = np.random.default_rng(0)
        lengths = np.clip(rng.lognormal(5.6, 0.7, 30_000).astype(np.int64), 1, 9_000)
        offsets = np.zeros(lengths.size + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = rng.integers(0, 30_000, int(offsets[-1]), dtype=np.uint16)
        out["synthetic_lognormal"] = (tokens, offsets)
    return out


def packed_rows(path, seq_len: int, limit: int | None = None):
    """(offsets, lengths) i32[R, S] of a token corpus (.npz: tokens, offsets) packed at
    L = seq_len by seqpack.packer (best-fit decreasing, long examples split; S = L / 32)."""
    from seqpack.packer import PackConfig, pack_ragged

    z = np.load(path)
    tokens, offsets = z["tokens"], z["offsets"].astype(np.int64)
    if limit:
        limit = min(limit, offsets.size - 1)
        tokens, offsets = tokens[: offsets[limit]], offsets[: limit + 1]
    cfg = PackConfig(seq_len, max_segments=max(seq_len // 32, 1), overflow="split")
    batch = pack_ragged(tokens, offsets, cfg)
    return batch["tokens_segment_offsets"], batch["tokens_segment_lengths"]


def picked_rows(path, seq_len: int, batch: int, limit: int | None = None):
    """(row indices, offsets, lengths) of `batch` packed rows drawn with seed 0: the rows every
    attention benchmark times (attention_bench and torch_peers alike)."""
    offsets, lengths = packed_rows(path, seq_len, limit)
    pick = np.sort(np.random.default_rng(0).choice(len(offsets), batch, replace=False))
    return pick, offsets[pick], lengths[pick]


def file_at(rev: str, path: str, into: pathlib.Path) -> pathlib.Path:
    """Repository file `path` as of git revision `rev`, written to `into` (a baseline module
    to load beside this tree's, in the same seqpack)."""
    import subprocess

    root = pathlib.Path(__file__).resolve().parents[1]
    into.write_text(subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root,
                                   capture_output=True, text=True, check=True).stdout)
    return into


def best_time(fn: Callable[[], object], repeats: int = 3) -> tuple[float, object]:
    """Runs fn once to warm up, then `repeats` times; returns (best seconds, last result)."""
    result = fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def print_table(title: str, header: list[str], rows: list[list[object]]) -> None:
    cells = [[str(c) for c in r] for r in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(cells[0], widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells[1:]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")


def fmt_rate(x: float) -> str:
    if x >= 1e6:
        return f"{x / 1e6:.1f}M"
    if x >= 1e3:
        return f"{x / 1e3:.0f}k"
    return f"{x:.0f}"


BLOCK_OPTIONS = (
    "'+'-joined: b<fwd>[/<bwd>] (query and key blocks of each pass, e.g. b512 or b1024/512), "
    "b<q>,<kv>,<q_bwd>,<kv_bwd> (each block); TPU kernels: fused / unfused (fused_bwd), w<N> "
    "(narrow_steps N), wfull (no narrow grid); GPU kernels: warps<N>, stages<N>")


def attention_blocks(spec: str | Sequence[str], base: Any) -> Any:
    """Block-size options (BLOCK_OPTIONS) applied to `base` (an AttentionBlockSizes or
    GpuAttentionBlockSizes, its other fields kept); ValueError naming an option that does not
    fit its class. A bare "<q>,<kv>,<q_bwd>,<kv_bwd>" is the same as with its "b"."""
    opts = spec.split("+") if isinstance(spec, str) else list(spec)
    fields = {f.name for f in dataclasses.fields(base)}
    words = {"fused": ("fused_bwd", True), "unfused": ("fused_bwd", False),
             "wfull": ("narrow_steps", None)}
    for opt in opts:
        four = re.fullmatch(r"b?(\d+),(\d+),(\d+),(\d+)", opt)
        two = re.fullmatch(r"b(\d+)(?:/(\d+))?", opt)
        count = re.fullmatch(r"(w|warps|stages)(\d+)", opt)
        if four:
            q, kv, qb, kvb = map(int, four.groups())
        elif two:
            q = kv = int(two.group(1))
            qb = kvb = int(two.group(2) or two.group(1))
        change: dict[str, Any] = {}
        if four or two:
            change = dict(block_q=q, block_kv=kv, block_q_bwd=qb, block_kv_bwd=kvb)
        elif opt in words:
            change = dict([words[opt]])
        elif count:
            name = {"w": "narrow_steps", "warps": "num_warps", "stages": "num_stages"}
            change = {name[count.group(1)]: int(count.group(2))}
        if not change or not set(change) <= fields:
            raise ValueError(f"unknown option {opt!r} for {type(base).__name__} in "
                             f"{'+'.join(opts)!r}: {BLOCK_OPTIONS}")
        base = dataclasses.replace(base, **change)
    return base
