#!/usr/bin/env bash
# Downloads into .whl-tpu/ (git-ignored) the wheels the accelerator machine needs for seqpack's
# Grain pipeline: grain and everything it imports that the machine lacks, for CPython 3.11 on
# manylinux x86-64. The machine has Python 3.11, jax, numpy, scipy, pytest and hypothesis;
# benchmarks/device_run.sh installs these wheels into /tmp/site (--no-deps) at the END of
# PYTHONPATH, so the machine's own JAX and numpy stay first.
#
#   benchmarks/device_wheels.sh          # from the repository root, on a machine with PyPI
#
# Wheels (pinned to the versions the tests run with; ~5 MiB in all):
#   grain, array-record (grain's reader and seqpack's packed format), absl-py, cloudpickle,
#   etils, protobuf, portpicker, psutil (grain's imports and its worker processes).
# From the machine's own index instead (device_run.sh: pip --index-url file:///opt/pypi/simple
# into /tmp/site2): optax, orbax-checkpoint and matplotlib (--plot) with their dependencies;
# jax, jaxlib, numpy, scipy, ml_dtypes and opt_einsum that pip puts beside them are removed,
# so the machine's own stay the ones imported.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/.whl-tpu"
python="${PYTHON:-python3}"
packages=(
  grain==0.2.18
  array-record==0.8.6
  absl-py==2.5.1
  cloudpickle==3.1.3
  etils==1.15.0
  protobuf==6.33.6
  portpicker==1.6.0
  psutil==7.2.2
)
mkdir -p "$dest"
for package in "${packages[@]}"; do
  "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
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
