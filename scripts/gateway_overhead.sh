#!/usr/bin/env bash
# Issue 16: the latency `ketch gateway` adds per request at 64 concurrent streams. The worker is
# ketch/bench/fake_server.py (no model: exactly max_tokens tokens, one SSE event per token, a step
# every STEP_MS ms), so the only difference between the two targets is the gateway: `ketch bench
# serve` runs against the fake directly and through the gateway in front of it, alternately, in the
# same session, ROUNDS times each. Two load shapes:
#   closed: --max-concurrency 64, all requests queued (exactly 64 streams open). A new request is sent
#           as an old one ends, i.e. just after one of the fake's steps, so a request delayed by less
#           than a step still gets its first token at the same step: TTFT sees the relay of the answer
#           but hides most of the request's own delay.
#   poisson: --max-concurrency 64 and Poisson arrivals at RATE req/s (about 64 in flight at the
#           default lengths), so arrivals fall at random phases of the step and the mean (and, close
#           to it, the median) TTFT difference counts the request path too.
# Prints p50 TTFT / E2E / ITL per target and the gateway's difference (median over rounds).
#
#   usage: bash scripts/gateway_overhead.sh [LOG]
#   env:   STEP_MS (10) OUTPUT (64 tokens) INPUT (32) PROMPTS (640 per run) RATE (90) ROUNDS (3)
#          POLICY (cache_aware) CLIENTS (1: --num-client-processes) PORT (31200: the gateway; fake PORT+1)
#          PIN (unset; 1: the gateway alone on the last CPU, the fake and the client on the others, as a
#               gateway with a core of its own; the same CPUs for fake and client with both targets)
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$REPO/.venv/bin/python}
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
LOG=${1:-/tmp/gateway_overhead.log}
STEP_MS=${STEP_MS:-10} OUTPUT=${OUTPUT:-64} INPUT=${INPUT:-32} PROMPTS=${PROMPTS:-640} RATE=${RATE:-90}
ROUNDS=${ROUNDS:-3} POLICY=${POLICY:-cache_aware} CLIENTS=${CLIENTS:-1} PORT=${PORT:-31200}
GW=http://127.0.0.1:$PORT FAKE=http://127.0.0.1:$((PORT + 1))
GW_PIN=() REST_PIN=()
if [ -n "${PIN:-}" ]; then
  last=$(($(nproc) - 1))
  GW_PIN=(taskset -c "$last") REST_PIN=(taskset -c "0-$((last - 1))")
fi
WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
for u in "$GW" "$FAKE"; do
  if curl -s -o /dev/null "$u/health"; then echo "something already answers on $u: stop it first" >&2; exit 1; fi
done
wait_up() { for _ in $(seq 300); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.2; done; echo "no $1" >&2; exit 1; }

{ echo "date $(date -u +'%F %T UTC'); commit $(git -C "$REPO" rev-parse --short HEAD); $(nproc) cpus; $(lscpu | grep 'Model name' | sed 's/  */ /g')"
  echo "fake: --step-ms $STEP_MS, 1 worker; gateway --policy $POLICY; $PROMPTS prompts of $INPUT tokens, $OUTPUT out," \
       "max concurrency 64; poisson rate $RATE req/s; $ROUNDS rounds; $CLIENTS client process(es)" \
       "${PIN:+; pinned: gateway on ${GW_PIN[*]}, fake and client on ${REST_PIN[*]}}"
} | tee -a "$LOG"
"${REST_PIN[@]}" "$PY" "$REPO/ketch/bench/fake_server.py" --host 127.0.0.1 --port $((PORT + 1)) --step-ms "$STEP_MS" \
  > "$WORK/fake.log" 2>&1 &
PIDS+=($!)
wait_up "$FAKE"
"${GW_PIN[@]}" "$PY" -m ketch.cli gateway --host 127.0.0.1 --port "$PORT" --policy "$POLICY" --worker-urls "$FAKE" \
  > "$WORK/gateway.log" 2>&1 &
PIDS+=($!)
wait_up "$GW"

bench() {  # bench TARGET_NAME URL SHAPE ROUND
  local rate=inf
  [ "$3" = poisson ] && rate=$RATE
  echo "=== $1 $3 round $4 ($(date +%T); load average $(cut -d" " -f1-3 /proc/loadavg))" >> "$LOG"
  "${REST_PIN[@]}" "$PY" -m ketch.cli bench serve --base-url "$2" --num-prompts "$PROMPTS" --random-input-len "$INPUT" \
    --random-output-len "$OUTPUT" --random-range-ratio 1 --max-concurrency 64 --request-rate "$rate" \
    --num-client-processes "$CLIENTS" --warmup-requests 8 --seed "$4" --disable-tqdm \
    --output-file "$WORK/$3-$1-$4.json" >> "$LOG" 2>&1
}
for shape in closed poisson; do
  for r in $(seq "$ROUNDS"); do
    if [ $((r % 2)) = 1 ]; then bench direct "$FAKE" $shape "$r"; bench gateway "$GW" $shape "$r"
    else bench gateway "$GW" $shape "$r"; bench direct "$FAKE" $shape "$r"; fi
  done
done
"$PY" - "$WORK" <<'EOF' | tee -a "$LOG"
import glob, json, statistics, sys
keys = [("median_ttft_ms", "p50 TTFT"), ("mean_ttft_ms", "mean TTFT"), ("median_e2e_ms", "p50 E2E"),
        ("median_itl_ms", "p50 ITL"), ("p99_ttft_ms", "p99 TTFT"), ("concurrency", "concurrency"),
        ("output_throughput", "out tok/s")]
runs = {}
for f in glob.glob(f"{sys.argv[1]}/*.json"):
    shape, target, rnd = f.rsplit("/", 1)[1][:-5].split("-")
    m = json.load(open(f))["metrics"]
    runs.setdefault((shape, target), {})[int(rnd)] = m | {"busy": max(m["client"]["busy"])}
print("median over rounds; ms unless said; busy: the client's busiest process")
print(f"{'shape':8} {'target':8} " + " ".join(f"{label:>11}" for _, label in keys) + f" {'failed':>6} {'busy':>5}")
for shape in ("closed", "poisson"):
    med = {}
    for target in ("direct", "gateway"):
        rs = list(runs.get((shape, target), {}).values())
        if not rs:
            continue
        med[target] = {k: statistics.median(r[k] for r in rs) for k, _ in keys}
        failed, busy = sum(r["failed"] for r in rs), max(r["busy"] for r in rs)
        print(f"{shape:8} {target:8} " + " ".join(f"{med[target][k]:11.2f}" for k, _ in keys) + f" {failed:6} {busy:5.2f}")
    if len(med) == 2:
        print(f"{shape:8} {'added':8} " + " ".join(f"{med['gateway'][k] - med['direct'][k]:11.2f}" for k, _ in keys))
        # each round's pair (same seed, same prompts): the spread of the difference
        g, d = runs[(shape, "gateway")], runs[(shape, "direct")]
        for k, label in keys[:4]:
            diffs = [f"{g[r][k] - d[r][k]:+.2f}" for r in sorted(g) if r in d]
            print(f"{'':8} {'':8} {label} added per round: {', '.join(diffs)}")
EOF
