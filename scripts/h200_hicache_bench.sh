#!/usr/bin/env bash
# Issue 15 on the H200: the KV hierarchy under the multi-turn workload, side by side: radix only
# (the device pool alone), + the host tier (L2, --hicache-size 32 GB), + L2 and a file store on local
# disk (L3). One `ketch serve` at a time on the dummy 8B shape (configs/llama-3.1-8b-smollm2-vocab:
# Llama-3.1-8B's 32 layers, 8 KV heads x 128, so a 16-token page is 2 MiB; the bundled SmolLM2
# vocabulary so the server sees real text, with its tokenizer from the git-ignored
# carry/smollm2-tokenizer, as scripts/h200_serve_bench.sh), CUDA defaults (graphs, overlap, Triton),
# the device KV pool limited to 4 GiB (--kv-cache-memory: 2,048 pages = 32,768 tokens), each server
# cold (`bench serve --flush-cache` after its one warmup request). After each run the server's
# /metrics are scraped (counters as after - before); scripts/pcie_peak.py runs first and gives the
# PCIe peak that the host->device figure is set against.
#
#   usage: bash scripts/h200_hicache_bench.sh [radix] [l2] [l2d] [l3]  (default: radix l2 l3, in that order;
#                                                                       l2d: l2 with --hicache-io-backend direct)
#   e.g. (one device call each; each call has at most 600 s):
#          bash scripts/h200_hicache_bench.sh radix
#          SKIP_PEAK=1 bash scripts/h200_hicache_bench.sh l2
#          SKIP_PEAK=1 bash scripts/h200_hicache_bench.sh l3
#        then, here: python3 scripts/hicache_report.py table radix.json l2.json l3.json (the calls' hicache.json)
#   env: CLIENTS (64) ROUNDS (8) TURN (2048) ANSWER (64)   the workload (the issue's)
#        KV_BYTES (4294967296) HOST_GB (32) BATCH_TOKENS (8192: --max-num-batched-tokens, as the offline
#        runs; the 35 k tok/s 8K-prefill figure is one 8,192-token step) GRAPH_BS (64: --cuda-graph-max-bs;
#        at most ~15 requests fit the 4 GiB pool at once) L3_DIR (/tmp/ketch-hicache-l3, on the root disk;
#        removed before and after) L3_MAX_GB (30: a watchdog deletes the store's oldest files beyond it,
#        since the file backend has no size limit and the machine's disk is 64 GiB; 0: no watchdog)
#        DEADLINE (570: seconds for the whole call; a bench gets what is left minus 45 s and is stopped
#        then, its row marked TIMED OUT) SKIP_PEAK=1 (no pcie_peak.py) SERVE_ARGS (more serve flags)
#        PORT (30000) OUT (out/) SMOKE=1 (CPU plumbing check: the bundled SmolLM2, 4 clients x 3 rounds
#        x 64-token turns, 8-token answers, a 32-page device pool, a 0.05 GB host pool, port 32417)
#   output: $OUT/hicache.log (everything, server log tails included) and $OUT/hicache.json (pcie_peak's
#        JSON, the workload, one row per configuration with per-round TTFT and the counter deltas)
#
# Answers of 64 tokens: SGLang's benchmark/hicache/bench_multiturn.py default (--output-length 64,
# ignore_eos), so the figures compare with its; TTFT is the measured figure, and each answer only adds
# the decode time a request holds its pages (the same in every configuration). Shorter answers would
# flatter the ratio: with a 4 GiB pool only 1-2 round-8 requests (16.9 k tokens = 1,056 pages each)
# fit at once, so every queued request's TTFT includes the decode time of those ahead of it.
#
# Time per configuration at the issue's workload (estimates, H200; server start ~45 s as in run 26):
#   prompt tokens over the 8 rounds: 64 x sum_r (r x 2,048 + (r-1) x 64) = 4.83 M.
#   radix only recomputes nearly all of it (the 32 k-token pool holds < 2 round-8 prompts): ~4.8 M
#     prefill tokens at ~30 k tok/s (35 k at 8K context, less at 9-17K) = ~160 s, + decode steps that
#     run with only 1-4 requests in the pool (~20-40 s), + preemption recompute: ~200-250 s; with the
#     start, the peak (~30 s) and the stop: ~300-350 s. Fits one call; CLIENTS=48 (-25 %) if it does not.
#   L2 at 32 GB: 15,258 host pages = 244 k tokens, but 64 clients' history before round r is
#     64 x (r-1) x 2,112 tokens = 135 k x (r-1): from round 3 on it exceeds the host pool, and the
#     clients come back in the same cyclic order each round, so LRU evicts each history just before it
#     is asked for again: expect host hits in round 2 and few after. Then L2 recomputes about as much
#     as radix AND copies every published page to the host (write_through, synchronous on the engine
#     thread): ~4.8 M tokens x 128 KiB = ~630 GB of device->host copies. Estimate 250-450 s: one call
#     for l2, one for l3 (L3 adds the background writes; the store is capped at L3_MAX_GB on disk, while
#     the workload's KV is 1.08 M tokens x 128 KiB = 142 GB).
#   CLIENTS=12 keeps the whole conversation in the 32 GB host pool (12 x 16,896 tokens = 12,672 pages
#     of 15,258, 17 % headroom; 14 would be the most that fit) with a working set 6.2x the device pool;
#     radix then recomputes ~0.9 M tokens: all three configurations fit one call (~400 s).
set -u
cd "$(dirname "$0")/.."
SMOKE=${SMOKE:-0}
CONFIGS=${*:-radix l2 l3}
if [ "$SMOKE" = 1 ]; then
  OUT=${OUT:-/tmp/h200_hicache_smoke}
  [ -n "${PY:-}" ] || { [ -x .venv/bin/python ] && PY=.venv/bin/python; }
  MODEL=${MODEL-} TOKENIZER=${TOKENIZER-} LOAD_FORMAT=${LOAD_FORMAT-}
  CLIENTS=${CLIENTS:-4} ROUNDS=${ROUNDS:-3} TURN=${TURN:-64} ANSWER=${ANSWER:-8}
  KV_BYTES=${KV_BYTES:-$((32 * 368640))} HOST_GB=${HOST_GB:-0.05} PORT=${PORT:-32417}
  BATCH_TOKENS=${BATCH_TOKENS:-2048} DEADLINE=${DEADLINE:-1200} L3_MAX_GB=${L3_MAX_GB:-1}
  L3_DIR=${L3_DIR:-/tmp/ketch-hicache-l3-smoke-$$}
