#!/usr/bin/env bash
# Issue 16 on the CPU: cache-aware vs round-robin routing through `ketch gateway`, side by side.
# WORKERS `ketch serve` workers (bundled SmolLM2, CPU defaults, one thread each) on loopback, each
# with a KV pool too small for every group's system prompt but together large enough for all of
# them; then `ketch gateway --policy P` in front of them for each policy in turn, and `ketch bench
# serve --dataset-name generated-shared-prefix` through it. Every run starts cold: each worker's
# prefix cache is flushed directly (POST /flush_cache; the gateway does not relay that route) and
# the gateway is a fresh process (empty trees). Prints hit rate, throughput and TTFT per run and
# the gateway's routing (requests per worker, decisions by reason).
#
#   usage: bash scripts/cpu_gateway_bench.sh [LOG]
#   env:   WORKERS (3) KV_PAGES (pages of 16 tokens per worker, 448 = 7,168 tokens: ~6.8 system prompts
#          of 1,024; SmolLM2's bf16 K/V is 368,640 B a page) NUM_GROUPS (16) PER_GROUP (8) SYSTEM (1024)
#          QUESTION (32) OUTPUT (16) CONCURRENCY (8) BACKEND (openai | openai-chat) PASSES (1: each pass
#          runs the policies in turn, alternating the order) PORT (31100: the gateway; workers above it)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$REPO/.venv/bin/python}
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
LOG=${1:-/tmp/cpu_gateway_bench.log}
WORKERS=${WORKERS:-3} KV_PAGES=${KV_PAGES:-448} NUM_GROUPS=${NUM_GROUPS:-16} PER_GROUP=${PER_GROUP:-8}
SYSTEM=${SYSTEM:-1024} QUESTION=${QUESTION:-32} OUTPUT=${OUTPUT:-16} CONCURRENCY=${CONCURRENCY:-8}
BACKEND=${BACKEND:-openai} PASSES=${PASSES:-1} PORT=${PORT:-31100}
WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

wait_up() { for _ in $(seq 600); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.2; done; echo "no $1" >&2; exit 1; }
URLS=()
for i in $(seq "$WORKERS"); do URLS+=("http://127.0.0.1:$((PORT + i))"); done
for u in "http://127.0.0.1:$PORT" "${URLS[@]}"; do
  if curl -s -o /dev/null "$u/health"; then echo "something already answers on $u: stop it first" >&2; exit 1; fi
done

{ echo "date $(date -u +'%F %T UTC'); commit $(git -C "$REPO" rev-parse --short HEAD); $(nproc) cpus; $(lscpu | grep 'Model name' | sed 's/  */ /g')"
  echo "workload: $NUM_GROUPS groups x $PER_GROUP requests, system prompt $SYSTEM tokens, question $QUESTION, output $OUTPUT," \
       "max concurrency $CONCURRENCY, backend $BACKEND; $WORKERS workers x $KV_PAGES KV pages (16 tokens) each, 1 thread each"
} | tee -a "$LOG"

for i in $(seq "$WORKERS"); do
  "$PY" -m ketch.cli serve --host 127.0.0.1 --port $((PORT + i)) --num-threads 1 \
    --kv-cache-memory $((KV_PAGES * 368640)) > "$WORK/worker-$i.log" 2>&1 &
  PIDS+=($!)
done
for u in "${URLS[@]}"; do wait_up "$u"; done
for u in "${URLS[@]}"; do  # first requests pay one-off costs: not inside a measured run
  curl -sf "$u/v1/completions" -H 'content-type: application/json' \
    -d '{"model": "SmolLM2-135M-Instruct.Q4_1.gguf", "prompt": "Warm up, please.", "max_tokens": 4}' >/dev/null
done

run() {  # run POLICY PASS
  local policy=$1 pass=$2 u
  for u in "${URLS[@]}"; do echo "flush $u: $(curl -sf -X POST "$u/flush_cache")" >> "$LOG"; done
  "$PY" -m ketch.cli gateway --host 127.0.0.1 --port "$PORT" --policy "$policy" --worker-urls "${URLS[@]}" \
    > "$WORK/gateway-$policy-$pass.log" 2>&1 &
  local gw=$!
  PIDS+=($gw)
  wait_up "http://127.0.0.1:$PORT"
  echo "=== $policy pass $pass ($(date +%T); load average $(cut -d" " -f1-3 /proc/loadavg))" | tee -a "$LOG"
  "$PY" -m ketch.cli bench serve --base-url "http://127.0.0.1:$PORT" --backend "$BACKEND" \
    --dataset-name generated-shared-prefix --gsp-num-groups "$NUM_GROUPS" --gsp-prompts-per-group "$PER_GROUP" \
    --gsp-system-prompt-len "$SYSTEM" --gsp-question-len "$QUESTION" --gsp-output-len "$OUTPUT" \
    --max-concurrency "$CONCURRENCY" --seed 1 --disable-tqdm --output-file "$WORK/$policy-$pass.json" 2>&1 | tee -a "$LOG"
  curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^ketch_gateway_(requests_total|routing_decisions_total)' \
    | tee "$WORK/$policy-$pass.routing" | tee -a "$LOG"
  kill -TERM "$gw"; wait "$gw" || true
}

for pass in $(seq "$PASSES"); do
  if [ $((pass % 2)) = 1 ]; then order="round_robin cache_aware"; else order="cache_aware round_robin"; fi
  for policy in $order; do run "$policy" "$pass"; done
done
"$PY" - "$WORK" <<'EOF' | tee -a "$LOG"
import glob, json, sys
print(f"{'policy':12} {'pass':>4} {'hit rate':>9} {'req/s':>6} {'out tok/s':>9} {'total tok/s':>11} "
      f"{'mean TTFT ms':>12} {'p50 TTFT ms':>11} {'p99 TTFT ms':>11} {'p50 E2E ms':>10} {'failed':>6}")
rates = {}
for f in sorted(glob.glob(f"{sys.argv[1]}/*-*.json")):
    policy, pass_ = f.rsplit("/", 1)[1][:-5].rsplit("-", 1)
    m = json.load(open(f))["metrics"]
    rate = m["cache_hit_rate"]
    rates.setdefault(policy, []).append(rate or 0.0)
    print(f"{policy:12} {pass_:>4} {100 * (rate or 0):8.1f}% {m['request_throughput']:6.3f} {m['output_throughput']:9.1f} "
          f"{m['total_throughput']:11.1f} {m['mean_ttft_ms']:12.0f} {m['median_ttft_ms']:11.0f} {m['p99_ttft_ms']:11.0f} "
          f"{m['median_e2e_ms']:10.0f} {m['failed']:6}")
if rates.get("round_robin") and rates.get("cache_aware"):
    ca, rr = min(rates["cache_aware"]), max(rates["round_robin"])
    print(f"hit rate cache_aware / round_robin (worst pair): {ca / rr:.2f}x" if rr else "round_robin hit rate 0")
EOF
