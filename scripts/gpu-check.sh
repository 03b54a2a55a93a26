#!/usr/bin/env bash
# Runs on the GPU machine (no Rust there), from the repository root, on what
# scripts/gpu-package.sh put into .gpu/:
#   bash .gpu/gpu-check.sh [budget-seconds]     (default budget 540)
# Order: GPU tests, the Python package's torch tests, the suites again on
# contexts made from NCCL communicators, C demo (all GPUs, then 2
# ranks), ep-bench normal, ll and an ll token sweep (all GPUs), normal and ll
# on 2 ranks (sharing the GPU on a one-GPU machine), then an SM sweep and a
# token sweep while the budget allows. Logs, and each benchmark's results as
# JSON (bench_*.json, for bench/data and bench/plot.py), go to $OUT (default
# ./gpu-out); a summary table comes last, with the number of tests passed and
# failed and of the parts they skipped (lines "skipped ...": too few GPUs or
# too little memory). Never changes clocks or resets GPUs.
# Environment: EP_GPU_TESTS_ONLY=1 stops after the tests; EP_GPU_TEST_ARGS adds
# arguments to every test binary (e.g. "--skip leaks"); EP_TEST_WORLDS limits
# the world sizes the tests run (on one GPU the whole suite takes longer than
# 10 minutes: run EP_TEST_WORLDS=1,2,4 and EP_TEST_WORLDS=8 one after the
# other).
BUDGET="${1:-540}"
# shellcheck source=scripts/gpu-lib.sh
. "$(dirname "$0")/gpu-lib.sh"
# NCCL 2.28.9 (what ep's network kernels are built for) and the CUDA runtime
# from the Python environment's NVIDIA wheels; the system's libnccl.so.2 may
# be another version, which ep refuses.
WHEELS="$(python3 -c 'import nvidia, os; print(nvidia.__path__[0])' 2>/dev/null || true)"
if [ -n "$WHEELS" ] && [ -f "$WHEELS/nccl/lib/libnccl.so.2" ]; then
  export EP_NCCL_LIBRARY="$WHEELS/nccl/lib/libnccl.so.2"
  export LD_LIBRARY_PATH="$WHEELS/nccl/lib:$WHEELS/cu13/lib:$LD_LIBRARY_PATH"
fi
TESTS_PASSED=0
TESTS_FAILED=0
TESTS_SKIPPED=0
tests_counted() {
  echo "tests: $TESTS_PASSED passed, $TESTS_FAILED failed, $TESTS_SKIPPED parts skipped"
}

gpu_header "$OUT/gpus.log" --topology
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
R=$NGPU

# count_tests LOG: adds the libtest results of LOG to the totals, and its
# "skipped ..." lines (shown by --show-output) to the skipped parts.
count_tests() {
  local p f s
  [ -f "$1" ] || return 0
  read -r p f < <(test_counts "$1")
  s=$(grep -cE '^skipped ' "$1")
  TESTS_PASSED=$((TESTS_PASSED + p)); TESTS_FAILED=$((TESTS_FAILED + f))
  TESTS_SKIPPED=$((TESTS_SKIPPED + s))
}

# 1. Correctness: every GPU test binary, one test at a time.
for t in "$G"/tests/gpu_*; do
  [ -x "$t" ] || continue
  # shellcheck disable=SC2086 # EP_GPU_TEST_ARGS is a list of arguments
  step "test $(basename "$t")" 30 300 "$t" --ignored --test-threads=1 --show-output ${EP_GPU_TEST_ARGS:-}
  count_tests "$LAST_LOG"
done
echo "=== $(tests_counted)"
if [ -n "${EP_GPU_TESTS_ONLY:-}" ]; then
  summary_table
  exit "$FAILED"
fi

# 1b. The Python package with torch on the GPUs (python3, torch and pytest are
# on the machine; the package loads this directory's libep.so).
if [ -d "$G/python/tests" ]; then
  PY=(env EP_LIBRARY="$G/libep.so" PYTHONPATH="$G/python" python3)
  step "python torch tests" 60 300 env EP_REQUIRE_GPU=1 "${PY[@]}" -m pytest -q \
    -p no:cacheprovider "$G/python/tests/test_gpu_torch.py"
  step "python example host 2 ranks" 20 120 "${PY[@]}" "$G/python/examples/torch_two_ranks.py"
  step "python example gpu" 20 120 "${PY[@]}" "$G/python/examples/torch_two_ranks.py" --gpu \
    --ranks "$(( R < 2 ? R : 2 ))"
