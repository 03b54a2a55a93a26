#!/usr/bin/env bash
# The run on a machine of several GPUs (2, 4 or 8), on what
# scripts/gpu-package.sh put into .gpu/, in parts that each fit in ten
# minutes:
#   bash .gpu/gpu-multi.sh PARTS [budget-seconds]   (default budget 540)
# PARTS: a comma list of
#   lanes   every GPU test binary but gpu_normal with a GPU per rank
#           (ranks as threads and as processes; the binaries in parallel
#           lanes), and beside them the long repeatability runs (10,000
#           randomized dispatch+combine iterations, normal and low-latency,
#           twice, hashes compared);
#   normal  gpu_normal alone, at the world sizes with a GPU per rank (the
#           others are the shared part's): its reference test takes
#           minutes at world 4, more than a lane has beside the others
#           (bench/RESULTS.md, 4 x H200 and 4 x H100);
#   shared  the normal-mode suites with every rank on one GPU
#           (CUDA_VISIBLE_DEVICES=0): gpu_normal a step per world size
#           above 1, the others at every world size;
#   checks  what must not share the GPUs with other tests (the leak test,
#           which compares the device's free memory), the Python package's
#           torch tests, the NCCL-communicator suites, the C demo;
#   bench   W1 (normal mode: 256 and 4096 tokens, then an SM sweep) and W2
#           (low-latency mode, 1 and 128 tokens) at a rank per GPU, each
#           beside an NCCL all-to-all of the same payload; W3 (the fused
#           calls) at one rank and a rank per GPU; the hierarchical plans'
#           bytes per leg;
#   tests   lanes,normal,shared,checks.
# Logs and JSON results go to $OUT (default ./gpu-out), packed into
# $OUT/logs-<parts>.tgz at the end (with summary-<parts>.txt beside it), so
# that a runner that fetches only a few files gets them all. Never changes
# clocks or resets GPUs.
PARTS="${1:-tests}"
BUDGET="${2:-540}"
FINAL_OUT="${OUT:-./gpu-out}"
OUT="$(mktemp -d)/gpu-multi"
# shellcheck shell=bash source=scripts/gpu-lib.sh
. "$(dirname "$0")/gpu-lib.sh"
NAME_WIDTH=44
WHEELS="$(python3 -c 'import nvidia, os; print(nvidia.__path__[0])' 2>/dev/null || true)"
if [ -n "$WHEELS" ] && [ -f "$WHEELS/nccl/lib/libnccl.so.2" ]; then
  export EP_NCCL_LIBRARY="$WHEELS/nccl/lib/libnccl.so.2"
  export LD_LIBRARY_PATH="$WHEELS/nccl/lib:$WHEELS/cu13/lib:$LD_LIBRARY_PATH"
fi
gpu_header "$OUT/gpus.log" --topology
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
T="$G/tests"
# The repeatability tests (long: run beside the lanes) and their length, and
# the leak test (it compares the device's free memory: run alone, in checks).
REPEAT_FILTER=two_runs_of_random_iterations
LEAK_TEST=destroy_after_an_async_error_or_a_timeout_leaks_nothing
REPEAT_ITERS="${EP_REPEAT_ITERS:-10000}"
REPEATS=()

# The world sizes of the multi-rank tests (tests/common/gpu.rs) that have a
# GPU per rank here, as EP_TEST_WORLDS takes them: gpu_normal's reference
# test alone takes minutes per world size when ranks share a GPU (1 x H100:
# 80 s at 2 ranks, 187 s at 4, 103 s at 8), more than a lane has.
PER_GPU_WORLDS=$(for w in 1 2 4 8; do [ "$w" -le "$NGPU" ] && echo "$w"; done | paste -sd, -)

NAME="$(echo "$PARTS" | tr ',' '-')"
[ "$PARTS" = tests ] && PARTS=lanes,normal,shared,checks
# has PART: whether PART is one of the parts asked for.
has() { [[ ",$PARTS," == *",$1,"* ]]; }

