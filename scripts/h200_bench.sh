#!/usr/bin/env bash
# One device-machine session on an H200: GPU tests, one-batch benchmarks of Llama-3.1-8B (dummy
# bf16 weights), a profile of the bs1 decode step, the offline throughput run. Results land in
# $OUT as few files (the device tool returns at most 8): session.log, results.jsonl (one line
# per benchmark), trace_*.json.gz.
#   usage: [KETCH_COMMIT=<sha>] [SKIP_SUITE=<why>] bash scripts/h200_bench.sh [steps...]
#   steps (default all): suite bs1 bs1-sync bs1-nopdl bs1-torch bs1-tattn bs1-eager kernels tests tests-new gemv
#                        pdl-tests tests-4l kernels-gemv
#                        bs64 bs64-torch bs256 bs256-sync bs256-torch p8k p8k-torch offline offline-sync
#                        offline-prof probe probe-fp8 tests-fp8 bs256-fp8 offline-fp8 offline-fp8-768
# The CUDA defaults are Triton attention + Triton layer kernels + decode CUDA graphs + overlap
# scheduling;
#   -sync  : --disable-overlap-schedule (each step processed before the next is scheduled)
#   -torch : --attention-backend torch --layer-kernels torch (the earlier path, graphs on)
#   -tattn : Triton attention, torch layer kernels (isolates the fused norm/RoPE/SiLU kernels)
#   -eager : --disable-cuda-graph
#   -fp8   : --kv-cache-dtype fp8_e4m3
# The GPU suite runs whenever the kernels change: the script hashes the *.py files of
# ketch/kernels, ketch/attention and ketch/runner (no git needed on the device machine) and, unless
# a log in docs/perf-logs/ holds "=== suite passed at kernel tree <that hash>", runs step `suite`
# first, whatever steps were asked for (about 7-8 minutes of device time). `suite` = tests/test_gpu.py,
# then every other test file that runs on the GPU (-k "not smollm": the bundled GGUF is not on the
# device machine); when both pass it logs that line, so keep the session log in docs/perf-logs/.
# `suite` in the step list runs it regardless. The smaller test steps (kernels, tests, tests-new,
# pdl-tests, tests-4l, kernels-gemv, tests-fp8) are skipped in a session that ran the suite.
set -u
RES=$(mktemp -d)
source scripts/device_env.sh  # carried wheels (gguf, msgspec, ...), PYTHONPATH, $OUT, $LOG
M=configs/llama-3.1-8b
BENCH=(python3 -m ketch.cli bench one-batch --model $M --load-format dummy)
TORCH=(--attention-backend torch --layer-kernels torch)
STEPS="$*"

has() { [ -z "$STEPS" ] || [[ " $STEPS " == *" $1 "* ]]; }

step() {  # step NAME SECONDS CMD...: run with a time limit, log to session.log, keep its JSON
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T)): $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | grep --line-buffered -v -E "Loading weights|^\s*$" | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s" | tee -a "$LOG"
  if [ -f "$RES/$name.json" ]; then
    python3 -c "import json,sys; print(json.dumps({'step': sys.argv[1], **json.load(open(sys.argv[2]))}))" \
      "$name" "$RES/$name.json" >> "$OUT/results.jsonl"
  fi
  return "$rc"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
  date -u +"date %F %T UTC"
} 2>&1 | tee -a "$LOG"
KTREE=$(find ketch/kernels ketch/attention ketch/runner -name '*.py' -type f | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)
echo "commit ${KETCH_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}; kernel tree $KTREE" | tee -a "$LOG"
SUITE_DONE=
if [ -n "${SKIP_SUITE:-}" ] && ! has suite; then  # the caller ran (or runs) the suite in its own call
  echo "=== suite not run here: $SKIP_SUITE" | tee -a "$LOG"
