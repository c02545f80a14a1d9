#!/usr/bin/env bash
# Issue 17: end-to-end TTFT / ITL of PD disaggregation vs a colocated server, at CONCURRENCIES
# (8 and 32) streams with a mix of long (2,048-token) and short (128-token) prompts: the case PD
# exists for (a colocated server stalls every running stream while it prefills a long prompt; a
# decode server never prefills, so decode ITL p99 must improve). Everything on loopback, bundled
# SmolLM2, CPU defaults (DEVICE=cuda works on a GPU host: then all servers share the GPUs it sees).
#   colocated: one `ketch serve` behind `ketch gateway --worker-urls` (the same gateway hop as PD)
#   pd:        `ketch serve --disaggregation-mode prefill` + `... decode` (TRANSFER backend, tcp by
#              default) behind `ketch gateway --pd-disaggregation --prefill URL BOOT --decode URL`
# Per configuration: servers started fresh, a warm-up bench (its own seed: no prompt of it comes
# back), then per concurrency C a flush of every server's prefix cache (POST /flush_cache, straight
# to the servers: the gateway does not relay it) and `ketch bench serve --dataset-name mixed
# --max-concurrency C` with seed SEED+C (so the C=32 run reuses no prompt of the C=8 run; both
# configurations get the same prompts). Servers stopped before the other configuration starts
# (memory), the order alternating over ROUNDS.
#
# Thread budget: the servers get SERVER_CPUS (default: every CPU but the last when there are 4 or
# more, else all), the gateway and the client the rest (unpinned when there is no rest). colocated:
# one server pinned (taskset) to all of SERVER_CPUS with --num-threads = their count; pd: SERVER_CPUS
# split in two halves, prefill on the first and decode on the second, --num-threads = each half's
# count. Both configurations have the same cores and the same total threads. (On a 2-CPU machine:
# colocated on CPUs 0-1 with 2 threads; prefill on 0 and decode on 1 with 1 thread each; the
# gateway and the client share them unpinned: smoke runs only.)
#
#   usage: bash scripts/pd_vs_colocated.sh [LOG]
#   env:   CONCURRENCIES ("8 32") PROMPTS_PER_STREAM (4: --num-prompts = C x this) LENS (2048,128)
#          WEIGHTS (1,1: the shares of LENS) OUTPUT (128 tokens, fixed) ROUNDS (1) SEED (1)
#          TRANSFER (tcp | nixl: UCX_TLS=tcp unless set | a backend make_transport knows)
#          SERVER_CPUS (e.g. 0-7; a taskset list of ranges) KV_GIB (2: --kv-cache-memory per server)
#          DEVICE (cpu) EXTRA_SERVE (more `ketch serve` flags for every server, e.g. "--dtype float32")
#          COLOCATED_EXTRA (flags for the colocated server only, e.g. "--chunked-prefill-size 512": the
#          colocated answer to long prompts, a fairer baseline to try beside the default)
#          PD_TIMEOUT (300: --disaggregation-timeout of both PD servers, SGLang's default; a queued prefill counts)
#          REQUEST_TIMEOUT (600 s per request) RUN_TIMEOUT (1800 s per bench run) PORT (31300: the
#          gateway; servers PORT+1.., bootstrap PORT+9) PY (the python; default REPO/.venv/bin/python)
#   real measurement (quiet machine, 8+ CPUs): bash scripts/pd_vs_colocated.sh /tmp/pd_vs_colocated.log
#          the defaults send 32 + 128 prompts (half of them 2,048 tokens) plus 4 warm-ups per configuration,
#          128 tokens out each; the long prompts' prefill dominates on a CPU: roughly 10-30 min in all on
#          8 CPUs (the smoke below, with 256/32-token prompts and 2-CPU contention, takes about 1.5 min).
#   smoke: CONCURRENCIES="2 4" PROMPTS_PER_STREAM=1 LENS=256,32 OUTPUT=8 bash scripts/pd_vs_colocated.sh
# Exit status: 1 when a server or bench run failed, or a request failed.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$REPO/.venv/bin/python}
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
export UCX_TLS=${UCX_TLS:-tcp}
LOG=${1:-/tmp/pd_vs_colocated.log}
CONCURRENCIES=${CONCURRENCIES:-8 32} PROMPTS_PER_STREAM=${PROMPTS_PER_STREAM:-4} LENS=${LENS:-2048,128}
WEIGHTS=${WEIGHTS:-1,1} OUTPUT=${OUTPUT:-128} ROUNDS=${ROUNDS:-1} SEED=${SEED:-1} TRANSFER=${TRANSFER:-tcp}
KV_GIB=${KV_GIB:-2} DEVICE=${DEVICE:-cpu} EXTRA_SERVE=${EXTRA_SERVE:-} COLOCATED_EXTRA=${COLOCATED_EXTRA:-} REQUEST_TIMEOUT=${REQUEST_TIMEOUT:-600}
RUN_TIMEOUT=${RUN_TIMEOUT:-1800} PORT=${PORT:-31300} PD_TIMEOUT=${PD_TIMEOUT:-300}
GW=http://127.0.0.1:$PORT S1=http://127.0.0.1:$((PORT + 1)) S2=http://127.0.0.1:$((PORT + 2)) BOOT=$((PORT + 9))

