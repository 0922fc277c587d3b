"""Resuming the tiny-LM training from a checkpoint (params, optimizer, Grain iterator state)
continues with exactly the batches and losses of an uninterrupted run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from examples.tiny_lm import ModelConfig
from examples.train_tiny_lm import build_pipeline, stdlib_corpus, train

pytestmark = pytest.mark.slow  # trains / compiles a model: seconds per case

MODEL = ModelConfig(dim=32, heads=2, layers=1, mlp=64, max_len=64)
KW = dict(seq_len=64, batch_size=4, model=MODEL)


@pytest.mark.parametrize("mix", [False, True])
def test_resume_continues_exactly(tmp_path, mix):
    examples = stdlib_corpus(max_examples=300)
    full = train(9, examples=examples, mix=mix, **KW)
    first = train(4, examples=examples, checkpoint_dir=str(tmp_path), mix=mix, **KW)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.npz"]  # one file
    with np.load(tmp_path / "checkpoint.npz") as z:
        meta = json.loads(str(z["meta"]))
    assert meta["step"] == 4 and meta["iterator"]  # the Grain iterator state is in the checkpoint
    rest = train(9, examples=examples, checkpoint_dir=str(tmp_path), resume=True, mix=mix, **KW)
    assert first == full[:4]
    assert rest == full[4:]  # bit-for-bit: same batches, same parameters, same losses
    assert full[-1] < full[0]  # and it is learning


def test_iterator_state_restores_the_same_batches():
    examples = stdlib_corpus(max_examples=300)
    it = iter(build_pipeline(examples, seq_len=64, batch_size=4))
    for _ in range(3):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(3)]
    it2 = iter(build_pipeline(examples, seq_len=64, batch_size=4))
    it2.set_state(json.loads(json.dumps(state, default=int)))
    for want in expected:
        got = next(it2)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_per_dataset_losses_weigh_up_to_the_batch_loss():
    import jax

    from examples.tiny_lm import init_params, loss_fn
    from examples.train_tiny_lm import MIX, dataset_losses

    examples = stdlib_corpus(max_examples=300)
    batch = next(iter(build_pipeline(examples, seq_len=64, batch_size=4, mix=True)))
    ids = batch["segment_dataset_id"]
    assert set(np.unique(ids[ids >= 0])) == {0, 1}  # both datasets in one batch
    params = init_params(jax.random.key(0), MODEL)
    loss, (per_seg, count) = loss_fn(params, batch, MODEL)
    per = dataset_losses(params, batch, MODEL, None)
    tokens = [int(np.asarray(count)[ids == d].sum()) for d in range(len(MIX))]
    sums = [float(np.asarray(per_seg)[ids == d].sum()) for d in range(len(MIX))]
    np.testing.assert_allclose(per, np.array(sums) / np.array(tokens), rtol=1e-5)
    np.testing.assert_allclose(np.dot(per, tokens) / sum(tokens), float(loss), rtol=1e-5)
