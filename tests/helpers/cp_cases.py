"""Context-parallel attention cases, run in a process of their own with 8 host devices
(`python -m tests.helpers.cp_cases CASE ...`; tests/test_kernels_context_parallel.py runs it).

XLA_FLAGS must give jax its devices before jax is imported, and the rest of the test session
reads jax's local device count, so these cases never run inside the pytest process. A case
name is `<impl>:<C>[:bf16][:rotated|:balanced]` (values and gradients of segment_attention
under shard_map against the unsharded reference, in TE's layout or the one named; "balanced"
passes the ring the batch's positions),
`visits:<impl>:<C>` (the kernels' visit counters against each ring step's schedule, the steps
skipped), `lower:<platform>`, `tinylm:<C>:<normalize>[:tpu]` (the tiny LM over C devices
against its documents trained one by one) or `train:<C>` (a few steps of
examples/train_tiny_lm.py with --context-parallel C). Each passing case prints "ok CASE".
"""

from __future__ import annotations

import os
import sys

# 8 host devices; interpreted kernels can make a rank reach the next ppermute late: its peers
# wait, past XLA's 40 s default before it ends the process
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8"
                           " --xla_cpu_collective_call_terminate_timeout_seconds=300").strip()

import functools  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402
from jax.sharding import AxisType, PartitionSpec  # noqa: E402

from seqpack import kernels, packer  # noqa: E402
from seqpack.kernels import attention, reference  # noqa: E402
from tests.helpers.kernels import key_block_pairs  # noqa: E402

jax.config.update("jax_cpu_enable_async_dispatch", False)  # interpret mode: see helpers.kernels

H, K, D = 2, 1, 32  # grouped-query heads: two query heads share one key/value head
TOL = {"float32": (2e-5, 2e-5), "bfloat16": (3e-2, 3e-2)}
INTERPRET = pltpu.InterpretParams(random_seed=7, uninitialized_memory="nan",
                                  out_of_bounds_reads="raise")
IMPLS = {
    "reference": dict(impl="reference"),
    "tpu": dict(impl="pallas_tpu", interpret=INTERPRET,
                block_sizes=kernels.AttentionBlockSizes(128, 128, 128, 128)),
    "gpu": dict(impl="pallas_gpu", interpret=True,
                block_sizes=kernels.GpuAttentionBlockSizes(16, 16, 16, 16)),
}


