#!/usr/bin/env bash
# Issue 15 on the CPU: the multi-turn workload against `ketch serve` (bundled SmolLM2, CPU defaults)
# with the prefix cache alone, + the host tier (L2), + L2 and a file store (L3), side by side in
# one session, one server at a time, each started cold (--flush-cache after the warmup; a fresh
# store directory for L3). The device pool is limited so the workload's working set is >= 4x it.
#
#   usage: bash scripts/cpu_hicache_bench.sh [LOG]
#   env:   CLIENTS (8) ROUNDS (4) TURN (256) ANSWER (32) KV_BYTES (device pool, default 128 pages of
#          SmolLM2's bf16 K/V: 16 tok x 30 layers x 2 x 192 x 2 B = 368,640 B a page) HOST_GB (0.1)
#          PORT (38021) PASSES (2: configurations in order A B C, then C B A ...)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$REPO/.venv/bin/python}
LOG=${1:-/tmp/cpu_hicache_bench.log}
CLIENTS=${CLIENTS:-8} ROUNDS=${ROUNDS:-4} TURN=${TURN:-256} ANSWER=${ANSWER:-32}
KV_BYTES=${KV_BYTES:-$((128 * 368640))} HOST_GB=${HOST_GB:-0.1} PORT=${PORT:-38021} PASSES=${PASSES:-2}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

declare -A FLAGS=(
  [radix]=""
  [l2]="--enable-hierarchical-cache --hicache-size $HOST_GB"
  [l2_l3]="--enable-hierarchical-cache --hicache-size $HOST_GB --hicache-storage-backend file"
)
{ echo "date $(date -u +'%F %T UTC'); commit $(git -C "$REPO" rev-parse --short HEAD); $(nproc) cpus"
  lscpu | grep -E "Model name|Flags" | cut -c1-200
  echo "workload: $CLIENTS clients x $ROUNDS rounds, turn $TURN tokens, answers $ANSWER tokens; device pool $KV_BYTES B; host ${HOST_GB} GB"
} | tee -a "$LOG"

run() {  # run NAME PASS
  local name=$1 pass=$2 url="" extra=()
  if [ "$name" = l2_l3 ]; then url="file://$WORK/kv-$pass"; extra=(--hicache-storage-url "$url"); fi
  echo "=== $name pass $pass ($(date +%T)): ketch serve --kv-cache-memory $KV_BYTES ${FLAGS[$name]} ${extra[*]}" | tee -a "$LOG"
  # shellcheck disable=SC2086
  "$PY" -m ketch.cli serve --port "$PORT" --kv-cache-memory "$KV_BYTES" ${FLAGS[$name]} "${extra[@]}" \
    > "$WORK/server-$name-$pass.log" 2>&1 &
  local server=$!
  for _ in $(seq 600); do curl -sf "localhost:$PORT/health" >/dev/null && break; sleep 0.2; done
  "$PY" -m ketch.cli bench serve --port "$PORT" --dataset-name multiturn --multiturn-clients "$CLIENTS" \
    --multiturn-rounds "$ROUNDS" --multiturn-turn-len "$TURN" --random-output-len "$ANSWER" --flush-cache \
    --disable-tqdm --output-file "$WORK/$name-$pass.json" 2>&1 | tee -a "$LOG"
  curl -s "localhost:$PORT/metrics" | grep -E "^ketch_(cache_hit_tokens|hicache_storage_(read|written)_bytes|hicache_(loaded|saved)_bytes|kv_pages_total|kv_host_pages_total)" | tee -a "$LOG"
  kill -TERM $server; wait $server || true
}

for pass in $(seq "$PASSES"); do
  if [ $((pass % 2)) = 1 ]; then order="radix l2 l2_l3"; else order="l2_l3 l2 radix"; fi
  for name in $order; do run "$name" "$pass"; done
done
"$PY" - "$WORK" <<'EOF' | tee -a "$LOG"
import glob, json, statistics, sys
rows = {}
for f in sorted(glob.glob(f"{sys.argv[1]}/*-*.json")):
    name = f.rsplit("/", 1)[1].rsplit("-", 1)[0]
    m = json.load(open(f))["metrics"]
    mt = m["multiturn"]
    rows.setdefault(name, []).append((mt["mean_ttft_ms_rounds_2plus"], mt["cache_hit_rate_rounds_2plus"] or 0.0,
                                      m["output_throughput"], m["total_throughput"]))
print("config   runs  mean TTFT rounds>=2 ms (median of runs)  hit rate rounds>=2  output tok/s  total tok/s")
for name in ("radix", "l2", "l2_l3"):
    r = rows.get(name, [])
    if r:
        med = [statistics.median(x[i] for x in r) for i in range(4)]
        print(f"{name:8} {len(r):4}  {med[0]:10.0f}  {100 * med[1]:18.1f} %  {med[2]:12.1f}  {med[3]:11.1f}")
EOF
