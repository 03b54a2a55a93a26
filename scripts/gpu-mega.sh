#!/usr/bin/env bash
# Runs on a Hopper GPU machine (no Rust there), on what scripts/gpu-package.sh
# put into .gpu/: the fused-kernel GPU tests, then the fused-kernel benchmark
# (bench/mega_bench.py, which needs torch), then an optional profile.
#   bash .gpu/gpu-mega.sh [budget-seconds] [steps]
# steps: a comma list of tests,sanitizer,bench,profile (default tests,bench).
# Logs go to $OUT (default ./gpu-out). Never changes clocks or resets GPUs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BUDGET="${1:-540}"
STEPS=",${2:-tests,bench},"
OUT="${OUT:-./gpu-out}"
G="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$G${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
START=$(date +%s)
SUMMARY=()
FAILED=0

elapsed() { echo $(( $(date +%s) - START )); }

# step NAME MIN_SECONDS TIMEOUT CMD...: as in gpu-check.sh. A step that timed
# out (a hung kernel) sets HUNG: later tests are skipped, and the benchmark
# times only the single-block kernels.
HUNG=0
step() {
  local name="$1" need="$2" limit="$3"; shift 3
  local left=$(( BUDGET - $(elapsed) ))
  if [ "$HUNG" -eq 1 ] && [[ "$name" == test* ]]; then
    SUMMARY+=("$(printf '%-44s %-8s %6s' "$name" skipped "-")")
    echo "=== $name: skipped (an earlier step timed out)"
    return 0
  fi
  if [ "$left" -lt "$need" ]; then
    SUMMARY+=("$(printf '%-44s %-8s %6s' "$name" skipped "-")")
    echo "=== $name: skipped ($left s of the budget left)"
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit="$left"
  local log="$OUT/mega.log"
  echo "=== $name (timeout ${limit}s): $*" | tee -a "$log"
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  local dt=$(( $(date +%s) - t0 ))
  local res=pass
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then res=timeout; HUNG=1; elif [ "$rc" -ne 0 ]; then res="fail($rc)"; fi
  [ "$res" = pass ] || FAILED=1
  SUMMARY+=("$(printf '%-44s %-8s %5ss' "$name" "$res" "$dt")")
}

{
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'), budget ${BUDGET}s"
  nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv
} 2>&1 | tee "$OUT/mega.log"

T="$G/tests/gpu_mega"
if [[ "$STEPS" == *,tests,* ]]; then
  for t in small_and_uneven_cases_match_the_reference both_calls_replay_in_a_cuda_graph_with_fresh_routing \
           decode_shape_matches_the_reference w3_shape_matches_the_reference; do
    step "test $t" 20 "${TEST_TIMEOUT:-120}" "$T" --ignored --exact "$t" --nocapture --test-threads=1
  done
fi
if [[ "$STEPS" == *,sanitizer,* ]]; then
  step "memcheck small cases" 30 180 compute-sanitizer --tool memcheck --error-exitcode 1 \
    "$T" --ignored --exact small_and_uneven_cases_match_the_reference --test-threads=1
fi
# Single blocks (the default kernels) only, unless MEGA_CLUSTERS says
# otherwise (1,2 adds the experimental clusters of 2; bench/RESULTS.md).
CLUSTERS=${MEGA_CLUSTERS:-1}
if [[ "$STEPS" == *,bench,* ]]; then
  [ "$HUNG" -eq 1 ] && CLUSTERS=1
  step "bench fused vs unfused vs torch" 30 240 env PYTHONUNBUFFERED=1 \
    python3 "$G/mega_bench.py" --lib "$G/libep.so" --clusters "$CLUSTERS"
fi
if [[ "$STEPS" == *,profile,* ]]; then
  # Every fused launch of one W3 run of each cluster size under ncu (clocks
  # left alone); the report goes to $OUT/ncu.txt.
  [ "$HUNG" -eq 1 ] && CLUSTERS=1
  step "ncu fused kernels" 60 240 ncu --clock-control none --kernel-name regex:ep_mega \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section Occupancy --log-file "$OUT/ncu.txt" env PYTHONUNBUFFERED=1 \
    python3 "$G/mega_bench.py" --lib "$G/libep.so" --shapes w3 --clusters "$CLUSTERS" \
    --iters 1 --warmup 0
fi

echo
echo "=== summary ($(elapsed)s of ${BUDGET}s; log in $OUT/mega.log)"
printf '%-44s %-8s %6s\n' step result time
for line in "${SUMMARY[@]}"; do echo "$line"; done
exit "$FAILED"