else
  MODEL=${MODEL-configs/llama-3.1-8b-smollm2-vocab} TOKENIZER=${TOKENIZER-carry/smollm2-tokenizer}
  LOAD_FORMAT=${LOAD_FORMAT-dummy}
  CLIENTS=${CLIENTS:-64} ROUNDS=${ROUNDS:-8} TURN=${TURN:-2048} ANSWER=${ANSWER:-64}
  KV_BYTES=${KV_BYTES:-4294967296} HOST_GB=${HOST_GB:-32} PORT=${PORT:-30000}
  BATCH_TOKENS=${BATCH_TOKENS:-8192} DEADLINE=${DEADLINE:-570} L3_MAX_GB=${L3_MAX_GB:-30}
fi
GRAPH_BS=${GRAPH_BS:-64} SERVE_ARGS=${SERVE_ARGS:-} L3_DIR=${L3_DIR:-/tmp/ketch-hicache-l3}
source scripts/device_env.sh  # $OUT, PYTHONPATH (this tree's ketch), carried wheels
PY=${PY:-python3}
LOG=$OUT/hicache.log SUMMARY=$OUT/hicache.json
WORK=$(mktemp -d)
REPORT=("$PY" scripts/hicache_report.py)
log() { echo "=== $* ($(date +%T), +${SECONDS}s)" | tee -a "$LOG"; }

MODEL_ARGS=() BENCH_TOK=()
[ -n "$MODEL" ] && MODEL_ARGS+=(--model "$MODEL")
[ -n "$LOAD_FORMAT" ] && MODEL_ARGS+=(--load-format "$LOAD_FORMAT")
if [ -n "$TOKENIZER" ]; then
  [ -e "$TOKENIZER" ] || { echo "tokenizer $TOKENIZER missing: carry it (scripts/save_tokenizer.py makes it)" | tee -a "$LOG"; exit 1; }
  MODEL_ARGS+=(--tokenizer "$TOKENIZER"); BENCH_TOK=(--tokenizer "$TOKENIZER")
