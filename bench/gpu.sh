#!/usr/bin/env bash
# One command a device call runs end to end: install the carried wheels and this checkout, run the benchmark,
# the GPU tests and the kernel bench, and leave JSON and logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tensorfold-bench}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e core -e plugins/tensorfold_example -e tensorfold_qwen
timeout "${BENCH_SECONDS:-300}" python3 bench/gpu.py --out "$OUT" "$@" 2>&1 | grep -v "^\[transformers\]\|FutureWarning\|return forward_call" | tail -30
timeout "${TEST_SECONDS:-150}" python3 -m pytest -q -p no:cacheprovider -m "gpu or triton" -rfE tests/core tensorfold_qwen/tests \
  > "$OUT/gpu-tests.log" 2>&1; tail -15 "$OUT/gpu-tests.log"
timeout "${KERNEL_SECONDS:-90}" python3 bench/kernels_gdn.py --out "$OUT" 2>&1 | tail -20
