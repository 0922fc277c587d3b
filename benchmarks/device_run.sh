#!/usr/bin/env bash
# One device check, a table a user can compare with benchmarks/README.md. One program holds the
# accelerator at a time (each step below is one process; none starts a child that opens it):
#   1. segment attention alone, fwd and fwd+bwd against the masked alternatives (on a TPU:
#      B=4 L=8192 8 heads of 128, seqpack's defaults in both operand layouts, and with the dq
#      kernel apart (unfused), against splash attention with segment ids, 512 blocks: MaxText's
#      way);
#   2. the loss head's modes against materialized logits and MaxText-style vocab tiling
#      (benchmarks/loss_head.py --preset all: the issue's three sizes, bf16); loss_head_need:
#      at N = 65,536 the least free memory each path runs in (--need), d weight carried in
#      f32 and in bf16;
#   3. the training step (benchmarks/train_step.py: padded rows, MaxText's way, seqpack's
#      defaults, and at 8192 seqpack with materialized logits: its loss head in the step) at
#      L=8192 and 32768, both RoPE styles;
#   4. the device test suite (pytest -m device: compiled kernels against the references).
# On a GPU (Hopper) the steps are the GPU issue's: attention at L=8192 (B=4, 8 heads of 128:
# seqpack's default, its Triton tiles, cuDNN packed, MaxText's masked kernel, cuDNN dense causal)
# and attention_32k (B=1); torch_attention / torch_loss_head: the PyTorch peers on the same rows
# and sizes (benchmarks/torch_peers.py: FlexAttention, varlen_attn; Liger, Cut Cross-Entropy),
# each a process of its own after JAX's released the GPU; loss_head --preset gpu (bf16 and an
# f32 master weight); train_step with the GPU's ways (padded rows on cuDNN, MaxText's masked
# kernel, cuDNN packed, seqpack) at 8192 and 32768; kernels at the kernels benchmark's hardware
# sizes; sanitize: every GPU kernel once under compute-sanitizer (memcheck); profile_attention:
# Nsight Compute's sections of the attention kernels at L=8192 (benchmarks/gpu_probe.py runs
# both). The lent GPU machine runs 10-minute commands in a 15-minute budget: GPU_PLAN below.
# A step that fails prints "== FAILED" and the next one runs. Prints the tables; with $OUT set
# (the device tool), also writes them to $OUT/device_run.log.
#
#   benchmarks/device_run.sh            # on a TPU or GPU machine, from the repository root
#   benchmarks/device_run.sh --smoke    # tiny sizes, any machine (CPU: interpret mode)
#   benchmarks/device_run.sh --train    # instead: examples/train_lm.py at L=8192 (~7 minutes
#                                       # on a TPU v5e): packed, padded, and 200 steps of both
#                                       # in lockstep with the loss plot (--smoke --train: tiny)
#   benchmarks/device_run.sh --only attention,loss_head,train_step
#   benchmarks/device_run.sh --only train_step_32k,device_tests
#   benchmarks/device_run.sh --only loss_head_need
#                                       # the whole TPU run (~25 minutes on a v5e) in three
#                                       # calls of a device tool with a 10-minute limit
#
# GPU_PLAN (estimates, not yet timed on the chip; a fresh machine takes minutes to start):
#   benchmarks/device_run.sh --only device_tests,attention,torch_attention
#   benchmarks/device_run.sh --only loss_head,torch_loss_head,train_step
#   benchmarks/device_run.sh --only sanitize,profile_attention
#   benchmarks/device_run.sh --only attention_32k,train_step_32k,loss_head_need,kernels
#   benchmarks/device_run.sh --train
# (carry .whl-gpu: grain, array-record, portpicker, liger-kernel, cut-cross-entropy.)
#
# Grain on a machine without it: with .whl-gpu/ or .whl-tpu/ in the repository
# (benchmarks/device_wheels.sh [--gpu]),
# its wheels are installed into /tmp/site (--no-deps); where flax (the model of train_step and
# train_lm), optax, orbax-checkpoint and matplotlib are not importable, they come from the
# machine's own index (file:///opt/pypi/simple) into /tmp/site2 (less the jax and numpy pip puts
# beside them); both at the END of PYTHONPATH: the machine's own JAX stays the one imported.
# --train corpora:
# $SEQPACK_DATA_DIR, else the folder of the chat_dev.npz found below (copy gsm8k_train.npz
# beside it). Steps: $TRAIN_STEPS (100), $PADDED_STEPS (50), $COMPARE_STEPS (200), workers:
# $WORKERS (8).
#
# The corpus: $SEQPACK_DATA, else .bench_data/chat_dev.npz in the repository (a copy carried to
# the device: `mkdir -p .bench_data && cp ../shared/data/chat_dev.npz .bench_data/`, with
# `/.bench_data/` in .git/info/exclude), else ../shared/data/chat_dev.npz. $PYTHON (default
# python3) must have jax; seqpack need not be installed: the repository root is linked as it.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
smoke=""
train=""
only=""  # --only NAME[,NAME...]: the steps to run (steps_named); all when empty
steps_named="attention,attention_32k,torch_attention,kernels,loss_head,torch_loss_head"
steps_named+=",loss_head_need,train_step,train_step_32k,device_tests,sanitize,profile_attention"
while (($#)); do
  case "$1" in
    --smoke) smoke="--smoke" ;;
    --train) train="--train" ;;
    --only)
      only="${2:-}"; shift
      [[ -n "$only" ]] || { echo "Error: --only needs step names (steps: $steps_named)" >&2; exit 2; }
      for name in ${only//,/ }; do
        [[ ",$steps_named," == *",$name,"* ]] ||
          { echo "Error: unknown step $name in --only (steps: $steps_named)" >&2; exit 2; }
      done ;;
    *) echo "Error: unknown argument $1 (use --smoke, --train, --only STEPS)" >&2; exit 2 ;;
  esac
  shift
