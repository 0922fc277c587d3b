"""The loss head's benchmarks (benchmarks/loss_head.py, grad_accumulation.py) on CPU: every path
runs and agrees, the rows named and labelled by the loss head's plan, a float32 master weight,
the least-free-memory bisection, and the d-weight carry's error."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import grad_accumulation, loss_head
from benchmarks.kernels_bench import MIB
from seqpack import kernels


@pytest.mark.slow
def test_benchmark_smoke():
    """benchmarks/loss_head.py --smoke: every path runs, timed and measured, on CPU."""
    rows = loss_head.main(["--smoke", "--repeats", "1"])
    assert {"materialized", "vocab tiling", "seqpack auto", "seqpack recompute"} <= set(rows)
    assert all(np.isfinite(r["ms"]) and r["temp"] > 0 for r in rows.values())
    assert all(r["err"] < 1e-5 for r in rows.values())  # f32: every path's loss and gradients
    assert all(r["need"] is None for r in rows.values())  # no --need (and no CPU statistics)


@pytest.mark.slow  # ~7-11 s on 2 cores: the README's run stays short
def test_benchmark_reads_a_float32_master_weight():
    """--weight-dtype float32 beside bf16 hidden: every path takes the f32 weight (read cast to
    bf16, as MaxText's layers) and agrees with materialized logits within bf16 rounding, the
    --bf16-carry rows (d weight carried in bf16) too."""
    rows = loss_head.main(["--tokens", "512", "--dim", "64", "--vocab", "1000", "--repeats", "1",
                           "--weight-dtype", "float32", "--chunks", "256", "--bf16-carry"])
    assert {"materialized", "vocab tiling", "seqpack C=256", "seqpack recompute",
            "seqpack auto dw bf16", "seqpack C=256 dw bf16"} <= set(rows)
    assert all(np.isfinite(r["ms"]) and r["err"] < 2e-2 for r in rows.values())
    assert all(r["dw_dtype"] == np.float32 for r in rows.values())


def test_rows_are_labelled_by_the_plan():
    """A seqpack row's mode column is kernels.loss_head_plan's for its size and options, taken
    when the row is traced: at the smoke size a quarter of the logits is below the least chunk
    (recompute), C=256 is two chunks, and auto's share of the CPU's default free memory holds
    all logits."""
    n, dim, vocab = loss_head.SMOKE
    fns = loss_head.loss_head_fns(n, vocab, jnp.float32, chunks=(256,))
    spec = (jax.ShapeDtypeStruct((1, n, dim), jnp.float32),
            jax.ShapeDtypeStruct((dim, vocab), jnp.float32),
            jax.ShapeDtypeStruct((1, n), jnp.int32), jax.ShapeDtypeStruct((1, 4), jnp.int32),
            jax.ShapeDtypeStruct((1, 4), jnp.int32))
    labels = {}
    for name, (f, note) in fns.items():
        if name.startswith("seqpack"):
            assert format(note, "") == "?"  # set when traced
            jax.eval_shape(f, *spec)
            labels[name] = format(note, "")
    assert labels == {"seqpack auto": "logits", "seqpack 1/4 budget": "recompute",
                      "seqpack recompute": "recompute", "seqpack C=256": "chunked C=256"}
    quarter = n * vocab * 4 // 4
    assert kernels.loss_head_plan(n, vocab, max_logits_bytes=quarter).mode.value == "recompute"


def test_least_free_bytes_bisects_on_a_ballast():
    """--need: the least free memory a call runs in, on a simulated device of 10 GiB where the
    call needs 3,000 MiB beside its ballast: found within the step, from the free memory read
    beside the largest ballast that ran; another error than out-of-memory is raised."""
    limit, need, held = 10 << 30, 3000 * MIB, []

    def free():
        return limit - sum(held)

    def allocate(size):
        if size > free():
            raise RuntimeError("RESOURCE_EXHAUSTED: Attempting to allocate")
        held.append(size)
        return Ballast(size)

    class Ballast:  # released when deleted, as a device buffer
        def __init__(self, size):
            self.size = size

        def __del__(self):
            held.remove(self.size)

    def call():
        if free() < need:
            raise RuntimeError("RESOURCE_EXHAUSTED: Attempting to reserve")
        return 0

    found = loss_head.least_free_bytes(call, step=64 * MIB, free=free, allocate=allocate)
    assert need <= found <= need + 64 * MIB and held == []
    assert loss_head.least_free_bytes(call, free=lambda: None, allocate=allocate) is None

    def broken():
        raise RuntimeError("INVALID_ARGUMENT")

    with pytest.raises(RuntimeError, match="INVALID_ARGUMENT"):
        loss_head.least_free_bytes(broken, free=free, allocate=allocate)


def test_benchmark_runs_the_paths_named(capsys):
    """--paths: only the rows named, in that order; --profile: each one's device time by op
    after the table."""
    rows = loss_head.main(["--smoke", "--repeats", "1", "--chunks", "256", "--profile",
                           "--paths", "seqpack C=256", "vocab tiling"])
    assert list(rows) == ["seqpack C=256", "vocab tiling"]
    out = capsys.readouterr().out
    assert out.index("profile: seqpack C=256") < out.index("profile: vocab tiling")
    assert out.count("all device ops") == 2
    with pytest.raises(SystemExit, match="unknown --paths"):
        loss_head.main(["--smoke", "--repeats", "0", "--paths", "seqpack C=256"])


@pytest.mark.slow
def test_grad_accumulation_benchmark():
    """benchmarks/grad_accumulation.py: a float32 carry costs one rounding whatever the chunks;
    a bf16 carry's error grows with the chunk count, and bf16 chunk gradients cost more still."""
    few, many = grad_accumulation.main(["--smoke"])
    assert many["chunks"] > few["chunks"]
    assert abs(few["f32 carry"] - many["f32 carry"]) < 0.05 * few["f32 carry"]
    assert few["f32 carry"] < few["bf16 carry"] < many["bf16 carry"]
    assert many["bf16 carry"] > 2 * many["f32 carry"]
    assert all(r["bf16 chunk gradients"] >= r["bf16 carry"] for r in (few, many))

