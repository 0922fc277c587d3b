"""Test session setup, and the fixtures several modules share."""

import pathlib

import jax
import numpy as np
import pytest

# Pallas interpret mode runs jax operations inside the kernels' host callbacks; with the CPU
# client's asynchronous dispatch that can deadlock on a small machine. Tests dispatch
# synchronously.
jax.config.update("jax_cpu_enable_async_dispatch", False)


@pytest.fixture
def npz_corpus(tmp_path) -> pathlib.Path:
    """A token corpus as the benchmarks read one (`.npz`: tokens, offsets): 400 examples of
    5-299 uint16 ids below 30,000."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 300, 400)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    path = tmp_path / "corpus.npz"
    np.savez(path, tokens=rng.integers(0, 30000, offsets[-1]).astype(np.uint16), offsets=offsets)
    return path