done
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
out="${OUT:-$tmp}"
cd "$root"

install_wheels() {  # grain (.whl-gpu / .whl-tpu); flax, optax, orbax-checkpoint (the machine's)
  local wheels="$root/.whl-tpu"
  [[ -d "$root/.whl-gpu" ]] && wheels="$root/.whl-gpu"
  if [[ ! -d "$wheels" ]]; then
    :  # grain installed already, or not needed (the benchmarks read no pipeline)
  elif PIP_CONFIG_FILE=/dev/null "$python" -m pip install --isolated -q --no-index --no-deps \
      --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl; then
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
    echo "== installed $(ls "$wheels"/*.whl | wc -l) wheels of $(basename "$wheels") into /tmp/site"
  else
    echo "Error: installing $wheels/*.whl into /tmp/site failed: rerun" \
      "benchmarks/device_wheels.sh here (--gpu: cp312 wheels; else cp311) and carry the folder" >&2
  fi
  if "$python" -c "import flax, optax, orbax.checkpoint, matplotlib" 2>/dev/null; then
    return 0  # the machine's own (or the test venv's)
  elif PYTHONPATH="$PYTHONPATH:/tmp/site2" "$python" -c \
      "import flax, optax, orbax.checkpoint, matplotlib" 2>/dev/null; then  # installed earlier
    export PYTHONPATH="$PYTHONPATH:/tmp/site2"
    echo "== flax, optax, orbax-checkpoint, matplotlib already importable"
  elif PIP_CONFIG_FILE=/dev/null "$python" -m pip install --isolated -q --only-binary=:all: \
      --upgrade --index-url file:///opt/pypi/simple --target /tmp/site2 flax optax \
      orbax-checkpoint matplotlib; then
    # pip --target installs every dependency, jax and numpy too: the machine's own stay first
    rm -rf /tmp/site2/{jax,jaxlib,numpy,numpy.libs,scipy,scipy.libs,ml_dtypes,opt_einsum} \
      /tmp/site2/{jax,jaxlib,numpy,scipy,ml_dtypes,opt_einsum}-*.dist-info
    export PYTHONPATH="$PYTHONPATH:/tmp/site2"
    echo "== installed flax, optax, orbax-checkpoint, matplotlib from file:///opt/pypi/simple" \
      "into /tmp/site2"
  else
    echo "Error: flax / optax / orbax-checkpoint / matplotlib did not install from" \
      "file:///opt/pypi/simple into /tmp/site2; the model (examples/lm.py) needs flax," \
      "examples/train_lm.py optax and orbax-checkpoint, its --plot matplotlib:" \
      "pip install flax optax orbax-checkpoint matplotlib" >&2
  fi
}

