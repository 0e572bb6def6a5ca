#!/usr/bin/env bash
# Issue 19's measurements in one device call, each phase under `timeout` inside one total budget (TOTAL_SECONDS):
#   ab       bench/ab_prefill.py: the 9B prefill of the trees in AB ("name=tarball ... name=." for this tree;
#            default: BASE, a tarball of an earlier commit, then this tree), alternated in one process (AB_ROWS;
#            AB_ARGS="--moe --layers 16": the 35B-A3B shape cut to 16 layers, so two trees fit)
#   gpu      bench/gpu.py: prefill (PREFILL rows) and batch-1 decode, ours vs HF, at SHAPE (GPU_ARGS: more flags)
#   glm      bench/glm_gpu.py: GLM's decode at GLM_BATCHES streams (through the decode runner when GLM has one)
#            and prefill, ours vs HF (only when PHASES names it)
#   profile  bench/profile_decode.py --prefill: where our prefill's GPU time goes (and HF's, with PROFILE_HF=1;
#            PROFILE_ARGS: more flags)
#   step     bench/profile_decode.py --batch DECODE_BATCH: a decode step's kernels at SHAPE (not in the default)
#   tiles    bench/moe_tiles.py --decode at the 35B-A3B's experts (TILES_ARGS, TILES_ROWS; not in the default)
#   tests    pytest -m gpu (TESTS, all GPU tests unless set); KDA's records in $OUT/kda-gpu-tests.jsonl
# JSON lines in $OUT/*.jsonl and $OUT/phases.jsonl; everything the phases print in $OUT/issue19.log.
#
#   device:     BASE=.devsnap/base.tgz bash bench/issue19_gpu.sh          (carry .whl and .devsnap)
#               AB="before=.devsnap/base.tgz tp=.devsnap/tp.tgz now=." PHASES="ab gpu" bash bench/issue19_gpu.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tensorfold-issue19}
mkdir -p "$OUT"
LOG="$OUT/issue19.log"
TOTAL=${TOTAL_SECONDS:-570}
start=$SECONDS
MIN_PHASE_SECONDS=${MIN_PHASE_SECONDS:-30}
# shellcheck source=bench/phases.sh
source "$(dirname "$0")/phases.sh"
HERE=$(pwd)

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >> "$LOG" 2>&1 && export PYTHONPATH=/tmp/site || { tail -20 "$LOG"; exit 1; }
(python3 -m pip install -q --no-deps --no-build-isolation -e core -e plugins/tensorfold_example -e tensorfold_qwen \
  -e tensorfold_glm -e tensorfold_nemotron) >> "$LOG" 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$LOG" 2>&1
phase_line install "\"seconds\": $((SECONDS - start))"

PHASES=" ${PHASES:-ab gpu profile tests} "
if [[ $PHASES == *" ab "* ]]; then
  trees=()
  for entry in ${AB:-before=${BASE:-} after=.}; do   # name=tarball (unpacked under /tmp) or name=. (this tree)
    name=${entry%%=*} source_=${entry#*=}
    if [[ $source_ == . ]]; then trees+=(--tree "$name=$HERE"); continue; fi
    mkdir -p "/tmp/ab-$name" && tar xzf "$source_" -C "/tmp/ab-$name" && trees+=(--tree "$name=/tmp/ab-$name")
  done
  TRITON_CACHE_AUTOTUNING=1 run ab "${AB_SECONDS:-170}" python3 bench/ab_prefill.py "${trees[@]}" \
    --rows ${AB_ROWS:-8192 32768} --rounds "${AB_ROUNDS:-4}" ${AB_ARGS:-} --out "$OUT"   # AB_ARGS: "--moe --layers 16"
fi
if [[ $PHASES == *" gpu "* ]]; then
  run gpu "${GPU_SECONDS:-150}" python3 bench/gpu.py --shape "${SHAPE:-qwen3_5-9b}" --batches 1 \
    --prefill ${PREFILL:-2048 8192 32768} --no-eager --out "$OUT" ${GPU_ARGS:-}   # GPU_ARGS: "--chunk 8192 --batches 1 64"
fi
if [[ $PHASES == *" glm "* ]]; then
  run glm "${GLM_SECONDS:-240}" python3 bench/glm_gpu.py --batches ${GLM_BATCHES:-1 64} --out "$OUT"
fi
if [[ $PHASES == *" profile "* ]]; then
  run profile "${PROFILE_SECONDS:-120}" python3 bench/profile_decode.py --shape "${SHAPE:-qwen3_5-9b}" \
    --prefill "${ROWS:-8192}" ${PROFILE_HF:+--hf} --top 40 --out "$OUT" ${PROFILE_ARGS:-}   # PROFILE_ARGS: "--chunk 8192"
fi
if [[ $PHASES == *" step "* ]]; then   # where a decode step's GPU time goes at DECODE_BATCH streams
  run step "${STEP_SECONDS:-150}" python3 bench/profile_decode.py --shape "${SHAPE:-qwen3_5-9b}" \
    --batch "${DECODE_BATCH:-64}" --top 40 --out "$OUT"
fi
if [[ $PHASES == *" tiles "* ]]; then   # the experts' decode kernels apart (TILES_ARGS: "--deep" sweeps instead)
  run tiles "${TILES_SECONDS:-120}" python3 bench/moe_tiles.py --decode ${TILES_ARGS:---profile} \
    --rows ${TILES_ROWS:-1 64} --hidden 2048 --inner 512 --experts 257 --top 9 --activation silu_gate --out "$OUT"
fi
if [[ $PHASES == *" tests "* ]]; then
  # shellcheck disable=SC2086
  # A test still running after TEST_STACK_AFTER seconds prints every thread's stack (a hang or a long autotune).
  OUT="$OUT" run tests "${TEST_SECONDS:-260}" python3 -m pytest -p no:cacheprovider -q -m gpu -o addopts="" \
    -o faulthandler_timeout="${TEST_STACK_AFTER:-120}" --durations=15 ${TESTS:-}
  grep -E "passed|failed|error" "$LOG" | tail -3 > "$OUT/gpu-tests.log"
  grep -E "^(FAILED|ERROR)" "$LOG" >> "$OUT/gpu-tests.log"
fi
