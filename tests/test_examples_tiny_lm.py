"""examples/train_tiny_lm.py's bookkeeping: the checkpoint is one file renamed once (a crash
mid-save leaves the previous one whole, and a torn checkpoint of two files is refused), the rate
counts the tokens inside segments from the end of the first (compiling) step, a dataset with no
tokens has no loss (NaN, "n/a"), and under --context-parallel the per-dataset losses come from
the context-parallel loss over the layout."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from examples import train_tiny_lm
from examples.lm_data import real_tokens
from examples.tiny_lm import ModelConfig, flatten_state
from examples.train_tiny_lm import build_pipeline, stdlib_corpus, train

MODEL = ModelConfig(dim=16, heads=2, layers=1, mlp=32, max_len=64)
KW = dict(seq_len=64, batch_size=2, model=MODEL)


@pytest.fixture(scope="module")
def examples():
    return stdlib_corpus(max_examples=200)


def test_a_torn_checkpoint_of_two_files_is_refused(tmp_path):
    """The former layout (state.npz, then meta.json, renamed one after the other): new
    parameters beside an old step are an error naming both steps, not a silent resume."""
    params = {"embed": np.ones((4, 2), np.float32)}
    opt_state = {"m": params, "v": params, "t": np.int32(4)}  # parameters of step 4
    np.savez(tmp_path / "state.npz", **flatten_state(params, opt_state))
    (tmp_path / "meta.json").write_text(json.dumps({"step": 2, "iterator": {}}))
    with pytest.raises(ValueError, match="torn: its parameters are from step 4, its step and "
                                         "iterator state from step 2"):
        train_tiny_lm.load_checkpoint(tmp_path, iterator=None)


def test_resume_needs_an_existing_folder(tmp_path, examples, capsys):
    with pytest.raises(FileNotFoundError, match="no checkpoint to resume from"):
        train(1, examples=examples, checkpoint_dir=str(tmp_path / "typo"), resume=True, **KW)
    with pytest.raises(ValueError, match="need a checkpoint_dir"):
        train(1, examples=examples, save_every=1, **KW)
    for argv in (["--resume"], ["--save-every", "2"],
                 ["--resume", "--checkpoint-dir", str(tmp_path / "typo")]):
        with pytest.raises(SystemExit) as e:
            train_tiny_lm.main(argv)
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--resume needs --checkpoint-dir" in err and "--save-every needs --checkpoint-dir" in err
    assert f"no folder {tmp_path / 'typo'}" in err


@pytest.mark.slow  # six short runs of one compiled step: ~10 s on 2 cores
def test_a_crash_mid_save_leaves_the_previous_checkpoint(tmp_path, examples, monkeypatch):
    """A crash at every rename of a save: the folder resumes to exactly the uninterrupted
    run's losses (the previous checkpoint whole, or the new one whole)."""
    # one jitted step for all the runs below (the step is a pure function): one compilation
    monkeypatch.setattr(train_tiny_lm, "make_train_step",
                        functools.cache(train_tiny_lm.make_train_step))
    whole = train(5, examples=examples, **KW)
    good = tmp_path / "good"
    assert train(2, examples=examples, checkpoint_dir=str(good), **KW) == whole[:2]
    real_replace = os.replace
    for crash_at in (0, 1):  # the save's first rename, and its second (if it has one)
        folder = tmp_path / f"crash{crash_at}"
        shutil.copytree(good, folder)
        calls = []

        def replace(src, dst, _at=crash_at, _calls=calls):
            _calls.append(dst)
            if len(_calls) - 1 == _at:
                raise KeyboardInterrupt("preempted mid-save")
            return real_replace(src, dst)

        monkeypatch.setattr(train_tiny_lm.os, "replace", replace)
        try:
            train(4, examples=examples, checkpoint_dir=str(folder), resume=True, **KW)
        except KeyboardInterrupt:
            pass
        monkeypatch.setattr(train_tiny_lm.os, "replace", real_replace)
        rest = train(5, examples=examples, checkpoint_dir=str(folder), resume=True, **KW)
        assert rest and rest == whole[-len(rest):], (crash_at, calls)


