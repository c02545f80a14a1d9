#!/usr/bin/env bash
# Same-run A/B on the GPU: `ketch bench one-batch` with dummy weights, alternated between a base
# tree and this one, so that only same-run ratios are compared (machine starts differ by a few
# per cent). The base travels as a git-ignored copy of an older commit:
#     rm -rf .base && mkdir .base && git archive <base> | tar -x -C .base && git rev-parse --short <base> > .base/.commit
#     device run, carry [".whl", ".base"]:  source scripts/device_env.sh && bash scripts/h200_ab.sh
# Everything lands in $OUT/session.log ("== base" / "== new" headers, one bench line each).
#   usage: bash scripts/h200_ab.sh [models...]   (configs/ names; default deepseek-v2-lite qwen3-30b-a3b)
#   env:   ROUNDS (2: base/new pairs per model), ARGS (bench one-batch flags; default bs1 128/128),
#          BASE_TREE (.base; "." compares this tree with itself, e.g. under NEW_ENV),
#          NEW_ENV (assignments for the new runs only, e.g. "KETCH_PDL_EARLY=1"),
#          VARIANTS (instead of NEW_ENV: several new runs per round, ";"-separated assignment sets,
#                    e.g. "KETCH_A=1;KETCH_B=1;KETCH_A=1 KETCH_B=1": base, then each, every round;
#                    a `ketch.module.NAME=VALUE` token overrides a module constant instead, through
#                    scripts/with_constants.py, e.g. "ketch.kernels.norm_gemv.PROGRAMS_PER_SM=3"),
#          TESTS (pytest files run first on this tree, e.g. "tests/test_fused_moe_kernel.py"),
#          PROFILE=1 (then this tree once more under --profile: kernels per step, time by family)
set -u
source scripts/device_env.sh  # carried wheels, PYTHONPATH, $OUT, $LOG
MODELS=${*:-deepseek-v2-lite qwen3-30b-a3b}
ROUNDS=${ROUNDS:-2}
ARGS=${ARGS:---batch-size 1 --input-len 128 --output-len 128}
BASE_TREE=${BASE_TREE:-.base}
NEW_ENV=${NEW_ENV:-}
[ -d "$BASE_TREE/ketch" ] || { echo "no $BASE_TREE/ketch: carry a git archive of the base commit as .base" | tee -a "$LOG"; exit 2; }
echo "=== h200_ab $(date -u '+%F %T UTC'); base $BASE_TREE $(cat "$BASE_TREE/.commit" 2>/dev/null || echo '?') vs new" \
  "${KETCH_COMMIT:-?} ${NEW_ENV:+(with $NEW_ENV)}${VARIANTS:+(variants: $VARIANTS)};" \
  "$(nvidia-smi --query-gpu=name --format=csv,noheader); torch $(python3 -c 'import torch; print(torch.__version__)')" | tee -a "$LOG"
if [ -n "${TESTS:-}" ]; then
  echo "== tests $(date +%T): $TESTS" | tee -a "$LOG"
  # shellcheck disable=SC2086
  timeout 420 python3 -m pytest -q -p no:cacheprovider $TESTS 2>&1 | tail -15 | tee -a "$LOG"
fi
site=""  # the carried wheels' install (device_env.sh), ahead of whichever tree runs
[ -d /tmp/site ] && site=/tmp/site
bench() {  # bench LABEL TREE MODEL ENV [more flags]
  local label=$1 tree=$2 model=$3 envs=$4; shift 4
  echo "== $label $model $(date +%T) $envs" | tee -a "$LOG"
  local assign=() consts=() tok
  for tok in $envs; do  # KEY=value: the environment; ketch.module.NAME=value: a constant
    if [[ $tok == ketch.* ]]; then consts+=("$tok"); else assign+=("$tok"); fi
  done
  local run=(python3 -m ketch.cli)
  [ ${#consts[@]} -gt 0 ] && run=(python3 "$PWD/scripts/with_constants.py" "${consts[@]}" --)
  # shellcheck disable=SC2086
  (cd "$tree" && export PYTHONPATH="${site:+$site:}$PWD" ${assign[@]+"${assign[@]}"} \
    && python3 -c 'import ketch; print("ketch from", ketch.__file__)' \
    && timeout 300 "${run[@]}" bench one-batch --model "configs/$model" --load-format dummy $ARGS "$@") 2>&1 \
    | grep --line-buffered -E "ketch from|constant |decode step|GPU|kernels per step|ms/step|µs/step|Error|error" | tee -a "$LOG"
}
IFS=';' read -r -a NEW_RUNS <<< "${VARIANTS:-$NEW_ENV}"
[ ${#NEW_RUNS[@]} -gt 0 ] || NEW_RUNS=("")
for m in $MODELS; do
  for _ in $(seq "$ROUNDS"); do
    bench base "$BASE_TREE" "$m" ""
    for envs in "${NEW_RUNS[@]}"; do
      bench new . "$m" "$envs"
    done
  done
  if [ "${PROFILE:-0}" = 1 ]; then  # the whole summary: families and the top kernels
    (export PYTHONPATH="${site:+$site:}$PWD" $NEW_ENV && timeout 300 python3 -m ketch.cli bench one-batch \
      --model "configs/$m" --load-format dummy $ARGS --profile "$OUT/trace-$m.json" 2>&1 | grep -v "^\s*$" \
      | sed -n '/profiled steps/,$p' | head -40 | tee -a "$LOG"; gzip -f "$OUT/trace-$m.json")
  fi
done
echo "=== done ($(date +%T))" | tee -a "$LOG"