fi
COMMON=(--port "$PORT" --kv-cache-memory "$KV_BYTES" --max-num-batched-tokens "$BATCH_TOKENS")
[ "$SMOKE" = 1 ] || COMMON+=(--cuda-graph-max-bs "$GRAPH_BS")

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
  echo "commit ${KETCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}; $(nproc) cpus; $(free -g | awk '/Mem:/{print $2 " GiB RAM"}')"
  echo "configs: $CONFIGS; smoke: $SMOKE; model ${MODEL:-bundled} (${LOAD_FORMAT:-auto}); tokenizer ${TOKENIZER:-default}"
  echo "workload: $CLIENTS clients x $ROUNDS rounds, $TURN-token turns, $ANSWER-token answers (ignore_eos)"
  echo "serve: ${COMMON[*]} $SERVE_ARGS; host ${HOST_GB} GB; L3 $L3_DIR (cap ${L3_MAX_GB} GB); deadline ${DEADLINE} s"
  df -hT "$(dirname "$L3_DIR")" 2>/dev/null | tail -1; date -u +"date %F %T UTC"; } 2>&1 | tee -a "$LOG"
"$PY" - "$SUMMARY" "$CLIENTS" "$ROUNDS" "$TURN" "$ANSWER" "$KV_BYTES" "$HOST_GB" "$BATCH_TOKENS" "$SMOKE" \
  "${KETCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" <<'EOF'
import json, os, sys, time
p, *v = sys.argv[1:]
s = json.load(open(p)) if os.path.exists(p) else {}
keys = ("clients", "rounds", "turn", "answer", "kv_bytes", "host_gb", "batch_tokens", "smoke", "commit")
s["meta"] = dict(zip(keys, v)) | {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
json.dump(s, open(p, "w"), indent=1)
EOF

if [ "${SKIP_PEAK:-0}" != 1 ]; then
  log "pcie_peak"
  timeout 150 "$PY" scripts/pcie_peak.py --out "$WORK/pcie.json" 2>&1 | tee -a "$LOG"
  "$PY" -c 'import json,sys; s=json.load(open(sys.argv[1])); s["pcie"]=json.load(open(sys.argv[2])); json.dump(s,open(sys.argv[1],"w"),indent=1)' \
    "$SUMMARY" "$WORK/pcie.json" 2>/dev/null || log "pcie_peak gave no JSON"
fi

stop_server() {  # stop_server PID: SIGTERM, 60 s, then SIGKILL to it and the children it had
  local pid=$1 kids
  kids=$(ps -o pid= --ppid "$pid" 2>/dev/null | tr '\n' ' ')
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 120); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  if kill -0 "$pid" 2>/dev/null; then log "server $pid still up 60 s after SIGTERM: SIGKILL (children: $kids)"; kill -KILL "$pid"; fi
  wait "$pid" 2>/dev/null; log "server exit code $?"
  for k in $kids; do  # the engine process and helpers it had: 10 s more, then SIGKILL by id
    for _ in $(seq 20); do kill -0 "$k" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$k" 2>/dev/null && { log "child $k still up: SIGKILL ($(ps -o args= -p "$k" | cut -c1-80))"; kill -KILL "$k"; }
  done
}