# lane BINARY...: runs each test binary in turn (every test of it, one at a
# time, but the repeatability and leak tests), each with its own timeout and log;
# writes the result of each to $OUT/<binary>.result.
lane() {
  local bin
  for bin in "$@"; do
    [ -x "$T/$bin" ] || { echo "missing" > "$OUT/$bin.result"; continue; }
    timeout --kill-after=10 "$LANE_LIMIT" "$T/$bin" --ignored \
      --test-threads=1 --show-output --skip "$REPEAT_FILTER" --skip "$LEAK_TEST" \
      > "$OUT/test_$bin.log" 2>&1
    result_of $? > "$OUT/$bin.result"
  done
}

# lanes_done BINARY...: the summary rows of the lanes' binaries, with the
# tests passed and failed in each.
lanes_done() {
  local bin res p f
  for bin in "$@"; do
    res=$(cat "$OUT/$bin.result" 2>/dev/null || echo missing)
    read -r p f < <(test_counts "$OUT/test_$bin.log")
    summary_row "test $bin ($p passed, $f failed)" "$res" "-"
  done
}

if has lanes; then
  # 1. Every binary but gpu_normal, in four lanes, and beside them
  # the repeatability tests (each runs its iterations twice and compares).
  LANE_LIMIT=$(( BUDGET * 6 / 10 ))
  t0=$(date +%s)
  lane gpu_low_latency gpu_collectives &
  lane gpu_hierarchical gpu_nccl &
  lane gpu_mega gpu_moe gpu_kernels &
  lane gpu_contract gpu_context &
  LANES=$(jobs -p)
  for bin in gpu_normal gpu_low_latency; do
    timeout --kill-after=10 $(( BUDGET * 85 / 100 )) env EP_REPEAT_ITERS="$REPEAT_ITERS" \
      "$T/$bin" --ignored --test-threads=1 --show-output "$REPEAT_FILTER" \
      > "$OUT/repeat_$bin.log" 2>&1 &
    REPEATS+=("$bin:$!")
  done
  # shellcheck disable=SC2086 # a list of process ids
  wait $LANES
  echo "=== lanes took $(( $(date +%s) - t0 ))s"
  lanes_done gpu_low_latency gpu_collectives gpu_hierarchical gpu_nccl gpu_mega gpu_moe \
    gpu_kernels gpu_contract gpu_context
fi

# 2. gpu_normal alone, at the world sizes with a GPU per rank.
if has normal; then
  LANE_LIMIT=$(( BUDGET * 9 / 10 ))
  EP_TEST_WORLDS="$PER_GPU_WORLDS" lane gpu_normal
  lanes_done gpu_normal
fi

# 3. Ranks sharing one GPU (threads of one process).
if has shared; then
  for bin in gpu_contract gpu_hierarchical; do
    step "shared GPU $bin" 40 150 env CUDA_VISIBLE_DEVICES=0 "$T/$bin" --ignored \
      --test-threads=1 --show-output --skip "$REPEAT_FILTER"
  done
  # gpu_normal a world size at a time (world 1 shares nothing: the lanes').
  for world in 2 4 8; do
    step "shared GPU gpu_normal world $world" 40 $(( world == 4 ? 300 : 180 )) \
      env CUDA_VISIBLE_DEVICES=0 EP_TEST_WORLDS="$world" "$T/gpu_normal" --ignored \
      --test-threads=1 --show-output --skip "$REPEAT_FILTER"
  done
fi

