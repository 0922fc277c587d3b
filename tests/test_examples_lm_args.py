"""examples/train_lm.py's flags (examples/lm_args.py): --smoke keeps the flags given on the
command line, and a flag that cannot work is one usage error naming it (exit 2), before any
training; examples/lm_data.py gives every corpus of a run one token dtype."""

from __future__ import annotations

import numpy as np
import pytest

from examples import lm_args, lm_data


def _error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        lm_args.parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_smoke_keeps_the_flags_given():
    a = lm_args.parse_args(["--smoke", "--steps", "100", "--seq-len", "8192", "--log-every",
                            "10", "--warmup", "20", "--pipeline-batches", "300"])
    # each given value equals the non-smoke default: before, --smoke replaced them all
    assert (a.steps, a.seq_len, a.log_every, a.warmup, a.pipeline_batches) == (
        100, 8192, 10, 20, 300)
    assert a.max_segments == 128 and a.batch_size == lm_args.SMOKE["batch_size"]
    b = lm_args.parse_args(["--smoke"])
    assert (b.steps, b.seq_len, b.log_every) == (6, 128, 1)
    assert b.model == lm_args.SMOKE_MODEL
    assert lm_args.parse_args(["--smoke", "--layers", "1"]).model["layers"] == 1


def test_smoke_datasets_and_weights():
    assert lm_args.parse_args(["--smoke"]).shares == {"count": 0.5, "motif": 0.5}
    assert lm_args.parse_args(["--smoke", "--weights", "0.9,0.1"]).shares == {
        "count": 0.9, "motif": 0.1}
    assert lm_args.parse_args(["--smoke", "--datasets", "motif"]).shares == {"motif": 1.0}
    assert lm_args.parse_args(["--smoke", "--data", "d"]).shares == {
        "chat_dev": 0.7, "gsm8k_train": 0.3}


def test_smoke_refuses_datasets_it_does_not_generate(capsys):
    assert "--smoke without --data generates count, motif only" in _error(
        capsys, ["--smoke", "--datasets", "chat_dev,motif"])


@pytest.mark.parametrize(("argv", "message"), [
    (["--smoke", "--weights", "garbage"], "--weights 'garbage': pass one number per dataset"),
    (["--weights", "a,b"], "--weights 'a,b': pass one number per dataset"),
    (["--weights", "0.5"], "--weights 0.5 needs one share per dataset"),
    (["--weights", "0,0"], "shares must be finite, >= 0 and not all 0"),
    (["--weights", "1,nan"], "shares must be finite"),
    (["--datasets", "count,count", "--weights", "1,1"], "name one dataset or more, each once"),
    (["--dtype", "fp16"], "argument --dtype: invalid choice: 'fp16'"),
    (["--worker-buffer", "0"], "argument --worker-buffer: 0 is not an integer >= 1"),
    (["--workers", "-1"], "argument --workers: -1 is not an integer >= 0"),
    (["--stop-after", "-1"], "argument --stop-after: -1 is not an integer >= 0"),
    (["--batch-size", "x"], "argument --batch-size: 'x' is not an integer"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--save-every", "5"], "--save-every needs --checkpoint-dir"),
])
def test_a_flag_that_cannot_work_is_a_usage_error(capsys, argv, message):
    assert message in _error(capsys, ["--smoke", *argv])


def test_resume_from_a_missing_folder_is_refused(capsys, tmp_path):
    missing = tmp_path / "typo"
    assert f"--resume: no folder {missing}" in _error(
        capsys, ["--smoke", "--checkpoint-dir", str(missing), "--resume"])
    a = lm_args.parse_args(["--smoke", "--checkpoint-dir", str(tmp_path), "--resume"])
    assert a.resume  # an existing folder (empty: the run says it starts at step 0)


def test_help_says_what_the_code_does(capsys):
    with pytest.raises(SystemExit):
        lm_args.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default max(16, seq_len // 64)" in text and "one or more, by name" in text
    assert lm_args.parse_args(["--seq-len", "256"]).max_segments == 16


def test_every_corpus_of_a_run_has_one_token_dtype(tmp_path):
    """chat_dev's ids reach past --vocab 30200 (folded, once int32), gsm8k's do not (uint16):
    the rows took the dtype of whichever example came first, and the padded warm-up compiled
    for the first dataset's. Now both are lm_data.token_dtype(vocab)."""
    for name, top in (("wide", 30265), ("narrow", 30102)):
        np.savez(tmp_path / f"{name}.npz", tokens=np.array([1, top, 2, 3], np.uint16),
                 offsets=np.array([0, 2, 4]))
    got = {n: lm_data.load_corpus(tmp_path / f"{n}.npz", 30200) for n in ("wide", "narrow")}
    dtypes = {n: np.asarray(src[0]["tokens"]).dtype for n, src in got.items()}
    assert dtypes == dict.fromkeys(got, lm_data.token_dtype(30200)) == dict.fromkeys(
        got, np.dtype(np.uint16))
    assert np.asarray(got["wide"][0]["tokens"]).tolist() == [1, 30265 % 30200]
    wide = lm_data.load_corpus(tmp_path / "narrow.npz", 1 << 17)
    assert np.asarray(wide[0]["tokens"]).dtype == lm_data.token_dtype(1 << 17) == np.int32
    smoke = lm_data.smoke_corpora(256, examples=4)
    assert {np.asarray(s[0]["tokens"]).dtype for s in smoke.values()} == {np.dtype(np.uint16)}
