"""examples/lm_run.py, examples/train_lm.py's bookkeeping: a dataset with no tokens in a step
has no loss (NaN; "n/a" in the log, null in the JSON summary, never 0.000), and the curves go
into a folder that does not exist yet."""

from __future__ import annotations

import json

import numpy as np

from examples import lm_run


def test_a_dataset_without_tokens_is_logged_as_na(capsys):
    log = lm_run.Log(["packed"], ["chat_dev", "gsm8k_train"], steps=2, first=0, stop=2,
                     log_every=1)
    metrics = {"packed": {"loss": np.float32(2.5), "sums": np.array([0.0, 10.0], np.float32),
                          "tokens": np.array([0, 4], np.int32)}}
    log.record(1, metrics, tokens=6, wait=0.0)
    per = log.per_dataset["packed"][-1]
    assert np.isnan(per[0]) and per[1] == 2.5
    line = capsys.readouterr().out
    assert "chat_dev n/a gsm8k_train 2.500" in line and "0.000" not in line


def test_the_summary_writes_no_loss_as_null():
    out = {"dataset_losses": {"packed": [[float("nan"), 2.5]]}, "losses": {"packed": [2.5]},
           "tokens_per_s": 0.0, "pipeline": {"x": float("inf")}}
    text = lm_run.summary_json(out)
    assert json.loads(text) == {"dataset_losses": {"packed": [[None, 2.5]]},
                                "losses": {"packed": [2.5]}, "tokens_per_s": 0.0,
                                "pipeline": {"x": None}}
    assert "NaN" not in text and "Infinity" not in text


def test_curves_into_a_missing_folder(tmp_path):
    png = tmp_path / "new" / "deeper" / "loss.png"
    lm_run.write_curves(str(png), {"packed": [3.0, 2.0]}, first=0)
    assert png.with_suffix(".csv").read_text().splitlines() == [
        "step,packed_loss", "1,3.000000", "2,2.000000"]