train_runs() {  # packed, padded, both in lockstep: figures as JSON, the curves as PNG + CSV
  local corpora="${SEQPACK_DATA_DIR:-$(dirname "$data")}" cache="$tmp/jax_cache"
  local steps="${TRAIN_STEPS:-100}" padded="${PADDED_STEPS:-50}" both="${COMPARE_STEPS:-200}"
  local common=(--data "$corpora" --workers "${WORKERS:-8}" --log-every 10)
  if [[ -n "$smoke" ]]; then
    steps="${TRAIN_STEPS:-6}" padded="${PADDED_STEPS:-4}" both="${COMPARE_STEPS:-6}"
    common=(--smoke --workers "${WORKERS:-2}" --log-every 2)
  fi
  # one schedule and a shared compilation cache: the comparison reuses the first two runs'
  # compilations, and its first steps repeat their losses
  common+=(--schedule-steps "$both" --compilation-cache "$cache")
  echo "== python -m examples.train_lm ${common[*]} --steps $steps (packed)"
  "$python" -m examples.train_lm "${common[@]}" --steps "$steps" \
    --checkpoint-dir "$tmp/ckpt" --summary "$out/train_packed.json"
  echo "== python -m examples.train_lm ${common[*]} --padded --steps $padded"
  "$python" -m examples.train_lm "${common[@]}" --padded --steps "$padded" \
    --summary "$out/train_padded.json"
  echo "== python -m examples.train_lm ${common[*]} --compare-steps $both"
  "$python" -m examples.train_lm "${common[@]}" --compare-steps "$both" --log-every 20 \
    --pipeline-batches 0 --plot "$out/packed_vs_padded.png" --summary "$out/train_compare.json"
}

