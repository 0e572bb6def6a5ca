#!/usr/bin/env bash
# The tiers at their bandwidth in one device call, each phase under `timeout` inside one total budget (TOTAL_SECONDS):
#   base    bench/resume_engine.py from the tree in BASE (a tarball of an earlier commit, when given): the "before"
#   tests   pytest -m gpu on the tiers' CUDA tests and the qwen resume / disk tests, under TF_KV_POISON=1
#   bench   bench/resume_engine.py from this tree: the "after"
# JSON lines in $OUT/{base,after}/resume.jsonl and $OUT/phases.jsonl; everything the phases print in $OUT/issue17.log.
#
#   device:     BASE=.devsnap/base.tgz bash bench/issue17_gpu.sh          (carry .whl and .devsnap)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tensorfold-issue17}
mkdir -p "$OUT"
LOG="$OUT/issue17.log"
TOTAL=${TOTAL_SECONDS:-570}
start=$SECONDS
MIN_PHASE_SECONDS=${MIN_PHASE_SECONDS:-30}
# shellcheck source=bench/phases.sh
source "$(dirname "$0")/phases.sh"
HERE=$(pwd)
LENGTHS=${LENGTHS:-"8192 32768"}

editable() {  # install the families of the tree in $1, editable
  (cd "$1" && python3 -m pip install -q --no-deps --no-build-isolation -e core -e plugins/tensorfold_example \
    -e tensorfold_qwen -e tensorfold_glm -e tensorfold_nemotron) >> "$LOG" 2>&1
}

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >> "$LOG" 2>&1 && export PYTHONPATH=/tmp/site || { tail -20 "$LOG"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$LOG" 2>&1
phase_line install "\"seconds\": $((SECONDS - start))"

PHASES=" ${PHASES:-base tests bench} "
if [[ $PHASES == *" base "* && -n ${BASE:-} ]]; then
  mkdir -p /tmp/base && tar xzf "$BASE" -C /tmp/base && editable /tmp/base
  mkdir -p "$OUT/base"
  # shellcheck disable=SC2086
  (cd /tmp/base && run base "${BASE_SECONDS:-200}" python3 bench/resume_engine.py --shape qwen3_5-9b \
    --lengths $LENGTHS --out "$OUT/base")
fi
editable "$HERE"
if [[ $PHASES == *" tests "* ]]; then
  TESTS=${TESTS:-"tests/core/tiers/test_tiers_cuda.py tensorfold_qwen/tests/test_qwen_cuda_resume.py
    tensorfold_qwen/tests/test_qwen_cuda_disk.py tests/core/test_cuda.py"}
  # shellcheck disable=SC2086
  export TF_KV_POISON=1
  run tests "${TEST_SECONDS:-150}" python3 -m pytest -p no:cacheprovider -q -m gpu -o addopts="" $TESTS
  unset TF_KV_POISON
  grep -E "passed|failed|error" "$LOG" | tail -3 > "$OUT/gpu-tests.log"
  grep -E "^(FAILED|ERROR)" "$LOG" >> "$OUT/gpu-tests.log"
fi
if [[ $PHASES == *" bench "* ]]; then
  mkdir -p "$OUT/after"
  # shellcheck disable=SC2086
  run bench "${BENCH_SECONDS:-220}" python3 bench/resume_engine.py --shape qwen3_5-9b --lengths $LENGTHS \
    --out "$OUT/after"
fi
phase_line done "\"seconds\": $((SECONDS - start))"