elif has suite || ! grep -qs -- "=== suite passed at kernel tree $KTREE" docs/perf-logs/*.log; then
  has suite || echo "=== kernel tree $KTREE has no passing suite in docs/perf-logs: running the suite first" | tee -a "$LOG"
  step suite-gpu 480 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu.py; rc_gpu=$?
  step suite-rest 300 python3 -m pytest -q -s -p no:cacheprovider tests/test_kernels.py tests/test_triton_attention_backend.py tests/test_triton_runner.py \
    tests/test_fp8_kv_*.py tests/test_pdl.py tests/test_gemv.py tests/test_memory_plan.py tests/test_sampling.py -k "not smollm"
  rc_rest=$?
  [ "$rc_gpu" = 0 ] && [ "$rc_rest" = 0 ] && echo "=== suite passed at kernel tree $KTREE" | tee -a "$LOG"
  SUITE_DONE=1
fi
hast() { [ -z "$SUITE_DONE" ] && has "$1"; }  # a test step the suite already covers

bs1() {  # bs1 NAME [flags]: the bs1 decode figure, with a profile of 10 decode steps
  local name=$1; shift
  step "$name" 120 "${BENCH[@]}" --batch-size 1 --input-len 128 --output-len 128 "$@" \
    --profile "$OUT/trace_$name.json" --profile-steps 10 --output-file "$RES/$name.json"
  [ -f "$OUT/trace_$name.json" ] && gzip -f "$OUT/trace_$name.json"
}
one() {  # one NAME BATCH IN OUT SECONDS [flags]
  local name=$1 b=$2 i=$3 o=$4 limit=$5; shift 5
  step "$name" "$limit" "${BENCH[@]}" --batch-size "$b" --input-len "$i" --output-len "$o" "$@" --output-file "$RES/$name.json"
}
has bs1 && bs1 bs1
has bs1-sync && bs1 bs1-sync --disable-overlap-schedule
has bs1-torch && bs1 bs1-torch "${TORCH[@]}"
has bs1-tattn && one bs1-tattn 1 128 128 90 --layer-kernels torch
has bs1-eager && one bs1-eager 1 128 128 90 --disable-cuda-graph
hast kernels && step kernels 150 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_triton_attention_backend.py tests/test_triton_runner.py
hast tests && step tests 420 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu.py
# the memory plan and the GEMV kernel on the GPU (tests/test_gpu.py has the overlap test)
hast tests-new && step tests-new 200 python3 -m pytest -q -s -p no:cacheprovider tests/test_memory_plan.py tests/test_gemv.py
has gemv && step gemv 120 python3 scripts/gemv_ab.py
# programmatic dependent launch (on by default on sm_90+): its GPU tests, A/B with KETCH_DISABLE_PDL=1,
# and the engine's 4-layer bf16 GPU tests with it on
hast pdl-tests && step pdl-tests 90 python3 -m pytest -q -x -p no:cacheprovider tests/test_pdl.py
has bs1-nopdl && step bs1-nopdl 90 env KETCH_DISABLE_PDL=1 "${BENCH[@]}" --batch-size 1 --input-len 128 --output-len 128 \
  --output-file "$RES/bs1-nopdl.json"
hast tests-4l && step tests-4l 150 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu.py -k "4-layer-bf16"
hast kernels-gemv && step kernels-gemv 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_gemv.py
# decode attention vs GEMMs on two streams at once, per layer, and a block/split sweep of decode attention
has probe && step probe 240 python3 scripts/overlap_probe.py --sweep
has probe-fp8 && step probe-fp8 120 python3 scripts/overlap_probe.py --sweep --kv-dtypes float8_e4m3fn --rows 384 --contexts 1500
# (the SmolLM2 tests need the bundled GGUF, which the device machine does not have)
hast tests-fp8 && step tests-fp8 240 python3 -m pytest -q -s -p no:cacheprovider tests/test_fp8_kv_*.py tests/test_kernels.py \
  -k "fp8 and not smollm"
has bs64 && one bs64 64 128 128 90
has bs64-torch && one bs64-torch 64 128 128 90 "${TORCH[@]}"
prof() {  # prof NAME BATCH [flags]: decode at BATCH with a profile of 10 steps (GPU idle between steps)
  local name=$1 b=$2; shift 2
  step "$name" 120 "${BENCH[@]}" --batch-size "$b" --input-len 128 --output-len 128 "$@" \
    --profile "$OUT/trace_$name.json" --profile-steps 10 --output-file "$RES/$name.json"
  [ -f "$OUT/trace_$name.json" ] && gzip -f "$OUT/trace_$name.json"
}
has bs256 && prof bs256 256
has bs256-sync && prof bs256-sync 256 --disable-overlap-schedule
has bs256-fp8 && prof bs256-fp8 256 --kv-cache-dtype fp8_e4m3
has bs256-torch && one bs256-torch 256 128 128 100 "${TORCH[@]}"
has p8k && one p8k 1 8192 16 90
has p8k-torch && one p8k-torch 1 8192 16 90 "${TORCH[@]}"
# 1,000 prompts submitted at once; 384 run at a time (384 x 2,000 tokens fit the ~864 K-token pool,
# so nothing is preempted), decode graphs up to 384
OFF=(python3 -m ketch.cli bench offline --model $M --load-format dummy --batch-sizes 1000 --input-len 1000
     --output-len 1000 --cuda-graph-max-bs 384 --max-num-batched-tokens 8192)
# every offline run prints its GPU time by step kind from CUDA events; offline-prof also profiles two
# step windows (a prefill burst, then decode-only steps), which stalls the run (~4 s per start, ~3 s per
# export): its throughput is not the figure
has offline && step offline 300 "${OFF[@]}" --max-num-seqs 384 --output-file "$RES/offline.json"
has offline-prof && step offline-prof 300 "${OFF[@]}" --max-num-seqs 384 --output-file "$RES/offline-prof.json" \
  --profile "$OUT/trace_offline" --profile-windows 10:13,500:504
has offline-sync && step offline-sync 300 "${OFF[@]}" --max-num-seqs 384 --disable-overlap-schedule \
  --output-file "$RES/offline-sync.json"
has offline-fp8 && step offline-fp8 300 "${OFF[@]}" --max-num-seqs 384 --kv-cache-dtype fp8_e4m3 \
  --output-file "$RES/offline-fp8.json"
# fp8 pages hold twice the tokens: 768 x 2,000 fit
has offline-fp8-768 && step offline-fp8-768 300 "${OFF[@]}" --max-num-seqs 768 --cuda-graph-max-bs 768 \
  --kv-cache-dtype fp8_e4m3 --output-file "$RES/offline-fp8-768.json"
for f in "$OUT"/trace_offline*.json; do [ -f "$f" ] && gzip -f "$f"; done
echo "=== done ($(date +%T))" | tee -a "$LOG"
