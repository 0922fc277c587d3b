"""Vocab-parallel segment_linear_cross_entropy cases, run in a process of their own with 8 host
devices (`python -m tests.helpers.vocab_cases CASE ...`; tests/test_kernels_linear_loss.py runs
it). A case is `<impl>:<P>` (logits, chunked: the gradient-in-forward modes; xla, tpu or gpu:
the recompute mode's implementations), or `<impl>:<P>:unchecked` for a shard_map with
check_vma=False (as many codebases run theirs): the weight's columns split over P devices under
shard_map, the loss, per-segment sums and the gradients of hidden and weight against the
unsharded XLA path and the materialized logits. Each passing case prints "ok CASE".
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402
from jax.sharding import AxisType, PartitionSpec  # noqa: E402

from seqpack import kernels  # noqa: E402
from tests.helpers.kernels import assert_close, case  # noqa: E402
from tests.test_kernels_linear_loss import _args, materialized  # noqa: E402

jax.config.update("jax_cpu_enable_async_dispatch", False)  # interpret mode: see helpers.kernels

BLOCKS = kernels.LinearCrossEntropyBlockSizes(block_tokens=32, block_vocab=128)
IMPLS = {
    "logits": dict(mode="logits"),
    "chunked": dict(mode="chunked", max_logits_bytes=4 * 40 * 64),  # chunks of 128 tokens
    "xla": dict(impl="reference", block_sizes=BLOCKS, mode="recompute"),
    "tpu": dict(impl="pallas_tpu", block_sizes=BLOCKS, mode="recompute",
                interpret=pltpu.InterpretParams(random_seed=7, uninitialized_memory="nan")),
    "gpu": dict(impl="pallas_gpu", interpret=True, mode="recompute",
                block_sizes=kernels.GpuBlockSizes(head_block_tokens=16, head_block_vocab=128,
                                                  head_block_hidden=16)),  # bwd: one chunk
}
OPTIONS = dict(normalize="segments", z_loss=1e-3, logit_softcap=4.0)


def value_and_grads(loss_fn, loss_only: bool = False):
    """Gradients of loss + sum(w * per_segment_loss) (of the loss alone with `loss_only`)."""
    def f(hidden, weight, targets, offsets, lengths, mask, w):
        def objective(hidden, weight):
            out = loss_fn(hidden, weight, targets, offsets, lengths, mask)
            return out[0] + (0.0 if loss_only else jnp.sum(w * out[1])), out[:2]

        return jax.grad(objective, (0, 1), has_aux=True)(hidden, weight)

    return jax.jit(f)


def check(impl: str, P: int, checked: bool = True) -> None:
    rng = np.random.default_rng(P)
    args = _args(rng, *case("mixed"))
    hidden, _, targets, *rest = args
    vocab = 40 * P  # 40 columns a shard: each shard's one block is partial
    weight = np.asarray(rng.normal(size=(hidden.shape[2], vocab)) * 0.5, np.float32)
    args = (hidden, weight, np.where(targets >= 0, targets % vocab, targets), *rest)
    mesh = jax.make_mesh((P,), ("vocab",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:P])
    whole, cols = PartitionSpec(), PartitionSpec(None, "vocab")

    def local(h, w, t, o, n, m):
        return kernels.segment_linear_cross_entropy(h, w, t, o, n, loss_mask=m,
                                                    vocab_axis="vocab", **OPTIONS, **IMPLS[impl])

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(whole, cols) + (whole,) * 4,
                            out_specs=(whole, whole, whole),
                            check_vma=checked and impl != "gpu")
    reference = lambda h, w, t, o, n, m: materialized(  # noqa: E731
        h, w, t, o, n, mask=m, normalize=OPTIONS["normalize"], z_loss=OPTIONS["z_loss"],
        softcap=OPTIONS["logit_softcap"])
    # the gradient-in-forward modes: the loss's gradients from the forward, and with a
    # per-segment cotangent (its recomputing fallback) too
    for loss_only in (False, True) if impl in ("logits", "chunked") else (False,):
        got = value_and_grads(sharded, loss_only)(*args)
        want = value_and_grads(reference, loss_only)(*args)
        (dh, dw), (loss, seg_loss) = jax.tree.map(np.asarray, got)
        (r_dh, r_dw), (r_loss, r_seg_loss) = jax.tree.map(np.asarray, want)
        assert_close(loss, r_loss, jnp.float32)
        assert_close(seg_loss, r_seg_loss, jnp.float32)
        assert_close(dh, r_dh, jnp.float32, "grad")
        assert_close(dw, r_dw, jnp.float32, "grad")

if __name__ == "__main__":
    for name in sys.argv[1:]:
        start = time.perf_counter()
        impl, P, *how = name.split(":")
        check(impl, int(P), checked=how != ["unchecked"])
        print("ok", name, f"{time.perf_counter() - start:.1f}s", flush=True)