install_wheels
failed=0
step() {  # step NAME COMMAND...: runs one step (if --only names it), reports a failure, goes on
  [[ -z "$only" || ",$only," == *",$1,"* ]] || return 0
  echo "== $*"
  "${@:2}" || { echo "== FAILED ($?): $1"; failed=1; }
}
{
  backend="$("$python" -c 'import jax; print(jax.default_backend())')"
  if [[ -n "$train" ]]; then
    "$python" -c "import jax, grain, optax, orbax.checkpoint as o; print('== jax', jax.__version__,
      jax.devices()); [print('==', m.__name__, 'from', m.__file__) for m in (jax, grain, optax, o)]"
    train_runs
    exit 0
  fi
  "$python" -c "import jax; print('== jax', jax.__version__, jax.devices())"
  if [[ -n "$smoke" ]]; then
    step attention "$python" -m benchmarks.attention_bench --smoke --data "$data"
    step loss_head "$python" -m benchmarks.loss_head --smoke --repeats 1
    step loss_head_need "$python" -m benchmarks.loss_head --smoke --repeats 1 --need
    step train_step "$python" -m benchmarks.train_step --smoke --data "$data"
    step torch_attention "$python" -m benchmarks.torch_peers attention --smoke --data "$data"
    step torch_loss_head "$python" -m benchmarks.torch_peers loss-head --smoke
  elif [[ "$backend" == "tpu" ]]; then
    step attention "$python" -m benchmarks.attention_bench --data "$data" --seq-lens 8192 \
      --blocks 512,1024 --batch 4 --heads 8 --kv-heads 8 --repeats 5 \
      --tpu-blocks 256,256,256,256 512,512,512,512 1024,1024,512,512
    step loss_head "$python" -m benchmarks.loss_head --preset all
    step loss_head_need "$python" -m benchmarks.loss_head --preset 64k --repeats 3 \
      --chunks 1024 2048 4096 --bf16-carry --need
    step train_step "$python" -m benchmarks.train_step --data "$data" --seq-len 8192 \
      --rope half interleaved --steps 4 --repeats 2 \
      --variants padded,maxtext,seqpack,seqpack+logits
    step train_step_32k "$python" -m benchmarks.train_step --data "$data" --seq-len 32768 \
      --rope half interleaved --steps 2 --repeats 2 --variants maxtext,seqpack
    step device_tests "$python" -m pytest -q -m device tests/test_device.py tests/test_device_segments.py -p no:cacheprovider
  else  # a GPU: GPU_PLAN's steps, the cheapest and most needed first
    "$python" -c "import jax, jaxlib; from jax._src.cudnn.fused_attention_stablehlo import \
      check_cudnn_version as v; print('== jaxlib', jaxlib.__version__, 'cuDNN', v())" || true
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    step device_tests "$python" -m pytest -q -m device tests/test_device.py tests/test_device_segments.py -p no:cacheprovider
    step attention "$python" -m benchmarks.attention_bench --data "$data" --seq-lens 8192 \
      --blocks 64,128 --batch 4 --heads 8 --kv-heads 8 --head-dim 128 --repeats 5 \
      --gpu-blocks 64,64,64,64 128,64,64,64 128,128,64,64
    step torch_attention "$python" -m benchmarks.torch_peers attention --data "$data" \
      --seq-len 8192 --batch 4 --heads 8 --kv-heads 8 --repeats 5
    step loss_head bash -c "$python -m benchmarks.loss_head --preset gpu &&
      $python -m benchmarks.loss_head --preset gpu --weight-dtype float32"
    step torch_loss_head bash -c "$python -m benchmarks.torch_peers loss-head --preset 16k &&
      $python -m benchmarks.torch_peers loss-head --preset gemma"
    step train_step "$python" -m benchmarks.train_step --data "$data" --seq-len 8192 \
      --rope half interleaved --steps 4 --repeats 2 --variants padded,maxtext,cudnn,seqpack
    step attention_32k "$python" -m benchmarks.attention_bench --data "$data" --seq-lens 32768 \
      --blocks 128 --seq-len 32768 --batch 1 --heads 8 --kv-heads 8 --head-dim 128 \
      --repeats 3 --gpu-blocks 64,64,64,64 128,64,64,64
    step train_step_32k "$python" -m benchmarks.train_step --data "$data" --seq-len 32768 \
      --rope half interleaved --steps 2 --repeats 2 --variants maxtext,cudnn,seqpack
    step loss_head_need "$python" -m benchmarks.loss_head --preset 64k --repeats 3 \
      --chunks 1024 2048 4096 --bf16-carry --need
    step kernels "$python" -m benchmarks.kernels_bench --gpu-sizes
    # every GPU kernel once under compute-sanitizer's memcheck, each buffer its own allocation
    # (XLA's pool would hide an access past a buffer's end inside it)
    step sanitize env XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool memcheck \
      --kernel-name kns=segment_ --error-exitcode 9 "$python" -m benchmarks.gpu_probe \
      --data "$data" --seq-len 1024 --batch 2 --runs 1
    # where the attention kernels' time goes at L=8192 (the second run's fwd, dq, dk/dv)
    step profile_attention ncu --clock-control none --kernel-name regex:segment_attention \
      --launch-skip 3 --launch-count 3 --section SpeedOfLight --section Occupancy \
      --section WarpStateStats --section MemoryWorkloadAnalysis "$python" -m benchmarks.gpu_probe \
      --data "$data" --only attention --seq-len 8192 --batch 4 --heads 8 --kv-heads 8 --runs 2
  fi
  exit "$failed"
} 2>&1 | if [[ -n "$log" ]]; then tee "$log"; else cat; fi