fi

# 1c. Every mode on contexts made from NCCL communicators (NCCL windows):
# the single-node suites again with EP_TEST_NCCL=1, on every GPU.
if [ -n "${EP_NCCL_LIBRARY:-}" ]; then
  step "nccl normal" 30 300 env EP_TEST_NCCL=1 "$G/tests/gpu_normal" --ignored --test-threads=1 \
    dispatch_and_combine_match_the_reference
  step "nccl low-latency" 30 300 env EP_TEST_NCCL=1 "$G/tests/gpu_low_latency" --ignored \
    --test-threads=1 dispatch_and_combine_match_the_reference variants_match_the_reference
  [ -x "$G/tests/gpu_mega" ] && step "nccl fused" 30 300 env EP_TEST_NCCL=1 \
    "$G/tests/gpu_mega" --ignored --test-threads=1 small_and_uneven_cases_match_the_reference
  [ -x "$G/tests/gpu_moe" ] && step "nccl moe forward" 30 300 env EP_TEST_NCCL=1 \
    "$G/tests/gpu_moe" --ignored --test-threads=1 small_and_uneven_cases_match_the_reference
  [ "$NGPU" -gt 1 ] && step "nccl hierarchical" 30 300 env EP_TEST_NCCL=1 \
    "$G/tests/gpu_hierarchical" --ignored --test-threads=1 virtual_nodes_match_the_reference
  [ -x "$G/nccl_context" ] && step "nccl example ${NGPU} ranks" 20 60 "$G/nccl_context" "$NGPU"
fi

# 2. The C demo over the GPU backend (ranks as processes), all GPUs then 2.
if [ -x "$G/demo" ]; then
  step "demo gpu ${R} ranks" 20 60 env EP_BACKEND=gpu "$G/demo" "$R"
  [ "$R" -gt 2 ] && step "demo gpu 2 ranks" 20 60 env EP_BACKEND=gpu "$G/demo" 2
fi

# 3. Benchmarks: W1 normal and W2 low-latency (and its token sweep), all ranks then 2.
# bench NAME MIN_SECONDS TIMEOUT ARGS...: an ep-bench step that also writes its
# results as JSON ($OUT/bench_<name>.json, for bench/data and bench/plot.py).
B="$G/ep-bench"
bench() {
  local name="$1" need="$2" limit="$3"; shift 3
  step "$name" "$need" "$limit" "$B" "$@" --json "$(out_file "$name" json)"
}
bench "bench normal ${R} ranks" 60 180 --ranks "$R" --mode normal
bench "bench ll ${R} ranks" 40 120 --ranks "$R" --mode ll
bench "bench ll token sweep ${R} ranks" 60 180 --ranks "$R" --mode ll \
  --sweep-tokens 1,8,32,64,128,256 --iters 200
if [ "$R" -gt 2 ]; then
  bench "bench normal 2 ranks" 60 180 --ranks 2 --mode normal
  bench "bench ll 2 ranks" 40 120 --ranks 2 --mode ll
elif [ "$R" -lt 2 ]; then
  # Two ranks sharing the one GPU: a smoke run (the times are not those of
  # two GPUs; NCCL needs a GPU per rank and is left out).
  bench "bench normal 2 ranks shared GPU" 60 180 --ranks 2 --mode normal --iters 10
  bench "bench ll 2 ranks shared GPU" 40 120 --ranks 2 --mode ll --iters 50
fi

# 4. Sweeps, only while the budget allows.
bench "bench SM sweep ${R} ranks" 90 180 --ranks "$R" --mode normal --sms-sweep 16,24,32,48,64 --iters 30
bench "bench token sweep ${R} ranks" 90 240 --ranks "$R" --mode normal \
  --sweep-tokens 256,512,1024,2048,4096,8192,16384 --iters 30

# The benchmark tables, in one file ready for bench/RESULTS.md.
cat "$OUT"/bench_*.log 2>/dev/null | grep -E '^\||^\*\*|UTC, ' > "$OUT/results.md" || true

summary "logs in $OUT" "$(tests_counted)"
exit "$FAILED"
