#!/usr/bin/env bash
# Nemotron-H on the GPU in one device call, each phase under `timeout` inside one total budget (TOTAL_SECONDS):
#   tests   pytest -m gpu on the family and the kernels it uses (ssd, relu² experts), every_row on every family
#   8b      bench/gpu.py at nemotron_h-8b (dense M/*/-): decode 1/8/32/64, prefill 2k/8k/32k, ours and HF
#   30b     bench/gpu.py at nemotron_h-30b-a3b (23 M / 23 E / 6 *, 128 experts top-6), likewise
# PHASES picks a subset (e.g. PHASES="30b"), TESTS the test paths. JSON lines in $OUT/gpu.jsonl and $OUT/phases.jsonl; everything the
# phases print in $OUT/issue16.log; the tests' summary in $OUT/gpu-tests.log.
#
#   device:     bash bench/issue16_gpu.sh          (carry .whl: the wheels the device lacks)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tensorfold-issue16}
mkdir -p "$OUT"
LOG="$OUT/issue16.log"
TOTAL=${TOTAL_SECONDS:-570}
start=$SECONDS

# shellcheck source=bench/phases.sh
MIN_PHASE_SECONDS=${MIN_PHASE_SECONDS:-30}
source "$(dirname "$0")/phases.sh"

if [ "${INSTALL:-1}" = 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >> "$LOG" 2>&1 && export PYTHONPATH=/tmp/site || { tail -20 "$LOG"; exit 1; }
  python3 -m pip install -q --no-deps --no-build-isolation -e core -e plugins/tensorfold_example -e tensorfold_qwen \
    -e tensorfold_glm -e tensorfold_nemotron >> "$LOG" 2>&1 || { tail -20 "$LOG"; exit 1; }
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$LOG" 2>&1
fi
phase_line install "\"seconds\": $((SECONDS - start))"

PHASES=" ${PHASES:-tests 8b 30b} "
BENCH=(--batches 1 8 32 64 --prefill 2048 8192 32768 --steps 8 --no-eager --out "$OUT")
if [[ $PHASES == *" tests "* ]]; then
  TESTS=${TESTS:-"tensorfold_nemotron/tests tests/core/kernels/test_ssd_gpu.py tests/core/kernels/test_moe_relu2_gpu.py
    tests/core/kernels/test_moe_gpu.py tests/core/test_every_row.py"}
  # shellcheck disable=SC2086  # TESTS and EXTRA_TESTS are word lists
  run tests "${TEST_SECONDS:-240}" python3 -m pytest -p no:cacheprovider -q -m gpu -o addopts="" $TESTS ${EXTRA_TESTS:-}
  grep -E "passed|failed|error" "$LOG" | tail -3 > "$OUT/gpu-tests.log"
  grep -E "^(FAILED|ERROR)" "$LOG" >> "$OUT/gpu-tests.log"
fi
if [[ $PHASES == *" 8b "* ]]; then
  run 8b "${DENSE_SECONDS:-220}" python3 bench/gpu.py --shape nemotron_h-8b "${BENCH[@]}"
fi
if [[ $PHASES == *" 30b "* ]]; then
  run 30b "${MOE_SECONDS:-400}" python3 bench/gpu.py --shape nemotron_h-30b-a3b "${BENCH[@]}"
fi

echo "--- $OUT/gpu.jsonl, gpu-tests.log (then, when a phase failed, the end of issue16.log)"
cat "$OUT/gpu.jsonl" "$OUT/gpu-tests.log" 2>/dev/null
if grep -q '"rc": [1-9]' "$OUT/phases.jsonl"; then
  grep -v '^{' "$LOG" | grep -v "^\[transformers\]\|FutureWarning\|return forward_call\|output = func" | tail -25
fi
cat "$OUT/phases.jsonl"
