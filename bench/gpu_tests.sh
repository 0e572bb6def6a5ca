#!/usr/bin/env bash
# `pytest -m gpu` in SHARDS processes at once on one device (Triton's first compiles are CPU work, so shards finish
# the whole set in a fraction of one process's time), each under TEST_SECONDS. Shard i takes the files of line i of
# the SHARD_FILES file (default: bench/gpu_test_shards.txt; a line of paths per shard). Per shard: the log
# $OUT/gpu-tests-<i>.log and $OUT/gpu-tests-<i>.xml (junit: every case's outcome); the counts in
# $OUT/gpu-tests.log. Run after bench/issue19_gpu.sh's install (PYTHONPATH=/tmp/site, packages installed).
#
#   device:  PHASES=none bash bench/issue19_gpu.sh; PYTHONPATH=/tmp/site bash bench/gpu_tests.sh
set -uo pipefail
OUT=${OUT:-/tmp/tensorfold-gpu-tests}
mkdir -p "$OUT"
FILES=${SHARD_FILES:-$(dirname "$0")/gpu_test_shards.txt}
i=0
while read -r line; do
  [[ -z $line || $line == \#* ]] && continue
  i=$((i + 1))
  # shellcheck disable=SC2086
  timeout -s ABRT -k 20 "${TEST_SECONDS:-360}" python3 -X faulthandler -m pytest -p no:cacheprovider -q -m gpu \
    -o addopts="" -o faulthandler_timeout="${TEST_STACK_AFTER:-240}" --durations=5 --junitxml="$OUT/gpu-tests-$i.xml" \
    $line > "$OUT/gpu-tests-$i.log" 2>&1 &
done < "$FILES"
wait
for log in "$OUT"/gpu-tests-[0-9]*.log; do
  echo "$log: $(grep -E "^[0-9]+ (passed|failed)|[0-9]+ passed|Timeout|Aborted" "$log" | tail -1)"
  grep -E "^(FAILED|ERROR)" "$log"
done | tee "$OUT/gpu-tests.log"
