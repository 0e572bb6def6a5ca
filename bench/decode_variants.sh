#!/usr/bin/env bash
# One device call for the 35B-A3B's batch-1 decode (issue 19): install; the GPU tests of the decode's kernels and
# Qwen's CUDA decode (4 shards at once, TEST_SECONDS each); bench/decode_sweep.py's variants of the decode in one
# process (3 rounds, each variant's graphs captured anew); the 9B's A/B of the same switches. Results under $OUT:
# sweep.jsonl, gpu.jsonl, gpu-tests.log, phases.jsonl, logs.tgz.
#
#   device:  bash bench/decode_variants.sh        (carry .whl: bench/device_wheels.sh)
set -uo pipefail
export OUT=${OUT:-/tmp/tensorfold-decode-variants}
mkdir -p "$OUT"
T0=$SECONDS
phase() { echo "{\"bench\": \"phase\", \"phase\": \"$1\", \"rc\": ${2:-0}, \"at\": $((SECONDS - T0))}" >> "$OUT/phases.jsonl"; }
PHASES=none TOTAL_SECONDS=120 bash bench/issue19_gpu.sh > "$OUT/install.log" 2>&1; phase install $?
export PYTHONPATH=/tmp/site
SHARDS=$(mktemp)
cat > "$SHARDS" <<'LIST'
tests/core/kernels/test_linear_norm.py tests/core/kernels/test_moe_router.py tests/core/kernels/test_paged_attention.py tests/core/kernels/test_moe_routing.py tests/core/kernels/test_paged_write.py
tensorfold_qwen/tests/test_qwen_cuda_decode.py
tensorfold_qwen/tests/test_qwen_cuda_resume.py tensorfold_qwen/tests/test_qwen_cuda_pdl.py
tests/core/kernels/test_moe_gpu.py
LIST
SHARD_FILES=$SHARDS TEST_SECONDS=${TEST_SECONDS:-140} bash bench/gpu_tests.sh > /dev/null 2>&1; phase tests
cat "$OUT/gpu-tests.log"
L=tensorfold.kernels.linear_norm.triton_linear_norm
M=tensorfold.kernels.moe.triton_moe
G=tensorfold.kernels.gated_delta.triton_recurrent
Q=tensorfold_qwen.decode
R=tensorfold.kernels.moe.triton_routing
W=tensorfold.kernels.paged_write
timeout -k 10 "${SWEEP_SECONDS:-330}" python3 bench/decode_sweep.py --shape qwen3_5-moe-35b --rounds 3 --steps 128 \
  --combine 0.005 --out "$OUT" \
  --variant input_gemv=$Q:INPUT_GEMV=True --variant gate_apart=$Q:GATE_IN_ATTENTION=False \
  --variant input_gemv_stages4=$Q:INPUT_GEMV=True,$L:NUM_STAGES=4 --variant gemv_stages4=$L:NUM_STAGES=4 \
  --variant gemv_bn16=$L:BLOCK_N=16 --variant gemv_bn64=$L:BLOCK_N=64 \
  --variant gemv_w8=$L:NUM_WARPS=8 \
  --variant moe_bf16=$M:PAIR_BLOCK_F=16 --variant moe_be64=$M:PAIR_BLOCK_E=64 \
  --variant moe_stepE256=$M:PAIR_STEP_E=256 --variant moe_stepF128=$M:PAIR_STEP_F=128 \
  --variant moe_be128=$M:PAIR_BLOCK_E=128 --variant moe_w8=$M:PAIR_WARPS=8 \
  --variant gdn_bv64=$G:BLOCK_V=64 --variant gdn_bv16=$G:BLOCK_V=16 --variant route_max_min=$R:PACKED_KEYS=False \
  --variant rows_by_torch=$W:ONE_LAUNCH=False \
  > "$OUT/sweep.log" 2>&1; phase sweep $?
grep "^# " "$OUT/sweep.log" | tr "\n" ";"; echo
LEFT=$(( ${TOTAL_SECONDS:-560} - (SECONDS - T0) ))
(( LEFT > 40 )) && timeout -k 10 $LEFT python3 bench/gpu.py --shape qwen3_5-9b --batches 1 --prefill 2048 --no-hf \
  --no-eager --steps 128 --input-gemv ab --gate-in-attention ab --out "$OUT" > "$OUT/bench-9b.log" 2>&1
phase 9b $?
grep -h '"decode\|hardware' "$OUT/gpu.jsonl" 2>/dev/null
(cd "$OUT" && tar czf logs.tgz ./*.log gpu-tests-*.xml 2>/dev/null && rm -f gpu-tests-*.log gpu-tests-*.xml install.log \
  issue19.log bench-9b.log sweep.log)
cat "$OUT/phases.jsonl"
