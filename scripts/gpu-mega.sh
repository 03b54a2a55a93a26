#!/usr/bin/env bash
# Runs on a Hopper GPU machine (no Rust there), on what scripts/gpu-package.sh
# put into .gpu/: the fused-kernel GPU tests, then the fused-kernel benchmark
# (bench/mega_bench.py, which needs torch), then an optional profile.
#   bash .gpu/gpu-mega.sh [budget-seconds] [steps]
# steps: a comma list of tests,sanitizer,bench,profile (default tests,bench).
# MEGA_RANKS=N (default 1) runs the benchmark on N GPUs (mega_bench.py
# --ranks N: one process per GPU, one context); the profile stays on one.
# Logs go to $OUT (default ./gpu-out). Never changes clocks or resets GPUs.
BUDGET="${1:-540}"
STEPS=",${2:-tests,bench},"
# shellcheck source=scripts/gpu-lib.sh
. "$(dirname "$0")/gpu-lib.sh"
STEP_LOG="$OUT/mega.log"
NAME_WIDTH=44

# mega_step NAME MIN_SECONDS TIMEOUT CMD...: step (gpu-lib.sh). A step that
# timed out (a hung kernel) sets HUNG: later tests are skipped, and the
# benchmark times only the single-block kernels.
HUNG=0
mega_step() {
  if [ "$HUNG" -eq 1 ] && [[ "$1" == test* ]]; then
    skipped "$1" "an earlier step timed out"
    return 0
  fi
  step "$@"
  if [ "$LAST_RESULT" = timeout ]; then HUNG=1; fi
}

gpu_header "$STEP_LOG"

T="$G/tests/gpu_mega"
if [[ "$STEPS" == *,tests,* ]]; then
  for t in small_and_uneven_cases_match_the_reference both_calls_replay_in_a_cuda_graph_with_fresh_routing \
           decode_shape_matches_the_reference w3_shape_matches_the_reference; do
    mega_step "test $t" 20 "${TEST_TIMEOUT:-120}" "$T" --ignored --exact "$t" --nocapture --test-threads=1
  done
fi
if [[ "$STEPS" == *,sanitizer,* ]]; then
  # API errors are not reported: the library looks each kernel up in every
  # kernel file's module in turn (src/runtime/cuda.rs, Module::function),
  # and each module without it answers CUDA_ERROR_NOT_FOUND, which the
  # sanitizer would count as errors (dozens of them) and fail the step.
  mega_step "memcheck small cases" 30 180 compute-sanitizer --tool memcheck --report-api-errors no \
    --error-exitcode 1 "$T" --ignored --exact small_and_uneven_cases_match_the_reference --test-threads=1
fi
# Single blocks (the default kernels) only, unless MEGA_CLUSTERS says
# otherwise (1,2 adds the experimental clusters of 2; bench/RESULTS.md).
CLUSTERS=${MEGA_CLUSTERS:-1}
RANKS=${MEGA_RANKS:-1}
# Several ranks add the processes' start and the contexts' rendezvous.
BENCH_TIMEOUT=240
[ "$RANKS" != 1 ] && BENCH_TIMEOUT=360
if [[ "$STEPS" == *,bench,* ]]; then
  [ "$HUNG" -eq 1 ] && CLUSTERS=1
  mega_step "bench fused vs unfused vs torch" 30 "$BENCH_TIMEOUT" env PYTHONUNBUFFERED=1 \
    python3 "$G/mega_bench.py" --lib "$G/libep.so" --ranks "$RANKS" --clusters "$CLUSTERS"
fi
if [[ "$STEPS" == *,profile,* ]]; then
  # Every fused launch of one W3 run of each cluster size under ncu (clocks
  # left alone); the report goes to $OUT/ncu.txt.
  [ "$HUNG" -eq 1 ] && CLUSTERS=1
  mega_step "ncu fused kernels" 60 240 ncu --clock-control none --kernel-name regex:ep_mega \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section Occupancy --log-file "$OUT/ncu.txt" env PYTHONUNBUFFERED=1 \
    python3 "$G/mega_bench.py" --lib "$G/libep.so" --shapes w3 --clusters "$CLUSTERS" \
    --iters 1 --warmup 0
fi

summary "log in $STEP_LOG"
exit "$FAILED"
