"""benchmarks/train_step.py at tiny sizes on a CPU (interpret mode), attention_bench's options,
and device_run.sh --smoke."""

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import train_step

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _rows(out: str) -> dict[str, list[str]]:
    return {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.splitlines() if line.startswith("| ") and "ms / step" not in line}


@pytest.mark.slow  # ~7-11 s on 2 cores: the README's run stays short
def test_smoke_times_maxtexts_way_and_seqpack_on_the_same_rows(npz_corpus, capsys):
    train_step.main(["--smoke", "--data", str(npz_corpus), "--variants", "maxtext,seqpack"])
    rows = _rows(capsys.readouterr().out)
    assert set(rows) == {"maxtext", "seqpack"}
    # the same packed rows: splash with segment ids + logits, and seqpack's kernels, agree
    assert float(rows["maxtext"][3]) == pytest.approx(float(rows["seqpack"][3]), rel=2e-2)
    assert rows["maxtext"][4] == "1.00x" and rows["seqpack"][5] == "-"


@pytest.mark.slow
def test_smoke_times_every_variant_on_the_same_examples(npz_corpus, capsys):
    train_step.main(["--smoke", "--data", str(npz_corpus), "--rope", "interleaved", "--profile",
                     "--variants",
                     "padded,maxtext,seqpack,seqpack+b128+bhld+logits,seqpack+w4+unfused+f32"])
    out = capsys.readouterr().out
    rows = _rows(out)
    names = {"padded", "maxtext", "seqpack", "seqpack+b128+bhld+logits",
             "seqpack+w4+unfused+f32"}
    assert names <= set(rows)
    losses = {name: float(rows[name][3]) for name in names}
    assert losses["maxtext"] == pytest.approx(losses["seqpack"], rel=2e-2)
    assert losses["seqpack+b128+bhld+logits"] == pytest.approx(losses["seqpack"], rel=2e-2)
    # the same attention math (a narrow grid of 4 steps, the dq kernel apart); the head's logits in
    # f32 instead of bf16: within bf16 rounding
    assert losses["seqpack+w4+unfused+f32"] == pytest.approx(losses["seqpack"], rel=1e-3)
    assert all(np.isfinite(v) for v in losses.values())
    assert rows["maxtext"][4] == "1.00x" and rows["padded"][5] == "1.00x"
    assert "profile: seqpack, L=256" in out and "all device ops" in out


def test_padded_steps_hold_every_piece_once_in_bucketed_rows(npz_corpus):
    z = np.load(npz_corpus)
    tokens, offsets = z["tokens"].astype(np.int32), z["offsets"]
    packed, pieces = train_step.packed_steps(tokens, offsets, 512, 2, 3)
    padded = train_step.padded_steps(tokens, offsets, pieces, 1024, 512)
    assert sum(int(b["lengths"].sum()) for b in packed) == sum(p[2] for p in pieces)
    got = [b["tokens"][r, :n] for b in padded for r, n in enumerate(b["lengths"][:, 0]) if n]
    want = [tokens[offsets[i] + s: offsets[i] + s + n] for i, s, n in pieces]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    for b in padded:
        rows, width = b["tokens"].shape
        assert rows * width == 1024 and width in (512,) and b["lengths"].max() <= width


def test_variant_options_keep_each_other():
    """A block-size option keeps the options before it (fused_bwd, narrow_steps)."""
    from seqpack import kernels

    _, overrides = train_step.variant("seqpack+unfused+w16+b1024/512")
    assert overrides["attention_block_sizes"] == kernels.AttentionBlockSizes(
        1024, 1024, 512, 512, narrow_steps=16, fused_bwd=False)


def test_unknown_variant_is_refused():
    with pytest.raises(SystemExit, match="unknown option 'fast'"):
        train_step.variant("seqpack+fast")
    with pytest.raises(SystemExit, match="unknown option 'warps4' for AttentionBlockSizes"):
        train_step.variant("seqpack+warps4")  # a GPU kernels' option


def test_gpu_variants_are_the_gpu_ways():
    """On a GPU the bases are the GPU's: padded rows through cuDNN, MaxText's masked kernel,
    cuDNN's packed layout; seqpack's options read as GpuAttentionBlockSizes."""
    from seqpack import kernels

    assert train_step.variant("padded", "gpu") == ("padded", dict(
        attention="cudnn", segment_ids=False, loss="materialized"))
    assert train_step.variant("maxtext", "gpu")[1]["attention"] == "masked"
    assert train_step.variant("cudnn", "gpu") == ("packed", dict(attention="cudnn",
                                                                 loss="materialized"))
    assert train_step.variant("seqpack+warps4", "gpu")[1]["attention_block_sizes"] == \
        kernels.GpuAttentionBlockSizes(num_warps=4)
    with pytest.raises(SystemExit, match="unknown variant 'cudnn'"):
        train_step.variant("cudnn", "tpu")


def test_one_syntax_for_every_benchmarks_block_sizes():
    """benchmarks.common.attention_blocks: train_step's variants, attention_bench's
    --tpu-blocks / --gpu-blocks / --tpu-options read the same options the same way."""
    from benchmarks import attention_bench
    from benchmarks.common import attention_blocks
    from seqpack import kernels

    tpu, gpu = kernels.AttentionBlockSizes(), kernels.GpuAttentionBlockSizes()
    assert attention_blocks("b1024/512", tpu) == attention_blocks("1024,1024,512,512", tpu) \
        == attention_blocks(["b1024,1024,512,512"], tpu) == kernels.AttentionBlockSizes(
            1024, 1024, 512, 512)
    assert train_step.variant("seqpack+b1024/512+unfused")[1]["attention_block_sizes"] == \
        attention_bench.tpu_options("b1024/512+unfused")
    assert attention_blocks("b128,64,64,32+warps4+stages3", gpu) == \
        kernels.GpuAttentionBlockSizes(128, 64, 64, 32, num_warps=4, num_stages=3)
    with pytest.raises(ValueError, match="unknown option 'unfused' for GpuAttentionBlockSizes"):
        attention_blocks("unfused", gpu)


def test_attention_bench_tpu_options():
    """attention_bench --tpu-options: each '+'-joined option changes one field of the defaults;
    an unknown one is refused."""
    from benchmarks import attention_bench
    from seqpack import kernels

    got = attention_bench.tpu_options("unfused+w16")
    assert got == kernels.AttentionBlockSizes(fused_bwd=False, narrow_steps=16)
    assert attention_bench.tpu_options("wfull").narrow_steps is None
    assert attention_bench.tpu_options("fused").fused_bwd
    assert not attention_bench.tpu_options("unfused").fused_bwd
    with pytest.raises(SystemExit, match="unknown option 'fast'"):
        attention_bench.tpu_options("unfused+fast")


@pytest.mark.slow
def test_device_run_smoke(npz_corpus):
    env = {**os.environ, "SEQPACK_DATA": str(npz_corpus), "JAX_PLATFORMS": "cpu",
           "PYTHON": sys.executable}
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "device_run.sh"), "--smoke"],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "FAILED" not in run.stdout
    for table in ("segment attention", "value_and_grad"):
        assert table in run.stdout



@pytest.mark.parametrize("args,message", [
    (["--only", "attention,nope"], "unknown step nope in --only"),
    (["--only"], "--only needs step names"),
    (["--fast"], "unknown argument --fast"),
])
def test_device_run_refuses_unknown_steps_before_running_any(args, message):
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "device_run.sh"), *args],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and message in run.stderr and "==" not in run.stdout