@pytest.mark.slow  # compiles a step: ~3-5 s
def test_rate_counts_real_tokens_from_the_end_of_the_first_step(examples, monkeypatch, capsys):
    """The first step (it compiles) is left out of the rate; the tokens counted are those
    inside segments (padding out, each segment's last token in), not the loss's."""
    counted: list[int] = []

    class Recording(train_tiny_lm.Meter):
        def add(self, tokens: int, wait: float) -> None:
            if self.t0 is not None:
                counted.append(tokens)
            super().add(tokens, wait)

    monkeypatch.setattr(train_tiny_lm, "Meter", Recording)
    train(3, examples=examples, log_every=1, **KW)
    it = iter(build_pipeline(examples, seq_len=64, batch_size=2))
    batches = [next(it) for _ in range(3)]
    assert counted == [real_tokens(b) for b in batches[1:]]
    assert real_tokens(batches[1]) > int(batches[1]["loss_tokens"].sum())
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("step")]
    assert len(lines) == 3 and lines[0].endswith("(compiled)")
    assert all(x.endswith("real tokens/s") for x in lines[1:])


def test_a_dataset_without_tokens_has_no_loss():
    from examples.lm_run import dataset_means, fmt_loss

    means = dataset_means([0.0, 6.0], [0, 3])
    assert np.isnan(means[0]) and means[1] == 2.0
    assert [fmt_loss(v) for v in means] == ["n/a", "2.0000"]


CP_MIX = textwrap.dedent("""
    import contextlib
    import io
    import logging

    import jax
    import numpy as np
    from examples import train_tiny_lm as t
    from examples.tiny_lm import ModelConfig, cp_batch, init_params
    from seqpack import packer

    C, L = 2, 64
    cfg = ModelConfig(dim=16, heads=2, layers=1, mlp=32, max_len=L)
    params = init_params(jax.random.key(0), cfg)
    it = iter(t.build_pipeline(t.stdlib_corpus(200), seq_len=L, batch_size=2,
                               context_parallel=C, mix=True))
    raw = next(it)  # the load-balanced layout: [B, L] arrays permuted, [B, S] metadata not
    got = t.dataset_losses(params, cp_batch(raw, C), cfg, None, C)
    order = packer.context_parallel_order(raw["tokens_segment_offsets"],
                                          raw["tokens_segment_lengths"], seq_len=L,
                                          context_parallel=C)
    undo = np.argsort(order, axis=1)
    rows = {k: np.take_along_axis(v, undo, axis=1) if v.ndim == 2 and v.shape[1] == L else v
            for k, v in raw.items()}  # the same rows in their own order
    want = t.dataset_losses(params, rows, cfg, None)
    assert np.isfinite(want).all(), want  # both datasets in the batch
    np.testing.assert_allclose(got, want, rtol=1e-5)

    # the training loop logs them (step 1: the initial parameters, this batch), and compiles
    # its step once (before: again at step 2, the parameters placed otherwise)
    compiles = []
    handler = logging.Handler()
    handler.emit = lambda r: compiles.append(r.getMessage())
    logging.getLogger("jax").addHandler(handler)
    jax.config.update("jax_log_compiles", True)
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        t.train(3, seq_len=L, batch_size=2, model=cfg, examples=t.stdlib_corpus(200), mix=True,
                log_every=1, context_parallel=C)
    first = text.getvalue().splitlines()[0].split()
    assert first[:2] == ["step", "1"] and first[4::2][:2] == ["short", "long"], first
    np.testing.assert_allclose([float(first[5]), float(first[7])], got, atol=1e-4)
    assert sum(m.startswith("Compiling jit(step)") for m in compiles) == 1, compiles
    print("ok cp_mix")
""")


@pytest.mark.slow  # compiles the ring attention over 2 host devices in a process: ~30-60 s
def test_context_parallel_dataset_losses_are_those_of_the_rows():
    """--mix --context-parallel 2: each dataset's loss, computed over the layout by the
    context-parallel loss, equals the single-device loss of the same rows in their order
    (before: the single-device loss ran on the permuted tokens), and is what the log says."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", CP_MIX], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "ok cp_mix" in done.stdout, done.stderr[-4000:]
