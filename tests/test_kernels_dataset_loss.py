"""segment_dataset_loss: per-dataset loss sums and tokens against an independent numpy sum."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from seqpack import kernels


def _case(seed: int, B=4, S=6, K=3):
    rng = np.random.default_rng(seed)
    ids = rng.integers(-1, K, (B, S)).astype(np.int32)
    tokens = np.where(ids >= 0, rng.integers(0, 50, (B, S)), 0).astype(np.int32)
    loss = np.where(ids >= 0, rng.random((B, S)) * tokens, 0).astype(np.float32)
    loss[ids < 0] = np.nan  # unused slots never leak into a sum, whatever they hold
    return loss, tokens, ids


def _numpy(loss, tokens, ids, K):
    sums, counts = np.zeros(K, np.float64), np.zeros(K, np.int64)
    for b, s in zip(*np.nonzero(ids >= 0)):
        sums[ids[b, s]] += loss[b, s]
        counts[ids[b, s]] += tokens[b, s]
    return sums, counts


@pytest.mark.parametrize("seed", range(3))
def test_matches_an_independent_numpy_sum(seed):
    loss, tokens, ids = _case(seed)
    got_loss, got_tokens = kernels.segment_dataset_loss(loss, tokens, ids, num_datasets=3)
    want_loss, want_tokens = _numpy(loss, tokens, ids, 3)
    np.testing.assert_allclose(np.asarray(got_loss), want_loss, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(got_tokens), want_tokens)
    assert got_loss.dtype == jnp.float32 and got_tokens.dtype == jnp.int32


def test_under_shard_map_psums_to_the_global_figure():
    loss, tokens, ids = _case(7, B=len(jax.devices()) * 2)
    mesh = Mesh(np.array(jax.devices()), ("data",))

    def local(lo, to, i):
        s, n = kernels.segment_dataset_loss(lo, to, i, num_datasets=3)
        return jax.lax.psum(s, "data"), jax.lax.psum(n, "data")

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"),) * 3, out_specs=(P(), P())))
    got_loss, got_tokens = f(loss, tokens, ids)
    want_loss, want_tokens = _numpy(loss, tokens, ids, 3)
    np.testing.assert_allclose(np.asarray(got_loss), want_loss, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(got_tokens), want_tokens)


def test_bad_arguments():
    loss, tokens, ids = _case(0)
    with pytest.raises(ValueError, match="num_datasets=0"):
        kernels.segment_dataset_loss(loss, tokens, ids, num_datasets=0)
    with pytest.raises(ValueError, match="share one"):
        kernels.segment_dataset_loss(loss[:, :2], tokens, ids, num_datasets=2)