# 4. Alone on the GPUs: the leak test, Python with torch, contexts from NCCL
# communicators, the C programs.
if has checks; then
  step "leak test alone" 20 120 "$T/gpu_context" --ignored --test-threads=1 --show-output \
    --exact "$LEAK_TEST"
  PY=(env EP_LIBRARY="$G/libep.so" PYTHONPATH="$G/python" python3)
  step "python torch tests" 40 150 env EP_REQUIRE_GPU=1 "${PY[@]}" -m pytest -q \
    -p no:cacheprovider "$G/python/tests/test_gpu_torch.py"
  step "python example gpu $NGPU ranks" 20 60 "${PY[@]}" "$G/python/examples/torch_two_ranks.py" \
    --gpu --ranks "$NGPU"
  if [ -n "${EP_NCCL_LIBRARY:-}" ]; then
    step "nccl normal" 20 120 env EP_TEST_NCCL=1 "$T/gpu_normal" --ignored --test-threads=1 \
      dispatch_and_combine_match_the_reference
    step "nccl low-latency" 20 120 env EP_TEST_NCCL=1 "$T/gpu_low_latency" --ignored \
      --test-threads=1 dispatch_and_combine_match_the_reference variants_match_the_reference
    [ -x "$T/gpu_mega" ] && step "nccl fused" 20 120 env EP_TEST_NCCL=1 "$T/gpu_mega" \
      --ignored --test-threads=1 small_and_uneven_cases_match_the_reference
    [ -x "$T/gpu_moe" ] && step "nccl moe forward" 20 120 env EP_TEST_NCCL=1 "$T/gpu_moe" \
      --ignored --test-threads=1 small_and_uneven_cases_match_the_reference
    step "nccl hierarchical" 20 120 env EP_TEST_NCCL=1 "$T/gpu_hierarchical" --ignored \
      --test-threads=1 virtual_nodes_match_the_reference
    step "nccl example $NGPU ranks" 10 60 "$G/nccl_context" "$NGPU"
  fi
  step "demo gpu $NGPU ranks" 10 60 env EP_BACKEND=gpu "$G/demo" "$NGPU"
fi

# 5. The repeatability tests' results (started with the lanes).
if has lanes; then
  for entry in "${REPEATS[@]}"; do
    bin=${entry%%:*}
    wait "${entry#*:}"
    summary_row "repeat $bin x$REPEAT_ITERS" "$(result_of $?)" "-"
  done
fi

if has bench; then
  B="$G/ep-bench"
  bench() {
    local name="$1" need="$2" limit="$3"; shift 3
    step "$name" "$need" "$limit" "$B" "$@" --json "$(out_file "$name" json)"
  }
  # W1 and W2 at a rank per GPU first (the targets), then at 2 ranks.
  bench "W1 normal ${NGPU} ranks" 60 150 --ranks "$NGPU" --mode normal --sweep-tokens 256,4096 --iters 30
  bench "W2 ll ${NGPU} ranks" 40 120 --ranks "$NGPU" --mode ll --sweep-tokens 1,128 --iters 200
  # W3 at a rank per GPU, the SM sweep of W1, then W3 at one rank.
  step "W3 fused ${NGPU} ranks" 40 180 env PYTHONUNBUFFERED=1 python3 "$G/mega_bench.py" \
    --lib "$G/libep.so" --iters 20 --ranks "$NGPU"
  bench "W1 SM sweep ${NGPU} ranks" 60 180 --ranks "$NGPU" --mode normal --sms-sweep 16,24,32,48,64 \
    --iters 20
  step "W3 fused 1 rank" 40 150 env PYTHONUNBUFFERED=1 python3 "$G/mega_bench.py" \
    --lib "$G/libep.so" --iters 20
  # Bytes per leg of the hierarchical plans on virtual nodes of each size.
  for rpn in 1 2 4; do
    [ "$rpn" -lt "$NGPU" ] || continue
    bench "traffic ${NGPU} ranks ${rpn} per node" 5 60 --ranks "$NGPU" --mode traffic \
      --ranks-per-node "$rpn"
  done
  if [ "$NGPU" -gt 2 ]; then
    bench "W1 normal 2 ranks" 60 150 --ranks 2 --mode normal --sweep-tokens 4096 --iters 30
    bench "W2 ll 2 ranks" 40 120 --ranks 2 --mode ll --sweep-tokens 128 --iters 200
  fi
  cat "$OUT"/*.log 2>/dev/null | grep -E '^\||^\*\*|UTC, ' > "$OUT/results.md" || true
fi

summary "logs in $FINAL_OUT/logs-$NAME.tgz" | tee "$OUT/summary.txt"
mkdir -p "$FINAL_OUT"
tar -C "$(dirname "$OUT")" -czf "$FINAL_OUT/logs-$NAME.tgz" gpu-multi
cp "$OUT/summary.txt" "$FINAL_OUT/summary-$NAME.txt"
exit "$FAILED"