run_config() {  # run_config NAME
  local name=$1 flags=() note="" guard=""
  case $name in
    radix) ;;
    l2) flags=(--enable-hierarchical-cache --hicache-size "$HOST_GB") ;;
    l2d) flags=(--enable-hierarchical-cache --hicache-size "$HOST_GB" --hicache-io-backend direct) ;;
    l3) flags=(--enable-hierarchical-cache --hicache-size "$HOST_GB" --hicache-storage-backend file
               --hicache-storage-url "file://$L3_DIR")
        rm -rf "$L3_DIR"; mkdir -p "$L3_DIR"
        log "L3 store $L3_DIR: $(df -hT "$L3_DIR" | tail -1)"
        if [ "$(df --output=fstype "$L3_DIR" | tail -1)" = tmpfs ]; then note="L3 dir is on tmpfs (memory), not disk"; log "warning: $note"; fi
        if [ "${L3_MAX_GB%.*}" != 0 ]; then
          "${REPORT[@]}" l3cap "$L3_DIR" "$L3_MAX_GB" "$WORK/l3cap.txt" & guard=$!
        fi ;;
    *) log "unknown config $name (radix | l2 | l2d | l3)"; return ;;
  esac
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 120 ]; then
    log "$name not run: ${left} s left of the ${DEADLINE} s deadline"
    "${REPORT[@]}" row "$name" /nonexistent /nonexistent /nonexistent "$SUMMARY" --note "not run: ${left} s left"
    [ -n "$guard" ] && kill "$guard"; return
  fi
  log "$name: serve ${MODEL_ARGS[*]} ${COMMON[*]} ${flags[*]} $SERVE_ARGS"
  # shellcheck disable=SC2086
  "$PY" -m ketch.cli serve "${MODEL_ARGS[@]}" "${COMMON[@]}" "${flags[@]}" $SERVE_ARGS > "$WORK/server-$name.log" 2>&1 &
  local server=$!
  for _ in $(seq 600); do  # until healthy, or the server died, or 300 s
    curl -sf "localhost:$PORT/health" >/dev/null && break; kill -0 $server 2>/dev/null || break; sleep 0.5; done
  if ! curl -sf "localhost:$PORT/health" >/dev/null; then
    log "$name: server not healthy"; tr '\r' '\n' < "$WORK/server-$name.log" | grep -v "Loading weights" | tail -40 | tee -a "$LOG"
    stop_server $server
    "${REPORT[@]}" row "$name" /nonexistent /nonexistent /nonexistent "$SUMMARY" --note "server did not start"
    [ -n "$guard" ] && kill "$guard"; return
  fi
  log "$name: healthy"
  "${REPORT[@]}" scrape "http://127.0.0.1:$PORT/metrics" "$WORK/$name-before.json"
  left=$((DEADLINE - SECONDS - 45))
  [ "$left" -lt 30 ] && left=30
  log "$name: bench (stopped after ${left} s)"
  timeout "$left" "$PY" -m ketch.cli bench serve --port "$PORT" "${BENCH_TOK[@]}" --dataset-name multiturn \
    --multiturn-clients "$CLIENTS" --multiturn-rounds "$ROUNDS" --multiturn-turn-len "$TURN" \
    --random-output-len "$ANSWER" --flush-cache --disable-tqdm --output-file "$WORK/$name.json" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]} to=()
  [ "$rc" = 124 ] && { to=(--timed-out "$left"); log "$name: bench TIMED OUT after ${left} s"; }
  log "$name: bench rc=$rc"
  "${REPORT[@]}" scrape "http://127.0.0.1:$PORT/metrics" "$WORK/$name-after.json"
  grep -E '^ketch_(cache_hit|hicache|kv_host|preempt)' <(curl -s "localhost:$PORT/metrics") | tee -a "$LOG"
  stop_server $server
  log "$name: server log (last 40 lines)"
  tr '\r' '\n' < "$WORK/server-$name.log" | grep -v -E "Loading weights|^\s*$" | tail -40 | tee -a "$LOG"
  if [ -n "$guard" ]; then
    kill "$guard"; wait "$guard" 2>/dev/null
    [ -f "$WORK/l3cap.txt" ] && { cat "$WORK/l3cap.txt" | tee -a "$LOG"; note="${note:+$note; }$(cat "$WORK/l3cap.txt")"; }
    log "L3 store at the end: $(du -sh "$L3_DIR" | cut -f1) in $(find "$L3_DIR" -type f | wc -l) files; removing it"
    rm -rf "$L3_DIR"
  fi
  "${REPORT[@]}" row "$name" "$WORK/$name.json" "$WORK/$name-before.json" "$WORK/$name-after.json" "$SUMMARY" \
    "${to[@]}" --note "$note"
}

for name in $CONFIGS; do run_config "$name"; done
log "table"
# shellcheck disable=SC2086
"${REPORT[@]}" table "$SUMMARY" ${PREV:-} 2>&1 | tee -a "$LOG"
rm -rf "$WORK"
log "done"