def rows(C: int, local: int) -> list[list[tuple[int, int]]]:
    """(offset, length) per row, offsets multiples of 2C (L = C * local): one segment over the
    whole row (every rank holds part of it), many short ones, an empty row, and a mix with
    odd lengths (padding inside spans) and a segment ending at L."""
    L, a = C * local, 2 * C
    short = [(o, 1 + o // a % a) for o in range(0, L, a)][:8]
    mixed = [(0, 3 * a + 1), (4 * a, L // 2 - 4 * a - 3), (L // 2, L // 2)]
    return [[(0, L)], short, [], mixed]


def metadata(segments: list[list[tuple[int, int]]], S: int = 8):
    offsets = np.zeros((len(segments), S), np.int32)
    lengths = np.zeros((len(segments), S), np.int32)
    for r, segs in enumerate(segments):
        offsets[r] = segs[-1][0] + segs[-1][1] if segs else 0
        for j, (o, n) in enumerate(segs):
            offsets[r, j], lengths[r, j] = o, n
    return offsets, lengths


def inputs(C: int, local: int, dtype, segments=None, seed: int = 0, layout: str = "te"):
    """Global-layout q, k, v, cotangent (NaN outside segments) and metadata, and the layout."""
    offsets, lengths = metadata(segments or rows(C, local))
    L = C * local
    outside = np.asarray(reference.segment_index(offsets, lengths, L)) == offsets.shape[1]
    rng = np.random.default_rng(seed)

    def tensor(n, nan=True):
        x = rng.normal(size=(offsets.shape[0], L, n, D)).astype(np.float32)
        return np.where(outside[:, :, None, None] & nan, np.nan, x).astype(dtype)

    order = packer.context_parallel_order(offsets, lengths, seq_len=L, context_parallel=C,
                                          layout=layout)
    return (tensor(H), tensor(K), tensor(K), tensor(H, nan=False), offsets, lengths), order, \
        outside


def permuted(x: np.ndarray, order: np.ndarray) -> np.ndarray:
    return np.take_along_axis(x, order.reshape(*order.shape, *([1] * (x.ndim - 2))), axis=1)


def mesh(C: int):
    return jax.make_mesh((C,), ("cp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:C])


def sharded(fn, C: int, out_specs, *, check_vma: bool = True):
    """fn(q, k, v, offsets, lengths, g, positions) under shard_map: [B, L] arrays split."""
    seq, whole = PartitionSpec(None, "cp"), PartitionSpec()
    return jax.shard_map(fn, mesh=mesh(C), in_specs=(seq, seq, seq, whole, whole, seq, seq),
                         out_specs=out_specs, check_vma=check_vma)


@functools.cache
def cp_value_and_grads(impl: str, C: int, layout: str = "te"):
    """The layout's positions reach the ring only for "balanced" (the others: computed)."""
    def local(q, k, v, offsets, lengths, g, positions):
        f = functools.partial(kernels.segment_attention, segment_offsets=offsets,
                              segment_lengths=lengths, context_parallel_axis="cp",
                              context_parallel_layout=layout,
                              context_parallel_positions=positions if layout == "balanced"
                              else None, **IMPLS[impl])
        o, vjp = jax.vjp(f, q, k, v)
        return (o, *vjp(g))

    # The GPU interpreter's discharge has no rule for values that vary per rank (check_vma);
    # compiled for a GPU, the Triton call lowers either way (case lower:cuda).
    return jax.jit(sharded(local, C, (PartitionSpec(None, "cp"),) * 4,
                           check_vma=impl != "gpu"))


@jax.jit
def unsharded(q, k, v, offsets, lengths, g):
    o, vjp = jax.vjp(lambda q, k, v: reference.segment_attention(q, k, v, offsets, lengths),
                     q, k, v)
    return (o, *vjp(g))


def check_values(impl: str, C: int, dtype=np.float32, local: int = 64, layout: str = "te"
                 ) -> None:
    (q, k, v, g, offsets, lengths), order, outside = inputs(C, local, dtype, layout=layout)
    want = unsharded(q, k, v, offsets, lengths, g)
    want = [permuted(np.asarray(x, np.float32), order) for x in want]
    got = cp_value_and_grads(impl, C, layout)(*(permuted(x, order) for x in (q, k, v)), offsets,
                                               lengths, permuted(g, order), order)
    rtol, atol = TOL[jnp.dtype(dtype).name]
    out = permuted(outside[..., None, None], order)[..., 0, 0]
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
        assert a.dtype == dtype, (name, a.dtype)
        a = np.asarray(a, np.float32)
        assert np.isfinite(a).all(), name
        scale = 1.0 if name == "o" else float(np.abs(b).max())
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol * scale, err_msg=f"{impl} {name}")
        assert np.all(a[out] == 0.0), name  # outside every segment: 0, no gradient


@functools.cache
def counted(impl: str, C: int):
    names = ("ran", "visits_fwd", "visits_dq", "visits_dkv", "lo", "hi", "lo_bwd", "hi_bwd")

    def local_fn(q, k, v, offsets, lengths, g, positions):
        out = attention.visited_block_pairs(q, k, v, offsets, lengths, g,
                                            context_parallel_axis="cp", **IMPLS[impl])
        return {n: out[n][None] for n in names}  # [1, C steps, ...] per rank

    return jax.jit(sharded(local_fn, C, PartitionSpec("cp"), check_vma=impl != "gpu"))


def visits(impl: str, C: int, segments, local: int):
    """Per rank and ring step: the kernels' counters, the schedule and whether the step ran."""
    (q, k, v, g, offsets, lengths), order, _ = inputs(C, local, np.float32, segments)
    out = counted(impl, C)(*(permuted(x, order) for x in (q, k, v)), offsets, lengths,
                           permuted(g, order), order)
    return {n: np.asarray(x) for n, x in out.items()}, offsets, lengths


def needed(offsets, lengths, C: int, local: int, r: int, s: int, block: int) -> np.ndarray:
    """Brute force: bool[B, nq, nk], query block i of rank r holds a query that may see a key
    of key block kb of rank (r - s) % C (same segment, key at or before the query)."""
    L = C * local
    order = packer.context_parallel_order(offsets, lengths, seq_len=L, context_parallel=C)
    ids = np.asarray(reference.segment_index(offsets, lengths, L))
    nb = -(-local // block)
    out = np.zeros((offsets.shape[0], nb, nb), bool)
    for b in range(offsets.shape[0]):
        qp = order[b, r * local : (r + 1) * local]
        kp = order[b, (r - s) % C * local : ((r - s) % C + 1) * local]
        ok = (ids[b, qp][:, None] == ids[b, kp][None, :]) & (ids[b, qp][:, None] < 8)
        ok &= kp[None, :] <= qp[:, None]
        for i, kb in zip(*np.nonzero(ok)):
            out[b, i // block, kb // block] = True
    return out


def check_visits(impl: str, C: int) -> None:
    block = IMPLS[impl]["block_sizes"].block_q
    local = 2 * block
    L = C * local
    mixed, singles = rows(C, local)[1:4:2], [[(o, 1) for o in range(0, L, 2 * C)][:8],
                                             [(0, 1), (2 * C, 1)]]
    # the TPU interpreter runs every step (its barrier, ring.py): the skipping shows on GPU
    for segments, all_run in ((mixed, True), (singles, False))[: 1 if impl == "tpu" else 2]:
        out, offsets, lengths = visits(impl, C, segments, local)
        lo, hi, lo_b, hi_b = out["lo"], out["hi"], out["lo_bwd"], out["hi_bwd"]
        np.testing.assert_array_equal(out["visits_fwd"], np.repeat((hi - lo)[:, :, :, None],
                                                                    H, axis=3))
        np.testing.assert_array_equal(out["visits_dq"], np.repeat((hi_b - lo_b)[:, :, :, None],
                                                                   H, axis=3))
        kb = np.arange(out["visits_dkv"].shape[-1])
        per_key = key_block_pairs(lo_b, hi_b, kb.size, spanned=impl == "gpu")
        np.testing.assert_array_equal(out["visits_dkv"][:, :, :, 0], (H // K) * per_key)
        has_pairs = (hi > lo).any(axis=(2, 3))
        if impl == "tpu":  # the TPU interpreter's barrier: every step runs (ring.py)
            assert out["ran"].all()
            out["ran"] = has_pairs
        np.testing.assert_array_equal(out["ran"], has_pairs)
        for r in range(C):
            for s in range(C):
                need = needed(offsets, lengths, C, local, r, s, block)
                have = (lo[r, s][:, :, None] <= kb) & (kb < hi[r, s][:, :, None])
                assert not (need & ~have).any(), (r, s)  # the schedule covers every pair
        # single tokens: only rank 0 holds them, so one step of C * C runs; mixed rows: all
        assert out["ran"].all() if all_run else out["ran"].sum() == 1, out["ran"]


def check_lowering(platform: str) -> None:
    """The ring lowers for TPU (Mosaic) / CUDA (Triton), forward and backward, with
    check_vma on; one collective permute per K/V pass of each direction."""
    impl = {"tpu": "pallas_tpu", "cuda": "pallas_gpu"}[platform]
    abstract = jax.sharding.AbstractMesh((2,), ("cp",), axis_types=(AxisType.Auto,))
    seq = PartitionSpec(None, "cp")

    def loss(q, k, v, offsets, lengths):
        f = jax.shard_map(functools.partial(kernels.segment_attention, impl=impl,
                                            context_parallel_axis="cp"),
                          mesh=abstract, in_specs=(seq, seq, seq, PartitionSpec(),
                                                   PartitionSpec()), out_specs=seq)
        return f(q, k, v, offsets, lengths).astype(jnp.float32).sum()

    shape = lambda n: jax.ShapeDtypeStruct((2, 512, n, 128), jnp.bfloat16)  # noqa: E731
    meta = jax.ShapeDtypeStruct((2, 4), jnp.int32)
    with jax.sharding.use_abstract_mesh(abstract):
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
            shape(H), shape(K), shape(K), meta, meta).lower(lowering_platforms=(platform,)
                                                             ).as_text()
    call = {"tpu": "tpu_custom_call", "cuda": "xla.gpu.triton"}[platform]
    assert text.count(call) >= 3 and "collective_permute" in text, platform


def check_tiny_lm(C: int, normalize: str, impl: str = "reference") -> None:
    """The tiny LM on rows split over C devices gives each document's loss, the batch loss and
    the gradients of the documents trained one by one (each alone in a row, one device)."""
    import dataclasses

    from examples.tiny_lm import ModelConfig, cp_batch, cp_value_and_grad, init_params, loss_fn

    cfg = ModelConfig(vocab=61, dim=32, heads=2, layers=2, mlp=64, max_len=64)
    if impl == "tpu":
        cfg = dataclasses.replace(cfg, attention_impl="pallas_tpu", attention_interpret=INTERPRET)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, cfg.vocab, int(n)).astype(np.int32) for n in rng.integers(1, 40, 11)]
    params = init_params(jax.random.key(0), cfg)
    rows = packer.pack(docs, packer.PackConfig(64, max_segments=6, context_parallel=C))
    assert rows["tokens"].shape[0] < len(docs)  # really packed
    order = packer.context_parallel_order(rows["tokens_segment_offsets"],
                                          rows["tokens_segment_lengths"], seq_len=64,
                                          context_parallel=C)
    layout = {k: np.take_along_axis(v, order, axis=1) if v.shape[1:] == (64,) else v
              for k, v in rows.items()}
    (loss, (seg, cnt)), grads = jax.jit(cp_value_and_grad(cfg, C, normalize=normalize))(
        params, cp_batch(layout, C))
    alone = packer.pack(docs, packer.PackConfig(64, max_segments=1))
    (want, (seg_u, cnt_u)), want_g = jax.value_and_grad(loss_fn, has_aux=True)(
        params, alone, cfg, normalize=normalize)
    src, seg, cnt = rows["segment_source_index"], np.asarray(seg), np.asarray(cnt)
    for (r, j), e in np.ndenumerate(src):
        if e >= 0:
            i = int(np.flatnonzero(alone["segment_source_index"][:, 0] == e)[0])
            assert cnt[r, j] == cnt_u[i, 0] == len(docs[e]) - 1
            np.testing.assert_allclose(seg[r, j], seg_u[i, 0], rtol=2e-5, atol=1e-5)
    np.testing.assert_allclose(loss, want, rtol=2e-5, atol=1e-6)
    for k in params:
        np.testing.assert_allclose(grads[k], want_g[k], rtol=1e-4, atol=2e-6, err_msg=k)


def check_training(C: int) -> None:
    """examples/train_tiny_lm.py with --context-parallel C: a few steps, the loss falls."""
    from examples.tiny_lm import ModelConfig
    from examples.train_tiny_lm import stdlib_corpus, train

    cfg = ModelConfig(dim=32, heads=2, layers=1, mlp=64, max_len=64)
    losses = train(6, seq_len=64, batch_size=4, model=cfg, examples=stdlib_corpus(200),
                   sft=True, context_parallel=C)
    assert len(losses) == 6 and np.isfinite(losses).all() and losses[-1] < losses[0], losses


def run(case: str) -> None:
    start = time.perf_counter()
    parts = case.split(":")
    if parts[0] == "lower":
        check_lowering(parts[1])
    elif parts[0] == "tinylm":
        check_tiny_lm(int(parts[1]), parts[2], *parts[3:])
    elif parts[0] == "train":
        check_training(int(parts[1]))
    elif parts[0] == "visits":
        check_visits(parts[1], int(parts[2]))
    else:
        dtype = jnp.bfloat16 if "bf16" in parts[2:] else np.float32
        layout = next((x for x in parts[2:] if x in ("rotated", "balanced")), "te")
        check_values(parts[0], int(parts[1]), dtype, layout=layout)
    print("ok", case, f"{time.perf_counter() - start:.1f}s", flush=True)


if __name__ == "__main__":
    for name in sys.argv[1:]:
        run(name)
