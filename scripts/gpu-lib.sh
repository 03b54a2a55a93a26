# What gpu-check.sh and gpu-mega.sh share, sourced by both after they set
# BUDGET (seconds): the environment, the budget clock, step() and the
# summary table. Logs go to $OUT (default ./gpu-out); $G is the folder of
# the scripts (.gpu/ on the GPU machine). Never changes clocks or resets GPUs.
# Settings the sourcing script may change after sourcing it:
#   STEP_LOG    one log every step appends to (default: a log per step,
#               $OUT/<step name>.log)
#   NAME_WIDTH  the width of the summary's step column (default 34)
# shellcheck shell=bash
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-./gpu-out}"
G="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$G${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
START=$(date +%s)
SUMMARY=()
FAILED=0
STEP_LOG=""
NAME_WIDTH=34

elapsed() { echo $(( $(date +%s) - START )); }

# out_file NAME EXT: the file of $OUT for step NAME (spaces and slashes as _).
out_file() { echo "$OUT/$(echo "$1" | tr ' /' '__').$2"; }

# result_of RC: a command's result from its exit status: pass, fail(RC), or
# timeout (124 or 137, from timeout(1)).
result_of() {
  if [ "$1" -eq 124 ] || [ "$1" -eq 137 ]; then echo timeout
  elif [ "$1" -ne 0 ]; then echo "fail($1)"
  else echo pass; fi
}

# test_counts LOG: the tests passed and failed in libtest log LOG ("P F").
test_counts() {
  local p f
  p=$(grep -oE '[0-9]+ passed' "$1" 2>/dev/null | awk '{n += $1} END {print n + 0}')
  f=$(grep -oE '[0-9]+ failed' "$1" 2>/dev/null | awk '{n += $1} END {print n + 0}')
  echo "$p $f"
}

# summary_row NAME RESULT TIME: adds a row to the summary table; a result
# other than pass or skipped makes the script fail.
summary_row() {
  SUMMARY+=("$(printf "%-${NAME_WIDTH}s %-8s %6s" "$1" "$2" "$3")")
  case "$2" in pass|skipped) ;; *) FAILED=1;; esac
}

# skipped NAME WHY: records step NAME as skipped.
skipped() {
  summary_row "$1" skipped "-"
  echo "=== $1: skipped ($2)"
  LAST_RESULT=skipped
}

# step NAME MIN_SECONDS TIMEOUT CMD...: runs CMD with a timeout, tees its log,
# records pass/fail/time; skipped when fewer than MIN_SECONDS of the budget
# remain. Sets LAST_LOG (the step's log) and LAST_RESULT (pass, fail(RC),
# timeout or skipped).
step() {
  local name="$1" need="$2" limit="$3"; shift 3
  LAST_LOG="${STEP_LOG:-$(out_file "$name" log)}"
  local left=$(( BUDGET - $(elapsed) ))
  if [ "$left" -lt "$need" ]; then
    skipped "$name" "$left s of the budget left"
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit="$left"
  local tee_args=("$LAST_LOG")
  if [ -n "$STEP_LOG" ]; then
    # One log for every step: appended to, with each step's header line.
    tee_args=(-a "$STEP_LOG")
    echo "=== $name (timeout ${limit}s): $*" >> "$STEP_LOG"
  fi
  echo "=== $name (timeout ${limit}s): $*"
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "${tee_args[@]}"
  local rc=${PIPESTATUS[0]}
  local dt=$(( $(date +%s) - t0 ))
  LAST_RESULT=$(result_of "$rc")
  summary_row "$name" "$LAST_RESULT" "${dt}s"
}

# gpu_header LOG [--topology]: the date, the budget and the GPUs (with
# --topology also their list and topology matrix), shown and written to LOG.
gpu_header() {
  {
    echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'), budget ${BUDGET}s"
    if [ "${2:-}" = --topology ]; then
      nvidia-smi -L
      nvidia-smi topo -m
    fi
    nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv
  } 2>&1 | tee "$1"
}

# summary_table: one line per step, with its result and time.
summary_table() {
  printf "%-${NAME_WIDTH}s %-8s %6s\n" step result time
  for line in "${SUMMARY[@]}"; do echo "$line"; done
}

# summary WHERE [LINE...]: the closing summary (time used, WHERE the logs
# are), the LINEs, then the table.
summary() {
  local where="$1"; shift
  echo
  echo "=== summary ($(elapsed)s of ${BUDGET}s; $where)"
  for line in "$@"; do echo "$line"; done
  summary_table
}
