"""examples/train_lm.py: the smoke run, exact resume through an orbax checkpoint (params,
optimizer state and the pipeline's iterator state), padded micro-batches of a packed batch,
and packed vs padded in lockstep."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")

from examples import lm_data, train_lm  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
FAST = ["--smoke", "--attention", "reference", "--layers", "1", "--pipeline-batches", "2"]


@pytest.mark.slow  # ~7-11 s on 2 cores: the README's run stays short
def test_smoke_save_resume_same_losses(tmp_path):
    whole = train_lm.run([*FAST, "--steps", "6"])
    assert len(whole["losses"]["packed"]) == 6 and whole["pipeline"]["batches_per_s"] > 0
    assert np.isfinite(np.asarray(whole["dataset_losses"]["packed"])).all()
    ckpt = ["--steps", "6", "--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", "2"]
    head = train_lm.run([*FAST, *ckpt, "--stop-after", "3", "--pipeline-batches", "0"])
    tail = train_lm.run([*FAST, *ckpt, "--resume", "--pipeline-batches", "0"])
    assert head["steps"] == 3 and tail["steps"] == 6
    # the step-3 checkpoint (saved at the stop) resumed: the same batches, the same losses
    assert head["losses"]["packed"] + tail["losses"]["packed"] == whole["losses"]["packed"]
    assert (head["dataset_losses"]["packed"] + tail["dataset_losses"]["packed"]
            == whole["dataset_losses"]["packed"])


def test_padded_feeds_hold_the_batch_examples_longest_first():
    """The module's worked example: rows [3, 1] and [2, 2] -> widths 4 (2 rows), 2 (4 rows)."""
    tokens = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.int32)
    batch = {"tokens": tokens, "tokens_segment_lengths": np.array([[3, 1], [2, 2]]),
             "tokens_segment_offsets": np.array([[0, 3], [0, 2]]),
             "segment_dataset_id": np.array([[0, 1], [1, 0]])}
    feeds = lm_data.padded_feeds(batch, slots=8, min_width=2)
    assert [f["tokens"].shape for f in feeds] == [(2, 4), (4, 2)]
    assert feeds[0]["tokens"].tolist() == [[1, 2, 3, 0], [5, 6, 0, 0]]
    assert feeds[1]["tokens"].tolist() == [[7, 8], [4, 0], [0, 0], [0, 0]]
    assert feeds[1]["lengths"][:, 0].tolist() == [2, 1, 0, 0]
    assert feeds[1]["dataset_id"][:, 0].tolist() == [0, 1, -1, -1]
    assert feeds[0]["positions"].tolist() == [[0, 1, 2, 0], [0, 1, 0, 0]]
    assert train_lm.counted_tokens(batch) == 2 + 0 + 1 + 1


@pytest.mark.slow
def test_compare_packed_and_padded_in_lockstep(tmp_path):
    """f32: the padded model, fed each step's examples padded in micro-batches, follows the
    packed model's losses; the plot and CSV are written."""
    common = ["--smoke", "--attention", "reference", "--dtype", "float32", "--schedule-steps",
              "4", "--pipeline-batches", "0"]
    out = train_lm.run([*common, "--compare-steps", "4", "--plot", str(tmp_path / "loss.png")])
    np.testing.assert_allclose(out["losses"]["packed"], out["losses"]["padded"], rtol=2e-5)
    # a run of one feed on the same schedule repeats the comparison's first losses exactly
    assert train_lm.run([*common, "--steps", "2"])["losses"]["packed"] == \
        out["losses"]["packed"][:2]
    assert train_lm.run([*common, "--padded", "--steps", "2"])["losses"]["padded"] == \
        out["losses"]["padded"][:2]
    np.testing.assert_allclose(out["dataset_losses"]["packed"], out["dataset_losses"]["padded"],
                               rtol=2e-5)
    assert (tmp_path / "loss.png").stat().st_size > 0
    assert len((tmp_path / "loss.csv").read_text().splitlines()) == 5


@pytest.mark.slow
def test_smoke_cli_with_worker_processes(tmp_path):
    """The command a user runs first: seqpack's Pallas kernels (interpret mode on CPU), two
    worker processes, a checkpoint, the pipeline's own rate."""
    run = subprocess.run([sys.executable, "-m", "examples.train_lm", "--smoke", "--workers", "2",
                          "--checkpoint-dir", str(tmp_path / "ckpt"),
                          "--summary", str(tmp_path / "s.json")],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "pipeline alone (2 workers" in run.stdout and "input wait" in run.stdout
    assert (tmp_path / "s.json").is_file() and any((tmp_path / "ckpt").iterdir())


@pytest.mark.slow  # one short smoke run: ~10-15 s on 2 cores
def test_smoke_run_writes_its_figures_where_asked(tmp_path, capsys):
    """A dataset given no share has no loss (null in the summary, "n/a" in the log, never
    0.000); --plot and --summary into folders that do not exist yet are written (before, the
    plot crashed after the last step and the summary was lost); a run with no timed step says
    so instead of a ratio to 0 batches/s; --resume from an empty folder starts at step 0 and
    says so."""
    summary, png = tmp_path / "a" / "s.json", tmp_path / "b" / "c" / "loss.png"
    empty = tmp_path / "ckpt"
    empty.mkdir()
    out = train_lm.run([*FAST, "--steps", "1", "--weights", "0,1", "--summary", str(summary),
                        "--plot", str(png), "--checkpoint-dir", str(empty), "--resume"])
    text = capsys.readouterr().out
    assert f"no checkpoint in {empty}: starting at step 0" in text
    assert "(count n/a motif " in text and "consumption: n/a (no timed steps)" in text
    assert "0 steps timed: no rates" in text
    assert np.isnan(out["dataset_losses"]["packed"][0][0])
    figures = json.loads(summary.read_text())
    none, motif = figures["dataset_losses"]["packed"][0]
    assert none is None and motif == pytest.approx(figures["losses"]["packed"][0], rel=1e-5)
    assert png.with_suffix(".csv").is_file()
    assert any(empty.iterdir())  # the end-of-run checkpoint