# the CPU budget: SERVER_CPUS for the servers (split in halves for pd), the rest for gateway + client
cpus_of() { "$PY" -c 'import sys; print(" ".join(str(c) for part in sys.argv[1].split(",") for c in (range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1))))' "$1"; }
n=$(nproc)
if [ -z "${SERVER_CPUS:-}" ]; then
  if [ "$n" -ge 4 ]; then SERVER_CPUS="0-$((n - 2))"; REST_CPUS="$((n - 1))"; else SERVER_CPUS="0-$((n - 1))"; REST_CPUS=""; fi
else
  REST_CPUS=$(comm -23 <(seq 0 $((n - 1)) | sort) <(cpus_of "$SERVER_CPUS" | tr ' ' '\n' | sort) | sort -n | paste -sd,)
fi
read -r -a ALL <<< "$(cpus_of "$SERVER_CPUS")"
NS=${#ALL[@]}
if [ "$NS" -lt 2 ]; then echo "SERVER_CPUS: two or more CPUs (prefill and decode need one each)" >&2; exit 1; fi
HALF=$((NS / 2))
PRE_CPUS=$(IFS=,; echo "${ALL[*]:0:$HALF}") DEC_CPUS=$(IFS=,; echo "${ALL[*]:$HALF}")
PRE_T=$HALF DEC_T=$((NS - HALF))
REST_PIN=()
[ -n "$REST_CPUS" ] && REST_PIN=(taskset -c "$REST_CPUS")

WORK=$(mktemp -d)
PIDS=()
stop_all() {
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  PIDS=()
}
cleanup() { stop_all; rm -rf "$WORK"; }
trap cleanup EXIT
for u in "$GW" "$S1" "$S2"; do
  if curl -s -o /dev/null "$u/health"; then echo "something already answers on $u: stop it first" >&2; exit 1; fi
done
FAILED=0
wait_up() {  # URL PID: healthy within 300 s, or the log's tail and exit 1
  for _ in $(seq 1500); do
    curl -sf "$1/health" >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || break
    sleep 0.2
  done
  echo "no $1 (log tail below)" >&2; tail -n 30 "$WORK"/*.log >&2; exit 1
}
serve() {  # NAME CPUS THREADS PORT ARGS...: a `ketch serve` pinned to CPUS
  local name=$1 cpus=$2 threads=$3 port=$4; shift 4
  # shellcheck disable=SC2086
  taskset -c "$cpus" "$PY" -m ketch.cli serve --host 127.0.0.1 --port "$port" --device "$DEVICE" \
    --num-threads "$threads" --kv-cache-memory $((KV_GIB << 30)) $EXTRA_SERVE "$@" > "$WORK/$name.log" 2>&1 &
  PIDS+=($!)
}
gateway() {
  "${REST_PIN[@]}" "$PY" -m ketch.cli gateway --host 127.0.0.1 --port "$PORT" "$@" > "$WORK/gateway.log" 2>&1 &
  PIDS+=($!)
  wait_up "$GW" $!
  for _ in $(seq 300); do [ "$(curl -s -o /dev/null -w '%{http_code}' "$GW/health")" = 200 ] && return 0; sleep 0.2; done
  echo "the gateway never saw its workers healthy" >&2; tail -n 30 "$WORK/gateway.log" >&2; exit 1
}
start() {  # colocated | pd
  if [ "$1" = colocated ]; then
    # shellcheck disable=SC2086
    serve colocated "$SERVER_CPUS" "$NS" $((PORT + 1)) $COLOCATED_EXTRA
    wait_up "$S1" "${PIDS[-1]}"
    gateway --worker-urls "$S1"
    SERVERS=("$S1")
  else
    serve prefill "$PRE_CPUS" "$PRE_T" $((PORT + 1)) --disaggregation-mode prefill \
      --disaggregation-transfer-backend "$TRANSFER" --disaggregation-bootstrap-port "$BOOT" --disaggregation-timeout "$PD_TIMEOUT"
    serve decode "$DEC_CPUS" "$DEC_T" $((PORT + 2)) --disaggregation-mode decode \
      --disaggregation-transfer-backend "$TRANSFER" --disaggregation-timeout "$PD_TIMEOUT"
    wait_up "$S1" "${PIDS[-2]}"
    wait_up "$S2" "${PIDS[-1]}"
    gateway --pd-disaggregation --prefill "$S1" "$BOOT" --decode "$S2"
    SERVERS=("$S1" "$S2")
  fi
}
bench() {  # CONFIG ROUND CONC PROMPTS SEED OUTFILE [more flags]
  local conf=$1 round=$2 conc=$3 prompts=$4 seed=$5 out=$6; shift 6
  local what="concurrency $conc"
  [ -n "$out" ] || what="warm-up, concurrency $conc, not counted"
  echo "=== $conf round $round $what ($(date +%T); load average $(cut -d" " -f1-3 /proc/loadavg))" >> "$LOG"
  local rc=0
  timeout "$RUN_TIMEOUT" "${REST_PIN[@]}" "$PY" -m ketch.cli bench serve --base-url "$GW" --dataset-name mixed \
    --mixed-input-lens "$LENS" --mixed-weights "$WEIGHTS" --random-output-len "$OUTPUT" --random-range-ratio 1 \
    --num-prompts "$prompts" --max-concurrency "$conc" --seed "$seed" --request-timeout "$REQUEST_TIMEOUT" \
    --disable-tqdm ${out:+--output-file "$out"} "$@" >> "$LOG" 2>&1 || rc=$?
  if [ "$rc" != 0 ]; then echo "bench $conf c=$conc round $round: exit $rc" | tee -a "$LOG" >&2; FAILED=1; fi
}

{ echo "# pd_vs_colocated: $0 $*"
  echo "# env: CONCURRENCIES='$CONCURRENCIES' PROMPTS_PER_STREAM=$PROMPTS_PER_STREAM LENS=$LENS WEIGHTS=$WEIGHTS" \
       "OUTPUT=$OUTPUT ROUNDS=$ROUNDS SEED=$SEED TRANSFER=$TRANSFER KV_GIB=$KV_GIB DEVICE=$DEVICE EXTRA_SERVE='$EXTRA_SERVE'" \
       "COLOCATED_EXTRA='$COLOCATED_EXTRA' UCX_TLS=$UCX_TLS PD_TIMEOUT=$PD_TIMEOUT"
  echo "# date $(date -u +'%F %T UTC'); commit $(git -C "$REPO" rev-parse --short HEAD); $n cpus;" \
       "$(lscpu | grep 'Model name' | sed 's/  */ /g'); load average $(cut -d" " -f1-3 /proc/loadavg)"
  echo "# cpus: colocated on $SERVER_CPUS ($NS threads); pd prefill on $PRE_CPUS ($PRE_T threads), decode on" \
       "$DEC_CPUS ($DEC_T threads); gateway + client on ${REST_CPUS:-the same CPUs, unpinned}"
} | tee -a "$LOG"

for r in $(seq "$ROUNDS"); do
  if [ $((r % 2)) = 1 ]; then ORDER="colocated pd"; else ORDER="pd colocated"; fi
  for conf in $ORDER; do
    start "$conf"
    bench "$conf" "$r" 2 4 $((SEED + 1000)) "" --warmup-requests 0  # warm-up: 4 prompts of another seed
    for c in $CONCURRENCIES; do
      for s in "${SERVERS[@]}"; do curl -sf -X POST "$s/flush_cache" >> "$LOG" || echo "flush $s failed" >> "$LOG"; echo >> "$LOG"; done
      bench "$conf" "$r" "$c" $((c * PROMPTS_PER_STREAM)) $((SEED + c)) "$WORK/$conf-$c-$r.json" --warmup-requests 0
    done
    stop_all
  done
done

rc=0
"$PY" - "$WORK" "$LENS" <<'EOF' | tee -a "$LOG" || rc=$?
import glob, json, statistics, sys
import numpy as np
work, lens = sys.argv[1], sorted(int(x) for x in sys.argv[2].split(","))
cut = (lens[0] + lens[-1]) / 2  # a prompt longer than this is "long" (the server's count may add a BOS)
def pct(xs, q):
    return float(np.percentile(xs, q)) * 1e3 if xs else float("nan")
runs = {}
for f in sorted(glob.glob(f"{work}/*.json")):
    conf, conc, rnd = f.rsplit("/", 1)[1][:-5].split("-")
    doc = json.load(open(f))
    ok = [r for r in doc["requests"] if r["success"]]
    itl = [g for r in ok for g in r["itl"]]
    long_, short = ([r["ttft"] for r in ok if (r["prompt_len"] > cut) == want] for want in (True, False))
    m = doc["metrics"]
    runs.setdefault((int(conc), conf), []).append({
        "ttft p50": pct([r["ttft"] for r in ok], 50), "ttft p99": pct([r["ttft"] for r in ok], 99),
        "ttft long p50": pct(long_, 50), "ttft short p50": pct(short, 50), "short p99": pct(short, 99),
        "itl p50": pct(itl, 50), "itl p99": pct(itl, 99), "itl max": max(itl) * 1e3 if itl else float("nan"),
        "out tok/s": m["output_throughput"], "failed": m["failed"], "n": len(doc["requests"])})
keys = ["ttft p50", "ttft p99", "ttft long p50", "ttft short p50", "short p99", "itl p50", "itl p99", "itl max",
        "out tok/s"]
print(f"\nms unless said; median over rounds; 'long'/'short': prompts above/below {cut:g} tokens; "
      "ITL: every gap between a request's content chunks")
print("| streams | config | " + " | ".join(keys) + " | failed/requests |")
print("|---" * (len(keys) + 3) + "|")
failed = 0
for (conc, conf), rs in sorted(runs.items()):
    med = {k: statistics.median(r[k] for r in rs) for k in keys}
    bad, total = sum(r["failed"] for r in rs), sum(r["n"] for r in rs)
    failed += bad
    print(f"| {conc} | {conf} | " + " | ".join(f"{med[k]:.1f}" for k in keys) + f" | {bad}/{total} |")
for conc in sorted({c for c, _ in runs}):
    a, b = runs.get((conc, "colocated")), runs.get((conc, "pd"))
    if a and b:
        ca, pb = (statistics.median(r["itl p99"] for r in x) for x in (a, b))
        print(f"streams {conc}: decode ITL p99 pd / colocated = {pb / ca:.2f}")
sys.exit(1 if failed else 0)
EOF
[ "$FAILED" = 0 ] && [ "$rc" = 0 ] || { echo "some run failed (see $LOG)" >&2; exit 1; }
