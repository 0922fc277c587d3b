#!/usr/bin/env bash
# Downloads the wheels an accelerator machine needs for seqpack's Grain pipeline and lacks:
# grain and what it imports, for the machine's CPython on manylinux x86-64, into a folder that
# benchmarks/device_run.sh installs into /tmp/site (--no-deps) at the END of PYTHONPATH, so the
# machine's own JAX and numpy stay first.
#
#   benchmarks/device_wheels.sh                  # the TPU machine: Python 3.11 -> .whl-tpu/
#   benchmarks/device_wheels.sh --gpu            # the GPU machine: Python 3.12 -> .whl-gpu/
#   benchmarks/device_wheels.sh --python 3.12    # another target Python (with either)
#
# TPU (~5 MiB): grain, array-record (grain's reader and seqpack's packed format), absl-py,
# cloudpickle, etils, protobuf, portpicker, psutil (grain's imports and its worker processes);
# the machine's own index gives optax, orbax-checkpoint and matplotlib (device_run.sh, into
# /tmp/site2, without the jax and numpy pip puts beside them).
# GPU (~5 MiB): grain, array-record, portpicker, and the loss head's PyTorch peers (pure
# Python, importing only torch and triton, which the image has: liger-kernel 0.8.5, 0.9 MiB;
# cut-cross-entropy 25.1.1, 23 KiB); its image holds the rest (absl-py, cloudpickle, etils,
# protobuf, psutil, flax, optax, orbax-checkpoint, matplotlib, pyarrow).
# Run from the repository root on a machine with a package index; carry the folder.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
kind=tpu
target=""  # the target CPython, X.Y: 3.11 for the TPU machine, 3.12 for the GPU one
while [[ $# -gt 0 ]]; do
  case "$1" in
    --gpu) kind=gpu ;;
    --python) target="${2:-}"; shift
      [[ "$target" =~ ^3\.[0-9]+$ ]] || { echo "Error: --python needs X.Y, e.g. 3.12" >&2; exit 2; } ;;
    *) echo "Error: unknown argument $1 (use --gpu, --python X.Y)" >&2; exit 2 ;;
  esac
  shift
done
[[ -n "$target" ]] || target=$([[ $kind == gpu ]] && echo 3.12 || echo 3.11)
dest="$root/.whl-$kind"
python="${PYTHON:-python3}"
packages=(grain==0.2.18 array-record==0.8.6 portpicker==1.6.0)
if [[ $kind == gpu ]]; then
  packages+=(liger-kernel==0.8.5 cut-cross-entropy==25.1.1)
fi
if [[ $kind == tpu ]]; then
  packages+=(absl-py==2.5.1 cloudpickle==3.1.3 etils==1.15.0 protobuf==6.33.6 psutil==7.2.2)
fi
mkdir -p "$dest"
for package in "${packages[@]}"; do
  "$python" -m pip download -q --no-deps --only-binary=:all: --python-version "$target" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$dest" "$package"
done
ls -l "$dest"
size_kib="$(du -sk "$dest" | cut -f1)"
echo "$(ls "$dest"/*.whl | wc -l) wheels, $((size_kib / 1024)) MiB in $dest"
if (( size_kib > 40 * 1024 )); then
  echo "Error: $dest holds more than 40 MiB; remove stale wheels (rm -r $dest) and rerun" >&2
  exit 1
fi
