#!/usr/bin/env bash
# Issue 14's benchmarks in one device call, each phase under `timeout` inside one total budget (TOTAL_SECONDS):
#   1. bench/engine_gpu.py at the 9B shape: DecodeRunner alone, Engine, HF at 1/8/32/64/128 streams
#   2. bench/serving.py at the 9B shape: a random checkpoint on local disk, `tensorfold serve`, SGLang's load client
#      at concurrency 1/8/32/64/128, the figures of phase 1 beside each level
#   3. bench/engine_gpu.py at the 35B-A3B shape (runner and engine, no HF), with the time left
# JSON lines in $OUT/engine.jsonl, $OUT/serving.jsonl and $OUT/phases.jsonl (all printed at the end); everything the
# phases print in $OUT/issue14.log; the server's and the client's logs in $OUT/serving-{server,client}.log.
#
#   device:     bash bench/issue14_gpu.sh          (carry .whl: bench/serving_wheels.sh fills it)
#   35B only:   PHASES=moe bash bench/issue14_gpu.sh   (ENGINE_SECONDS, SERVING_SECONDS, MOE_SECONDS cap each phase)
#   CPU check:  SMOKE=1 INSTALL=0 CLIENT_PYTHONPATH=DIR PATH=.venv/bin:$PATH bash bench/issue14_gpu.sh
#               (tiny shapes; DIR holds what the client imports and the venv lacks: aiohttp, requests, msgspec,
#               orjson, pybase64, pillow)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tensorfold-issue14}
mkdir -p "$OUT"
LOG="$OUT/issue14.log"
TOTAL=${TOTAL_SECONDS:-560}
start=$SECONDS

if [ "${SMOKE:-0}" = 1 ]; then
  SHAPE=${SHAPE:-qwen3_5-tiny}
  MOE_SHAPE=${MOE_SHAPE-qwen3_5-moe-tiny}
  COMMON="--device cpu --dtype float32"
  ENGINE_ARGS=${ENGINE_ARGS:-"$COMMON --streams 1 4 --new 8 --hf-steps 4"}
  SERVING_ARGS=${SERVING_ARGS:-"$COMMON --levels 1 4 --output 16"}
else
  SHAPE=${SHAPE:-qwen3_5-9b}
  MOE_SHAPE=${MOE_SHAPE-qwen3_5-moe-35b}
  ENGINE_ARGS=${ENGINE_ARGS:-}
  SERVING_ARGS=${SERVING_ARGS:-}
fi
if [ -n "${CLIENT_PYTHONPATH:-}" ]; then
  SERVING_ARGS="$SERVING_ARGS --client-pythonpath $CLIENT_PYTHONPATH"
fi

# shellcheck source=bench/phases.sh
MIN_PHASE_SECONDS=${MIN_PHASE_SECONDS:-45}
source "$(dirname "$0")/phases.sh"

if [ "${INSTALL:-1}" = 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >> "$LOG" 2>&1 && export PYTHONPATH=/tmp/site || { tail -20 "$LOG"; exit 1; }
  python3 -m pip install -q --no-deps --no-build-isolation -e core -e tensorfold_qwen >> "$LOG" 2>&1 \
    || { tail -20 "$LOG"; exit 1; }
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$LOG" 2>&1
fi
phase_line install "\"seconds\": $((SECONDS - start))"

PHASES=" ${PHASES:-engine served moe} "   # a subset runs only those, e.g. PHASES=moe
if [[ $PHASES == *" engine "* ]]; then
  # shellcheck disable=SC2086  # the *_ARGS are word lists
  run "engine-$SHAPE" "${ENGINE_SECONDS:-240}" python3 bench/engine_gpu.py --shape "$SHAPE" --out "$OUT" $ENGINE_ARGS
fi
if [[ $PHASES == *" served "* ]]; then
  PID_FILE=$(mktemp)
  # shellcheck disable=SC2086
  run "served-$SHAPE" "${SERVING_SECONDS:-260}" python3 bench/serving.py --shape "$SHAPE" --out "$OUT" \
    --compare "$OUT/engine.jsonl" --pid-file "$PID_FILE" $SERVING_ARGS
  pid=$(cat "$PID_FILE")
  if [ -n "$pid" ] && grep -qs "tensorfold" "/proc/$pid/cmdline"; then  # a server the phase could not stop
    kill -9 "$pid"
    phase_line "served-$SHAPE" "\"server_killed\": true"
  fi
  rm -f "$PID_FILE"
fi
if [[ $PHASES == *" moe "* && -n $MOE_SHAPE ]]; then
  # shellcheck disable=SC2086
  run "engine-$MOE_SHAPE" "${MOE_SECONDS:-600}" python3 bench/engine_gpu.py --shape "$MOE_SHAPE" --out "$OUT" \
    --paths runner engine $ENGINE_ARGS
fi

echo "--- $OUT/engine.jsonl and serving.jsonl (then, when a phase failed, the end of issue14.log)"
cat "$OUT/engine.jsonl" "$OUT/serving.jsonl" 2>/dev/null
if grep -q '"rc": [1-9]' "$OUT/phases.jsonl"; then
  grep -v '^{' "$LOG" | grep -v "^\[transformers\]\|FutureWarning\|return forward_call" | tail -25
fi
cat "$OUT/phases.jsonl"
