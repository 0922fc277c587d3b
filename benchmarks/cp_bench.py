"""Context parallelism on packed rows: balance of the load-balanced layout, ring steps skipped,
block pairs visited.

    python -m benchmarks.cp_bench                          # chat_dev, stdlib_source; 32k, 128k
    python -m benchmarks.cp_bench --corpora stdlib_source --seq-lens 32768 --ranks 2 4
    python -m benchmarks.cp_bench --layout balanced        # ring pairs in the balanced layout

Each corpus is planned (lengths only) with PackConfig(L, max_segments=L/32, overflow="split",
context_parallel=C), for C in --ranks. Per row, with C ranks:
- work: each rank's causal attention work, per query token the keys of its own segment at or
  before it (packer.rank_work); max/mean over the ranks, in TransformerEngine's load-balanced
  layout (packer.context_parallel_order), in its rotated and balanced variants (layout=) and in
  a contiguous split (rank r: [r L/C, (r+1) L/C)); the mean over rows and the worst row;
- rows, padding: what the 2C alignment costs against packing without it;
- ring steps skipped: of the C x C (rank, step) pairs of a ring, those whose schedule holds no
  block pair, so no kernel runs (kernels/ring.py), in the --layout;
- pairs: (query block, key block) pairs the kernels visit over all ranks and steps (blocks of
  --block tokens: the schedule's ranges, kernels.context_parallel.pair_schedule), against the
  bound: the pairs that hold a (query, key) pair the query may see; and against one device
  computing the whole row with the same blocks (the unsharded schedule's visits).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import corpora
from benchmarks.common import print_table
from seqpack import packer
from seqpack.kernels import attention_schedule as sched
from seqpack.kernels import context_parallel as cp


def plan_rows(lengths: np.ndarray, seq_len: int, context_parallel: int | None):
    """(offsets, lengths) i32[R, S] of the planned rows, S = L / 32."""
    config = packer.PackConfig(seq_len, max_segments=seq_len // 32, overflow="split",
                               context_parallel=context_parallel)
    p = packer.plan(lengths, config)
    R, S = p.num_rows, config.max_segments
    lens = np.zeros((R, S), np.int32)
    lens[p.row, p.slot] = p.length
    offs = np.zeros((R, S), np.int32)
    offs[p.row, p.slot] = p.offset
    used = np.where(lens > 0, offs + lens, 0).max(axis=1, keepdims=True)
    return np.where(lens > 0, offs, used).astype(np.int32), lens


def work_balance(offsets, lengths, seq_len: int, C: int, layout: str | None) -> np.ndarray:
    """max / mean of the ranks' work, per row (rows of no work left out); layout None: a
    contiguous split."""
    work = packer.rank_work(offsets, lengths, seq_len=seq_len, context_parallel=C,
                            balanced=layout is not None,
                            layout=layout or "te").astype(np.float64)
    mean = work.mean(axis=1)
    return work.max(axis=1)[mean > 0] / mean[mean > 0]


@functools.partial(jax.jit, static_argnames=("seq_len", "C", "block"))
def _pair(offsets, lengths, q_pos, k_pos, *, seq_len: int, C: int, block: int):
    """Per row: pairs visited by (a rank's queries at row positions q_pos, another's keys at
    k_pos), pairs needed, whether any."""
    local = seq_len // C
    cfg = sched.AttentionConfig(seq_len=local, heads=1, kv_heads=1, head_dim=1, causal=False,
                                scale=1.0, block_q=block, block_kv=block, block_q_bwd=block,
                                block_kv_bwd=block, interpret=False)
    q = cp.rows_at(offsets, lengths, q_pos, seq_len=seq_len)
    k = cp.rows_at(offsets, lengths, k_pos, seq_len=seq_len)
    s = cp.pair_schedule(q, k, cfg, causal=True)
    visited = jnp.sum(s.hi - s.lo, axis=1)
    a, b = cp.key_bounds(q, k.pos, causal=True)
    nb = cfg.blocks(block)
    sees = (a < b).astype(jnp.int32)
    first, last = jnp.where(sees > 0, a // block, 0), jnp.where(sees > 0, (b - 1) // block + 1, 0)
    rows = jnp.arange(offsets.shape[0])[:, None]
    qb = jnp.arange(local)[None, :] // block
    marks = jnp.zeros((offsets.shape[0], nb, nb + 1), jnp.int32)
    marks = marks.at[rows, qb, first].add(sees).at[rows, qb, last].add(-sees)
    needed = jnp.sum(jnp.cumsum(marks, axis=2)[:, :, :nb] > 0, axis=(1, 2))
    return visited, needed, jnp.any(s.hi > s.lo, axis=1)


@functools.partial(jax.jit, static_argnames=("seq_len", "block"))
def _one_device(offsets, lengths, *, seq_len: int, block: int):
    nb = -(-seq_len // block)
    start, end = sched.token_bounds(offsets, lengths, seq_len, nb * block)
    lo, hi = sched.block_ranges(start, end, block_q=block, block_kv=block, num_q_blocks=nb,
                                causal=True)
    return jnp.sum(hi - lo, axis=1)


def ring_pairs(offsets, lengths, seq_len: int, C: int, block: int, layout: str,
               chunk: int = 16):
    """(visited, needed, steps skipped) summed over rows, and one device's visited pairs; rows
    `chunk` at a time (the last chunk padded with empty rows: one compiled shape)."""
    visited = needed = skipped = single = 0
    for i in range(0, offsets.shape[0], chunk):
        o, n = offsets[i:i + chunk], lengths[i:i + chunk]
        real = o.shape[0]
        o, n = (np.pad(x, ((0, chunk - real), (0, 0))) for x in (o, n))
        pos = packer.context_parallel_order(o, n, seq_len=seq_len, context_parallel=C,
                                            layout=layout).reshape(chunk, C, -1)
        o, n = jnp.asarray(o), jnp.asarray(n)
        single += int(_one_device(o, n, seq_len=seq_len, block=block).sum())
        for r in range(C):
            for s in range(C):
                v, nd, ran = _pair(o, n, pos[:, r], pos[:, (r - s) % C], seq_len=seq_len, C=C,
                                   block=block)
                visited += int(v.sum())
                needed += int(nd.sum())
                skipped += int((~ran[:real]).sum())
    return visited, needed, skipped, single


def _q(x: np.ndarray) -> str:
    return f"{x.mean():.3f} / {x.max():.3f}" if x.size else "-"


def run(name: str, lengths: np.ndarray, seq_len: int, ranks: list[int], block: int,
        layout: str) -> list:
    plain_off, plain_len = plan_rows(lengths, seq_len, None)
    plain_pad = 1 - plain_len.sum() / (plain_len.shape[0] * seq_len)
    out = []
    for C in ranks:
        off, lens = plan_rows(lengths, seq_len, C)
        R = off.shape[0]
        pad = 1 - lens.sum() / (R * seq_len)
        bal, rot, even, cont = (work_balance(off, lens, seq_len, C, x)
                                for x in ("te", "rotated", "balanced", None))
        visited, needed, skipped, single = ring_pairs(off, lens, seq_len, C, block, layout)
        out.append([name, seq_len, C, f"{R} ({plain_off.shape[0]})",
                    f"{pad:.2%} ({plain_pad:.2%})", _q(bal), _q(rot), _q(even), _q(cont),
                    f"{skipped / (R * C * C):.1%}", f"{visited:,}", f"{needed:,}",
                    f"{visited / needed:.3f}", f"{visited / single:.3f}"])
        print(*out[-1], sep=" | ", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpora", nargs="*", default=["chat_dev", "stdlib_source"])
    ap.add_argument("--seq-lens", nargs="*", type=int, default=[32768, 131072])
    ap.add_argument("--ranks", nargs="*", type=int, default=[2, 4, 8])
    ap.add_argument("--block", type=int, default=512, help="query / key block of the pairs")
    ap.add_argument("--layout", choices=["te", "rotated", "balanced"], default="te",
                    help="the layout of the ring pairs")
    a = ap.parse_args()
    rows = []
    for name, lengths in corpora.lengths(a.corpora).items():
        for L in a.seq_lens:
            rows += run(name, lengths, L, a.ranks, a.block, a.layout)
    print_table(
        f"context parallelism: work max/mean (mean over rows / worst row), blocks of {a.block}, "
        f"ring pairs in the {a.layout!r} layout",
        ["corpus", "L", "C", "rows (no CP)", "padding (no CP)", "TE layout work max/mean",
         "rotated max/mean", "balanced max/mean", "contiguous max/mean", "ring steps skipped",
         "pairs visited", "bound", "visited/bound", "visited/1 device"], rows)


if __name__ == "__main__":
    main()
