#!/usr/bin/env bash
# Issue 19's closing call on the tree as it will land: its decode figures (bench/gpu.py, the model path, --no-hf:
# HF's figures are earlier calls'): the 35B-A3B at batch 1 and 64 streams, the 9B at batch 1; then the whole
# `pytest -m gpu` (bench/gpu_tests.sh: every shard of bench/gpu_test_shards.txt at once, each under the time left,
# at most TEST_SECONDS). One total budget (TOTAL_SECONDS). Results under $OUT: gpu.jsonl, gpu-tests.log (the
# counts), phases.jsonl, logs.tgz. GLM=1 adds GLM's batch-1 decode (bench/glm_gpu.py --no-hf) before the tests.
#
#   device:  bash bench/issue19_final.sh        (carry .whl: bench/device_wheels.sh)
set -uo pipefail
export PYTHONUNBUFFERED=1
export OUT=${OUT:-/tmp/tensorfold-issue19-final}
mkdir -p "$OUT"
LOG="$OUT/final.log"
TOTAL=${TOTAL_SECONDS:-570}
start=$SECONDS
MIN_PHASE_SECONDS=${MIN_PHASE_SECONDS:-40}
# shellcheck source=bench/phases.sh
source "$(dirname "$0")/phases.sh"

PHASES=none TOTAL_SECONDS=120 OUT="$OUT" bash bench/issue19_gpu.sh >> "$LOG" 2>&1
phase_line install "\"seconds\": $((SECONDS - start))"
export PYTHONPATH=/tmp/site
run moe "${MOE_SECONDS:-130}" python3 bench/gpu.py --shape qwen3_5-moe-35b --batches 1 64 --prefill 2048 --no-hf \
  --no-eager --steps 128 --out "$OUT"
run dense "${DENSE_SECONDS:-90}" python3 bench/gpu.py --shape qwen3_5-9b --batches 1 --prefill 2048 --no-hf \
  --no-eager --steps 128 --out "$OUT"
if [[ -n ${GLM:-} ]]; then   # GLM=1: GLM's batch-1 decode too (its experts take the lone pairs' tiles as well)
  run glm "${GLM_SECONDS:-120}" python3 bench/glm_gpu.py --batches 1 --prefill 2048 --steps 64 --no-hf --out "$OUT"
fi
left=$(( TOTAL - (SECONDS - start) - 30 ))
shard_seconds=$(( left < ${TEST_SECONDS:-300} ? left : ${TEST_SECONDS:-300} ))
run tests $((shard_seconds + 25)) env TEST_SECONDS="$shard_seconds" bash bench/gpu_tests.sh   # each shard's limit
cat "$OUT/gpu-tests.log" 2>/dev/null
grep -h '"decode\|hardware' "$OUT"/gpu.jsonl "$OUT"/glm*.jsonl 2>/dev/null
(cd "$OUT" && tar czf logs.tgz ./*.log gpu-tests-*.xml 2>/dev/null && rm -f gpu-tests-*.log gpu-tests-*.xml issue19.log)
cat "$OUT/phases.jsonl"
