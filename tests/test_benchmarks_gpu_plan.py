"""What the GPU benchmarks share before a chip runs them: the same packed rows for the JAX and the
PyTorch attention benchmarks, the PyTorch peers' document ids, the ratios attention_bench prints
against the issue's targets, device_run.sh's GPU plan naming only steps it has and every
benchmark command in it parsing, and the offline sm_90 forecast (benchmarks/triton_sm90.py)."""

from __future__ import annotations

import pathlib
import re
import subprocess

import numpy as np
import pytest

from benchmarks import common, torch_peers

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_both_attention_benchmarks_time_the_same_rows(npz_corpus):
    """picked_rows is seeded: every call draws the same rows, valid packed rows of L."""
    pick, offsets, lengths = common.picked_rows(npz_corpus, 1024, 4)
    again = common.picked_rows(npz_corpus, 1024, 4)
    for a, b in zip((pick, offsets, lengths), again):
        np.testing.assert_array_equal(a, b)
    assert len(pick) == 4 and (np.diff(pick) > 0).all()
    assert (offsets + lengths <= 1024).all() and lengths.sum() > 0
    ends = np.where(lengths > 0, offsets + lengths, 0)
    starts = np.where(lengths > 0, offsets, 1024)
    for r in range(4):  # used slots back to back in order, no overlap
        used = lengths[r] > 0
        assert (starts[r][used][1:] >= ends[r][used][:-1]).all()


def test_document_ids_are_the_segments(npz_corpus):
    """torch_peers' document ids: 1 + the slot of each token's segment, 0 outside segments."""
    _, offsets, lengths = common.picked_rows(npz_corpus, 1024, 3)
    ids = torch_peers.document_ids(offsets, lengths, 1024)
    for r in range(len(offsets)):
        want = np.zeros(1024, np.int32)
        for s, (o, n) in enumerate(zip(offsets[r], lengths[r])):
            want[o:o + n] = s + 1
        np.testing.assert_array_equal(ids[r], want)
    assert (ids > 0).sum() == lengths.sum()


def test_attention_bench_prints_the_issues_ratios():
    pytest.importorskip("jax")
    from benchmarks import attention_bench

    rows = [["seqpack default (impl='auto')", "1.0", "2.0", "-", "50", "-", "1.00x", "0"],
            ["cudnn packed (impl='cudnn')", "1.0", "3.0", "-", "33", "-", "1.50x", "0"],
            ["masked: jax pallas gpu mha (ids)", "4.0", "8.0", "-", "12.5", "-", "4.00x", "0"],
            ["masked: jax.nn dpa cudnn (dense mask)", "-", "-", "-", "-", "-", "-", "Error"],
            ["bound: cudnn dense causal (no packing)", "1", "9.0", "-", "100", "-", "-", "nan"]]
    (line,) = attention_bench.targets(rows)
    assert line == ("seqpack default (impl='auto'): 4.00x the fastest masked kernel, 1.50x "
                    "cuDNN packed, 50% of dense causal cuDNN's TFLOP/s")


def _plan_steps() -> list[list[str]]:
    header = (ROOT / "benchmarks" / "device_run.sh").read_text()
    plan = header[header.index("# GPU_PLAN"):header.index("# Grain on a machine")]
    return [m.split(",") for m in re.findall(r"--only (\S+)", plan)]


def test_the_gpu_plan_names_only_steps_device_run_has():
    """Each GPU_PLAN call's --only steps are accepted (device_run.sh refuses an unknown step
    before running any), and together they cover every step but the TPU's."""
    steps = [s for call in _plan_steps() for s in call]
    assert len(steps) == len(set(steps)) >= 10
    for call in _plan_steps():
        run = subprocess.run(["bash", str(ROOT / "benchmarks" / "device_run.sh"), "--only",
                              ",".join(call), "--bogus"], capture_output=True, text=True,
                             timeout=60)
        assert run.returncode == 2 and "unknown argument --bogus" in run.stderr, run.stderr


def test_triton_sm90_captures_each_kernel_with_its_launch():
    """The offline sm_90 forecast reads every Triton kernel of an op with the num_warps /
    num_stages it launches with (compiling them needs triton: benchmarks/README.md)."""
    pytest.importorskip("jax")
    from benchmarks import triton_sm90

    found = triton_sm90.attention_cases([64], [(64, 64)], [4], [3])
    assert [k.name for k in found] == ["segment_attention_fwd_gpu", "segment_attention_dq_gpu",
                                       "segment_attention_dkv_gpu"]
    assert {(k.num_warps, k.num_stages) for k in found} == {(4, 3)}
    assert all("tt.dot" in k.ttir and k.case == "attention D=64 64x64" for k in found)


