# Phases of a device call under one total budget, sourced by bench/issue*_gpu.sh: they set OUT, LOG, TOTAL and
# start (SECONDS at their start) first. A phase with less than MIN_PHASE_SECONDS left (45 unless set) is skipped.
phase_line() { echo "{\"bench\": \"phase\", \"phase\": \"$1\", $2}" | tee -a "$OUT/phases.jsonl"; }

run() {  # NAME SECONDS COMMAND...: the command under timeout (at most the time left), its output in the log
  local name=$1 want=$2 left seconds began rc
  shift 2
  left=$(( TOTAL - (SECONDS - start) ))
  seconds=$(( want < left ? want : left ))
  if (( seconds < ${MIN_PHASE_SECONDS:-45} )); then
    phase_line "$name" "\"skipped\": \"${left} s left\""
    return
  fi
  echo "=== $name (at most ${seconds} s): $*" >> "$LOG"
  began=$SECONDS
  timeout -k 20 "$seconds" "$@" >> "$LOG" 2>&1
  rc=$?
  phase_line "$name" "\"rc\": $rc, \"seconds\": $((SECONDS - began)), \"limit_s\": $seconds"
}
