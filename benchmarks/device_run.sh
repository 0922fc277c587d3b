#!/usr/bin/env bash
# One device check, a table a user can compare with benchmarks/README.md. One program holds the
# accelerator at a time (each step below is one process; none starts a child that opens it):
#   1. segment attention alone, fwd and fwd+bwd against the masked alternatives (on a TPU:
#      B=4 L=8192 8 heads of 128, seqpack's defaults in both operand layouts against splash
#      attention with segment ids, 512 blocks: MaxText's way);
#   2. the loss head's modes against materialized logits and MaxText-style vocab tiling
#      (benchmarks/loss_head.py --preset all: the issue's three sizes, bf16);
#   3. the training step (benchmarks/train_step.py: padded rows, MaxText's way, seqpack's
#      defaults) at L=8192 and 32768, both RoPE styles;
#   4. the device test suite (pytest -m device: compiled kernels against the references).
# On a GPU, step 1 times the Triton tile sizes and the kernels benchmark runs at its hardware
# sizes instead of 2-3. A step that fails prints "== FAILED" and the next one runs. Prints the
# tables; with $OUT set (the device tool), also writes them to $OUT/device_run.log.
#
#   benchmarks/device_run.sh            # on a TPU or GPU machine, from the repository root
#   benchmarks/device_run.sh --smoke    # tiny sizes, any machine (CPU: interpret mode)
#
# The corpus: $SEQPACK_DATA, else .bench_data/chat_dev.npz in the repository (a copy carried to
# the device: `mkdir -p .bench_data && cp ../shared/data/chat_dev.npz .bench_data/`, with
# `/.bench_data/` in .git/info/exclude), else ../shared/data/chat_dev.npz. $PYTHON (default
# python3) must have jax; seqpack need not be installed: the repository root is linked as it.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
smoke=""
if [[ "${1:-}" == "--smoke" ]]; then smoke="--smoke"; fi
python="${PYTHON:-python3}"
data="${SEQPACK_DATA:-}"
if [[ -z "$data" ]]; then
  for candidate in "$root/.bench_data/chat_dev.npz" "$root/../shared/data/chat_dev.npz"; do
    if [[ -f "$candidate" ]]; then data="$candidate"; break; fi
  done
fi
if [[ -z "$data" ]]; then
  echo "Error: chat_dev.npz not found; set SEQPACK_DATA or copy it to .bench_data/" >&2
  exit 2
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
ln -s "$root" "$tmp/seqpack"  # the repository root is the seqpack package (pyproject)
export PYTHONPATH="$tmp:$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="${OUT:+$OUT/device_run.log}"
cd "$root"
failed=0
step() {  # step NAME COMMAND...: runs one step, reports a failure and goes on
  echo "== $*"
  "${@:2}" || { echo "== FAILED ($?): $1"; failed=1; }
}
{
  backend="$("$python" -c 'import jax; print(jax.default_backend())')"
  "$python" -c "import jax; print('== jax', jax.__version__, jax.devices())"
  if [[ -n "$smoke" ]]; then
    step attention "$python" -m benchmarks.attention_bench --smoke --data "$data"
    step loss_head "$python" -m benchmarks.loss_head --smoke --repeats 1
    step train_step "$python" -m benchmarks.train_step --smoke --data "$data"
  elif [[ "$backend" == "tpu" ]]; then
    step attention "$python" -m benchmarks.attention_bench --data "$data" --seq-lens 8192 \
      --blocks 512,1024 --batch 4 --heads 8 --kv-heads 8 --repeats 5 \
      --tpu-blocks 256,256,256,256 512,512,512,512 1024,1024,512,512
    step loss_head "$python" -m benchmarks.loss_head --preset all
    step train_step "$python" -m benchmarks.train_step --data "$data" --seq-len 8192 \
      --rope half interleaved --steps 4 --repeats 2
    step train_step_32k "$python" -m benchmarks.train_step --data "$data" --seq-len 32768 \
      --rope half interleaved --steps 2 --repeats 2 --variants maxtext,seqpack
    step device_tests "$python" -m pytest -q -m device tests/test_device.py -p no:cacheprovider
  else
    step attention "$python" -m benchmarks.attention_bench --data "$data" \
      --gpu-blocks 64,64,64,64 128,64,64,64 128,128,64,64 64,64,32,64
    step kernels "$python" -m benchmarks.kernels_bench --gpu-sizes
    step loss_head "$python" -m benchmarks.loss_head --preset all
    step device_tests "$python" -m pytest -q -m device tests/test_device.py -p no:cacheprovider
  fi
  exit "$failed"
} 2>&1 | if [[ -n "$log" ]]; then tee "$log"; else cat; fi
