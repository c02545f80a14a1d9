#!/usr/bin/env bash
# One device-machine session on an H200: GPU tests, one-batch benchmarks of Llama-3.1-8B (dummy
# bf16 weights), profiles of the bs1 decode step. Results land in $OUT as few files (the device
# tool returns at most 8): session.log, results.jsonl (one line per benchmark), trace_*.json.gz.
#   usage: bash scripts/h200_bench.sh [steps...]
#   steps (default all): bs1 bs1g tests kernels bs64 bs64g bs256g p8k offline   (g: --cuda-graph)
set -u
OUT=${OUT:-out}
RES=$(mktemp -d)
mkdir -p "$OUT"
LOG="$OUT/session.log"
if compgen -G ".whl/*.whl" >/dev/null; then  # packages the image lacks (gguf, msgspec), carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
M=configs/llama-3.1-8b
BENCH=(python3 -m ketch.cli bench one-batch --model $M --load-format dummy)
STEPS="$*"

has() { [ -z "$STEPS" ] || [[ " $STEPS " == *" $1 "* ]]; }

step() {  # step NAME SECONDS CMD...: run with a time limit, log to session.log, keep its JSON
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T)): $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | grep --line-buffered -v -E "Loading weights|^\s*$" | tee -a "$LOG"
  echo "=== $name: rc=${PIPESTATUS[0]} in $((SECONDS - t0)) s" | tee -a "$LOG"
  if [ -f "$RES/$name.json" ]; then
    python3 -c "import json,sys; print(json.dumps({'step': sys.argv[1], **json.load(open(sys.argv[2]))}))" \
      "$name" "$RES/$name.json" >> "$OUT/results.jsonl"
  fi
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
} 2>&1 | tee -a "$LOG"

bs1() {  # bs1 NAME [flags]: the bs1 decode figure, with a profile of 10 decode steps
  local name=$1; shift
  step "$name" 150 "${BENCH[@]}" --batch-size 1 --input-len 128 --output-len 128 "$@" \
    --profile "$OUT/trace_$name.json" --profile-steps 10 --output-file "$RES/$name.json"
  [ -f "$OUT/trace_$name.json" ] && gzip -f "$OUT/trace_$name.json"
}
has bs1 && bs1 bs1
has bs1g && bs1 bs1g --cuda-graph
has tests && step tests 330 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu.py
has kernels && [ -f tests/test_kernels.py ] && step kernels 180 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py
has bs64 && step bs64 120 "${BENCH[@]}" --batch-size 64 --input-len 128 --output-len 128 --output-file "$RES/bs64.json"
has bs64g && step bs64g 120 "${BENCH[@]}" --batch-size 64 --input-len 128 --output-len 128 --cuda-graph \
  --output-file "$RES/bs64g.json"
has bs256g && step bs256g 150 "${BENCH[@]}" --batch-size 256 --input-len 128 --output-len 128 --cuda-graph \
  --output-file "$RES/bs256g.json"
has p8k && step p8k 120 "${BENCH[@]}" --batch-size 1 --input-len 8192 --output-len 16 --output-file "$RES/p8k.json"
has offline && step offline 200 python3 -m ketch.cli bench offline --model $M --load-format dummy --cuda-graph \
  --batch-sizes 256 --input-len 1000 --output-len 200 --max-num-batched-tokens 8192 --output-file "$RES/offline.json"
echo "=== done ($(date +%T))" | tee -a "$LOG"
