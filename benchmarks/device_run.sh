#!/usr/bin/env bash
# One device check: the segment-attention benchmark (pairs table, then fwd / fwd+bwd timings at
# B=8 L=8192 H=32 K=8 D=128 bf16 against the masked alternatives), the kernels benchmark at
# its hardware sizes (--gpu-sizes) and the loss head's modes against materialized logits and
# MaxText-style vocab tiling (benchmarks/loss_head.py --preset all: the issue's three sizes,
# bf16), with the device's name. Prints the tables; with $OUT set
# (the device tool), also writes them to $OUT/device_run.log.
#
#   benchmarks/device_run.sh            # on a GPU (or TPU) machine, from the repository root
#   benchmarks/device_run.sh --smoke    # tiny sizes, any machine (CPU: interpret mode)
#
# The corpus: $SEQPACK_DATA, else .bench_data/chat_dev.npz in the repository (a copy carried to
# the device: `mkdir -p .bench_data && cp ../shared/data/chat_dev.npz .bench_data/`, with
# `/.bench_data/` in .git/info/exclude), else ../shared/data/chat_dev.npz. $PYTHON (default
# python3) must have jax; seqpack need not be installed: the repository root is linked as it.
set -euo pipefail
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
{
  echo "== device: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo 'no nvidia-smi')"
  "$python" -c "import jax; print('== jax', jax.__version__, jax.devices())"
  echo "== python -m benchmarks.attention_bench $smoke --data $data"
  "$python" -m benchmarks.attention_bench $smoke --data "$data" \
    --gpu-blocks 64,64,64,64 128,64,64,64 128,128,64,64 64,64,32,64
  if [[ -n "$smoke" ]]; then
    echo "== python -m benchmarks.kernels_bench --batch 1 --seq-len 128 --dim 128 --vocab 256"
    "$python" -m benchmarks.kernels_bench --batch 1 --seq-len 128 --segments 4 --dim 128 \
      --vocab 256 --repeats 1 --copy-mib 8
    echo "== python -m benchmarks.loss_head --smoke --repeats 1"
    "$python" -m benchmarks.loss_head --smoke --repeats 1
  else
    echo "== python -m benchmarks.kernels_bench --gpu-sizes"
    "$python" -m benchmarks.kernels_bench --gpu-sizes
    echo "== python -m benchmarks.loss_head --preset all"
    "$python" -m benchmarks.loss_head --preset all
  fi
} 2>&1 | if [[ -n "$log" ]]; then tee "$log"; else cat; fi
