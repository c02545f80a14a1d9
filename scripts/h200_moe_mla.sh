#!/usr/bin/env bash
# Issue 19 on an H200: the MoE / MLA kernels' GPU tests, their kernel benchmarks against the torch
# references and the copy bandwidth, and the DeepSeek-V2-Lite and Qwen3-30B-A3B shapes served
# with dummy weights (bs1 and batch-256 decode, offline 1000 x 1000/1000). Everything lands in
# $OUT/session.log.
#   usage: bash scripts/h200_moe_mla.sh [steps...]
#   steps (default all): tests fmoe mla models offline
#   env:   MODELS ("deepseek-v2-lite qwen3-30b-a3b": configs/ names), EXTRA (more bench flags)
set -u
source scripts/device_env.sh  # carried wheels, PYTHONPATH, $OUT, $LOG
STEPS="$*"
MODELS=${MODELS:-deepseek-v2-lite qwen3-30b-a3b}
EXTRA=${EXTRA:-}
has() { [ -z "$STEPS" ] || [[ " $STEPS " == *" $1 "* ]]; }
step() {  # step NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T)): $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | grep --line-buffered -v -E "Loading weights|^\s*$" | tee -a "$LOG"
  echo "=== $name: rc=${PIPESTATUS[0]} in $((SECONDS - t0)) s" | tee -a "$LOG"
}
echo "=== h200_moe_mla $(date -u '+%F %T UTC'); commit ${KETCH_COMMIT:-?}; $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader); torch $(python3 -c 'import torch, triton; print(torch.__version__, "triton", triton.__version__)')" | tee -a "$LOG"
if has tests; then
  # every MoE / MLA kernel's test file (~5 min on an H100); the dense kernels' and the engine's GPU
  # tests are scripts/h200_bench.sh's `suite`
  step tests 480 python3 -m pytest -q -p no:cacheprovider tests/test_fused_moe_kernel.py tests/test_moe_decode_kernel.py \
    tests/test_moe_route_kernel.py tests/test_moe_route_up_kernel.py tests/test_norm_gemv_kernel.py tests/test_head_gemv_kernel.py \
    tests/test_mla_kernels.py tests/test_mla_prepare_kernel.py tests/test_mla_attention.py -k "not smollm"
fi
has fmoe && step fmoe 240 python3 benchmarks/fused_moe.py
has mla && step mla 240 python3 benchmarks/mla_decode.py
for m in $MODELS; do
  B=(python3 -m ketch.cli bench one-batch --model configs/$m --load-format dummy $EXTRA)
  if has models; then
    step "$m-bs1" 300 "${B[@]}" --batch-size 1 --input-len 128 --output-len 128
    step "$m-bs256" 300 "${B[@]}" --batch-size 256 --input-len 128 --output-len 128 --cuda-graph-max-bs 256
  fi
  if has offline; then
    step "$m-offline" 420 python3 -m ketch.cli bench offline --model configs/$m --load-format dummy $EXTRA \
      --batch-sizes 1000 --input-len 1000 --output-len 1000 --cuda-graph-max-bs 384 --max-num-batched-tokens 8192 \
      --max-num-seqs 384
  fi
done
echo "=== done ($(date +%T))" | tee -a "$LOG"
