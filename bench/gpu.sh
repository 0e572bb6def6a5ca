#!/usr/bin/env bash
# One command a device call runs end to end: install the carried wheels and this checkout, run the GPU tests
# and the benchmark, and leave JSON and logs under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tensorfold-bench}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e core -e plugins/tensorfold_example -e tensorfold_qwen
python3 -m pytest -q -p no:cacheprovider -m "gpu or triton" tests/core tensorfold_qwen/tests 2>&1 | tee "$OUT/gpu-tests.log" | tail -30
python3 bench/kernels_gdn.py 2>&1 | tee "$OUT/kernels.jsonl" || true
python3 bench/gpu.py --out "$OUT" "$@" 2>&1 | tail -40
