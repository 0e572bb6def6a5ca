#!/usr/bin/env bash
# What the tensor-parallel code costs a TP=1 server, in one device call, at one shape from each tree given,
# alternately, ROUNDS times: bench/engine_gpu.py (greedy decode through the Engine with its graphs, as serve builds
# it, at 1 and 64 streams) and bench/gpu.py (prefill of 8k rows through `forward`, no HF). The trees are
# tarballs of a commit before the change and of one with it (BEFORE, AFTER); each is installed editable in turn.
# JSON lines in $OUT/tp1-{before,after}-{round}/{engine,gpu}.jsonl; what the runs print in $OUT/tp1.log.
#
#   device:     BEFORE=.devsnap/base.tgz AFTER=.devsnap/tp.tgz bash bench/tp1_cost.sh   (carry .whl and .devsnap)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tensorfold-tp1}
mkdir -p "$OUT"
LOG="$OUT/tp1.log"
SHAPE=${SHAPE:-qwen3_5-9b}
ROUNDS=${ROUNDS:-1}
if [ -z "${PYTHONPATH:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >> "$LOG" 2>&1 && export PYTHONPATH=/tmp/site || { tail -20 "$LOG"; exit 1; }
fi
for name in before after; do
  tree=/tmp/tp1-$name
  tarball=$([ $name = before ] && echo "$BEFORE" || echo "$AFTER")
  mkdir -p "$tree" && tar xzf "$tarball" -C "$tree"
done
for round in $(seq "$ROUNDS"); do
  for name in before after; do
    (cd /tmp/tp1-$name && python3 -m pip install -q --no-deps --no-build-isolation -e core -e tensorfold_qwen \
      -e tensorfold_glm -e tensorfold_nemotron -e plugins/tensorfold_example >> "$LOG" 2>&1 &&
     timeout "${RUN_SECONDS:-150}" python3 bench/engine_gpu.py --shape "$SHAPE" --paths engine --streams 1 64 \
       --hf-steps 0 --out "$OUT/tp1-$name-$round" >> "$LOG" 2>&1 &&
     timeout "${RUN_SECONDS:-150}" python3 bench/gpu.py --shape "$SHAPE" --batches 1 --prefill 8192 --steps 8 \
       --no-hf --no-eager --out "$OUT/tp1-$name-$round" >> "$LOG" 2>&1)
    echo "{\"bench\": \"tp1_run\", \"tree\": \"$name\", \"round\": $round, \"rc\": $?}" | tee -a "$OUT/tp1.jsonl"
  done
done
