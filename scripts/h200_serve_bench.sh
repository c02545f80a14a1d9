#!/usr/bin/env bash
# Issue 13 on a GPU: the offline engine vs `ketch serve` + `ketch bench serve` on the same work
# (N requests of 256 random input tokens / 128 output tokens, ignore_eos) at each concurrency;
# dummy weights of a real shape, with the bundled SmolLM2's tokenizer (saved from the GGUF into the
# git-ignored carry/smollm2-tokenizer: scripts/save_tokenizer.py) so the server sees real text.
# While `bench serve` runs at the highest concurrency, py-spy samples the server (API and engine
# processes) and the benchmark client; their summaries go to the session log.
# LOAD_FORMAT=gguf (or auto) runs real weights instead (the bundled SmolLM2 GGUF, joined from
# its two carried halves). `bench serve` prints the server's mean engine step over each run
# beside the median TPOT; the offline lines print the engine's mean step at the same concurrency.
# SERVE_ARGS adds `ketch serve` options (e.g. "--api-server-count 4"), CLIENTS sets the benchmark's
# --num-client-processes (default 2), OFFLINE=0 skips the offline runs (a second serving
# configuration in the same session).
#   usage: bash scripts/h200_serve_bench.sh MODEL NAME [CONCURRENCY:REQUESTS ...]
#   e.g.   bash scripts/h200_serve_bench.sh configs/llama-3.1-8b-smollm2-vocab 8b 64:1024 256:2048
#          LOAD_FORMAT=gguf bash scripts/h200_serve_bench.sh carry/smollm2.gguf smollm2 64:1024 256:2048
set -u
source scripts/device_env.sh
M=$1 NAME=$2; shift 2
RUNS=${*:-64:1024 256:2048}
TOK=${TOKENIZER:-carry/smollm2-tokenizer}
PORT=${PORT:-30000}
LOAD=${LOAD_FORMAT:-dummy}
SPY=${SPY-$(command -v py-spy || true)}  # SPY= runs without the profile
SERVE_ARGS=${SERVE_ARGS:-} CLIENTS=${CLIENTS:-2} OFFLINE=${OFFLINE:-1}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
  echo "commit ${KETCH_COMMIT:-unknown}; model $M ($LOAD weights); tokenizer $TOK; runs $RUNS; cpus $(nproc)"
  echo "serve options: ${SERVE_ARGS:-none}; client processes $CLIENTS; offline runs: $OFFLINE"
  echo "py-spy: ${SPY:-not found}"; date -u +"date %F %T UTC"; } 2>&1 | tee -a "$LOG"
log() { echo "=== $NAME $*" | tee -a "$LOG"; }

for run in $RUNS; do  # the offline engine: all N submitted at once, at most C running
  [ "$OFFLINE" = 1 ] || break
  c=${run%%:*} n=${run##*:}
  log "offline c=$c n=$n ($(date +%T))"
  timeout 300 python3 -m ketch.cli bench offline --model "$M" --load-format "$LOAD" --batch-sizes "$n" \
    --max-num-seqs "$c" --input-len 256 --output-len 128 --output-file "$OUT/$NAME-offline-c$c.json" 2>&1 \
    | grep -v -E "Loading weights|^\s*$" | tee -a "$LOG"
done

log "serve start ($(date +%T))"
python3 -m ketch.cli serve --model "$M" --load-format "$LOAD" --tokenizer "$TOK" --port "$PORT" $SERVE_ARGS \
  > "$OUT/$NAME-server.log" 2>&1 &
SERVER=$!
for _ in $(seq 600); do  # until healthy, or the server has died
  curl -sf "localhost:$PORT/health" >/dev/null && break; kill -0 $SERVER 2>/dev/null || break; sleep 0.5; done
curl -sf "localhost:$PORT/health" >/dev/null || { log "server not healthy"; tail -30 "$OUT/$NAME-server.log" | tee -a "$LOG"; kill $SERVER; exit 1; }
last=${RUNS##* }
for run in $RUNS; do
  c=${run%%:*} n=${run##*:}
  BENCH=(python3 -m ketch.cli bench serve --port "$PORT" --tokenizer "$TOK" --random-input-len 256
         --random-output-len 128 --random-range-ratio 1.0 --num-prompts "$n" --max-concurrency "$c"
         --ignore-eos --disable-tqdm --num-client-processes "$CLIENTS" --output-file "$OUT/$NAME-serve-c$c.json")
  log "serve c=$c n=$n ($(date +%T))"
  if [ "$run" = "$last" ] && [ -n "$SPY" ]; then
    # the server's processes (API and engine) sampled without pausing them, bounded: a py-spy
    # that recorded the client too (and --subprocesses without --nonblocking) hung a run here
    timeout 60 "$SPY" record --subprocesses --nonblocking -p $SERVER -d 15 -r 50 -f raw -o /tmp/spy-server.txt \
      > /tmp/spy-server.log 2>&1 &
    spy=$!
    timeout 400 "${BENCH[@]}" 2>&1 | tee -a "$LOG"
    wait $spy
    log "py-spy server (exit $?)"; tail -2 /tmp/spy-server.log 2>/dev/null | tee -a "$LOG"
    [ -s /tmp/spy-server.txt ] && timeout 60 python3 scripts/pyspy_summary.py /tmp/spy-server.txt --top 25 | tee -a "$LOG"
  else
    timeout 400 "${BENCH[@]}" 2>&1 | tee -a "$LOG"
  fi
done
kill -TERM $SERVER
for _ in $(seq 60); do kill -0 $SERVER 2>/dev/null || break; sleep 0.5; done  # its shutdown deadline is 30 s
if kill -0 $SERVER 2>/dev/null; then
  log "server still up 30 s after SIGTERM: its processes, then SIGKILL"
  ps -o pid,ppid,stat,etime,args --ppid $SERVER -p $SERVER | tee -a "$LOG"
  timeout 20 py-spy dump --pid $SERVER 2>&1 | tail -40 | tee -a "$LOG"
  kill -KILL $SERVER
fi
wait $SERVER; log "server exit code $?"
log "done ($(date +%T))"