def test_triton_sm90_occupancy():
    from benchmarks import triton_sm90

    # 128 registers x 32 threads x 8 warps = 32,768: two programs in 65,536
    assert triton_sm90.occupancy(128, 80 * 1024, 8) == (2, "regs")
    # 168 registers round up to 5,376 a warp: 65,536 // (5,376 x 4) = 3
    assert triton_sm90.occupancy(168, 1024, 4) == (3, "regs")
    assert triton_sm90.occupancy(32, 160 * 1024, 4) == (1, "smem")
    assert triton_sm90.occupancy(16, 0, 4)[0] == 16  # 64 warps a SM


def test_every_gpu_block_spec_in_device_run_parses():
    """The GPU attention sweeps' --gpu-blocks options all fit GpuAttentionBlockSizes (a typo, or
    a TPU-only option such as w<N>, would end the chip's step with an error)."""
    pytest.importorskip("jax")
    from seqpack.kernels import GpuAttentionBlockSizes

    script = (ROOT / "benchmarks" / "device_run.sh").read_text().replace("\\\n", " ")
    specs = [spec for line in re.findall(r"--gpu-blocks ((?:[\w,+]+ ?)+)", script)
             for spec in line.split()]
    assert len(specs) >= 5
    for spec in specs:
        blocks = common.attention_blocks(spec, GpuAttentionBlockSizes())
        assert blocks.block_q == int(spec.split(",")[0])


class _Parsed(Exception):
    """Raised by the patched parse_args once a benchmark's arguments parsed."""


def _device_run_steps() -> list[tuple[str, list[str]]]:
    """(module, arguments) of every `python -m benchmarks.<module>` step of device_run.sh, on
    every branch (smoke, TPU, GPU), `bash -c "a && b"` steps split."""
    script = (ROOT / "benchmarks" / "device_run.sh").read_text().replace("\\\n", " ")
    script = script.replace('"$python"', "$python").replace('"$data"', "/data/chat_dev.npz")
    script = re.sub(r"^\s*#.*$", "", script, flags=re.MULTILINE)  # comment lines
    calls = []
    for body in re.findall(r"^\s*step \w+ (.*?)(?=^\s*(?:step|fi|elif|else)\b)", script,
                          re.MULTILINE | re.DOTALL):
        for part in body.split("&&"):
            found = re.search(r"\$python -m (benchmarks\.\w+)([^\"]*)", part)
            if found:
                calls.append((found.group(1), found.group(2).split()))
    return calls


def test_every_device_run_benchmark_step_parses(monkeypatch):
    """Each benchmark command device_run.sh runs on a chip is accepted by the benchmark's own
    argument parser (a renamed or misspelt flag would end the chip's step), checked here by
    parsing only: the patched parse_args stops main before it runs anything."""
    import argparse
    import importlib

    pytest.importorskip("jax")
    calls = _device_run_steps()
    modules = {module for module, _ in calls}
    assert len(calls) >= 20  # three branches of steps, two of them "a && b"
    assert {"benchmarks.attention_bench", "benchmarks.loss_head", "benchmarks.train_step",
            "benchmarks.torch_peers", "benchmarks.kernels_bench", "benchmarks.gpu_probe"} <= modules
    original = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    for module, args in calls:
        monkeypatch.setattr("sys.argv", [module, *args])
        with pytest.raises(_Parsed):
            importlib.import_module(module).main()


def test_gpu_probe_runs_each_kernel_once(capsys, npz_corpus):
    """The sanitizer's and profiler's program (interpreted here): each probe named prints "ok"
    with a finite checksum, on rows packed from a corpus; an unknown probe is refused."""
    pytest.importorskip("jax")
    from benchmarks import gpu_probe

    gpu_probe.main(["--smoke", "--data", str(npz_corpus), "--only", "segment_sum",
                    "segment_gather"])
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in out if line.startswith("ok ")] == [
        ["ok", "segment_sum"], ["ok", "segment_gather"]]
    with pytest.raises(SystemExit, match="unknown probes \\['attn'\\]"):
        gpu_probe.main(["--smoke", "--only", "attn"])


def test_gpu_probe_synthetic_rows_keep_the_row_contract():
    from benchmarks import gpu_probe

    offsets, lengths = gpu_probe.synthetic_rows(64, 3)
    for o, n in zip(offsets, lengths):
        used = n > 0
        ends = o[used] + n[used]
        assert (o[used][1:] == ends[:-1]).all() and ends[-1] <= 64  # back to back from 0
        assert (o[~used] == ends[-1]).all()  # unused slots at the row's used length
