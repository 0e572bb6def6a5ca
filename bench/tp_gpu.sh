#!/usr/bin/env bash
# Issue 20 in one device call on two GPUs: bench/tp_gpu.py (TP=1, then TP=2) at each shape of SHAPES, in that
# order, each under `timeout` within one total budget (TOTAL_SECONDS; a shape with too little time left is skipped,
# its phase line says so). TP_ARGS adds flags to every run (e.g. "--streams 1 64 --prefill 8192"). Then, per shape of
# RESUME_SHAPES (none unless set), bench/tp_resume.py (RESUME_ARGS: more flags), its lines in $OUT/tp_resume.jsonl.
# JSON lines in $OUT/tp.jsonl and $OUT/phases.jsonl; everything the runs print in $OUT/tp.log.
#
#   device (nvidia-h200-x2):   bash bench/tp_gpu.sh                                     (carry .whl)
#                              SHAPES=qwen3_5-moe-35b SHAPE_SECONDS=500 bash bench/tp_gpu.sh
#                              SHAPES= RESUME_SHAPES=qwen3_5-9b bash bench/tp_gpu.sh    (bench/tp_resume.py alone)
set -uo pipefail
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # no NVLink multicast (tp_gpu.py sets them in every rank too)
export TRITON_CACHE_AUTOTUNING=1          # a kernel's autotuning result is kept on disk for the next process
OUT=${OUT:-/tmp/tensorfold-tp}
mkdir -p "$OUT"
LOG="$OUT/tp.log"
TOTAL=${TOTAL_SECONDS:-570}
start=$SECONDS
MIN_PHASE_SECONDS=${MIN_PHASE_SECONDS:-60}
# shellcheck source=bench/phases.sh
source "$(dirname "$0")/phases.sh"

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >> "$LOG" 2>&1 && export PYTHONPATH=/tmp/site || { tail -20 "$LOG"; exit 1; }
(python3 -m pip install -q --no-deps --no-build-isolation -e core -e plugins/tensorfold_example -e tensorfold_qwen \
  -e tensorfold_glm -e tensorfold_nemotron) >> "$LOG" 2>&1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nvidia-smi topo -m; } >> "$LOG" 2>&1
phase_line install "\"seconds\": $((SECONDS - start))"

for shape in ${SHAPES-qwen3_5-9b qwen3_5-moe-35b glm5_next-8l-64e}; do
  # shellcheck disable=SC2086
  run "$shape" "${SHAPE_SECONDS:-185}" python3 bench/tp_gpu.py --shape "$shape" --world 1 2 --out "$OUT" ${TP_ARGS:-}
done
for shape in ${RESUME_SHAPES:-}; do   # bench/tp_resume.py: resumed == fresh through `serve --tp 2`, every tier
  run "resume-$shape" "${RESUME_SECONDS:-540}" python3 bench/tp_resume.py --shape "$shape" \
    --checkpoint "/tmp/checkpoint-$shape" --out "$OUT" ${RESUME_ARGS:-}
done
grep -h '"bench": "tp_\(tokens_all\|scaling\|run\|resume_all\|resume_kept\)"' "$OUT"/tp*.jsonl 2>/dev/null
