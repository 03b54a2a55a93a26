#!/usr/bin/env bash
# Builds everything the GPU machine runs (it has no Rust) and copies it into
# the git-ignored folder .gpu/: libep.so, the GPU test binaries
# (tests/gpu_*.rs), ep-bench, the C demo, the NCCL example, the Python
# package with its tests (python/, loaded there through EP_LIBRARY), the
# runners scripts/gpu-check.sh, scripts/gpu-multi.sh (several GPUs) and
# scripts/gpu-mega.sh (fused kernels) with what they source
# (scripts/gpu-lib.sh), and the fused kernels' benchmark (bench/mega_bench.py).
# Debug info is stripped from the copies to stay well under 60 MiB.
# Then, on the GPU machine: bash .gpu/gpu-check.sh [budget-seconds], or on
# several GPUs bash .gpu/gpu-multi.sh tests|bench [budget-seconds]
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x scripts/install-cuda-tools.sh ] && scripts/install-cuda-tools.sh >/dev/null

cargo build --release --lib --bin ep-bench

rm -rf .gpu
mkdir -p .gpu/tests

# Test binaries: every tests/gpu_*.rs, located through cargo's JSON messages.
shopt -s nullglob
test_args=()
for f in tests/gpu_*.rs; do
  test_args+=(--test "$(basename "$f" .rs)")
done
if [ ${#test_args[@]} -gt 0 ]; then
  cargo test --release --no-run "${test_args[@]}" --message-format=json 2>/dev/null \
    | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"].startswith("gpu_") \
            and "test" in m["target"]["kind"]:
        print(m["target"]["name"], m["executable"])
' > .gpu/tests.list
  # Fail loudly if the build failed (the JSON pipe hides the exit status).
  cargo test --release --no-run "${test_args[@]}" >/dev/null
  while read -r name exe; do
    cp "$exe" ".gpu/tests/$name"
  done < .gpu/tests.list
  rm -f .gpu/tests.list
fi

cp target/release/libep.so .gpu/
cp target/release/ep-bench .gpu/

# The C demo, built as scripts/demo.sh builds it, if it exists.
if [ -f examples-c/demo.c ]; then
  cc -std=c99 -O2 -Wall -Wextra -Werror -Iinclude examples-c/demo.c -o .gpu/demo \
     -Ltarget/release -lep -ldl -lm -Wl,-rpath,'$ORIGIN' || true
  [ -f .gpu/demo ] || echo "warning: examples-c/demo.c did not compile" >&2
fi

# The NCCL example, against the pinned NCCL wheel's nccl.h, linked to its
# libnccl.so.2 and the CUDA runtime wheel's libcudart.so.13 (found on the GPU
# machine through LD_LIBRARY_PATH, see gpu-check.sh).
wheels=$(find .venv/lib -maxdepth 3 -path '*/site-packages/nvidia' -type d 2>/dev/null | head -n 1)
if [ -n "$wheels" ] && [ -f examples-c/nccl_context.c ]; then
  cc -std=c11 -O2 -Wall -Wextra -Werror -Iinclude -I"$wheels/nccl/include" -I"$wheels/cu13/include" \
     examples-c/nccl_context.c -o .gpu/nccl_context -Ltarget/release -lep \
     -L"$wheels/nccl/lib" -l:libnccl.so.2 -L"$wheels/cu13/lib" -l:libcudart.so.13 \
     -Wl,-rpath,'$ORIGIN' || true
  [ -f .gpu/nccl_context ] || echo "warning: examples-c/nccl_context.c did not compile" >&2
fi

# The Python package is pure Python: its sources and tests, without caches
# (gpu-check.sh points EP_LIBRARY at .gpu/libep.so).
mkdir -p .gpu/python
for d in ep tests examples; do
  cp -r "python/$d" ".gpu/python/$d"
done
find .gpu/python \( -name __pycache__ -o -name 'libep.so' \) -prune -exec rm -rf {} +

cp scripts/gpu-check.sh scripts/gpu-mega.sh scripts/gpu-multi.sh scripts/gpu-lib.sh bench/mega_bench.py .gpu/
chmod +x .gpu/gpu-check.sh .gpu/gpu-mega.sh .gpu/gpu-multi.sh

strip --strip-debug .gpu/libep.so .gpu/ep-bench .gpu/tests/* 2>/dev/null || true
[ -f .gpu/demo ] && strip --strip-debug .gpu/demo
[ -f .gpu/nccl_context ] && strip --strip-debug .gpu/nccl_context

echo "contents of .gpu/:"
(cd .gpu && find . -type f -exec ls -l {} + | awk '{printf "  %10d  %s\n", $5, $9}')
size_kib=$(du -sk .gpu | cut -f1)
echo "total: $((size_kib / 1024)) MiB ($size_kib KiB)"
if [ "$size_kib" -ge $((60 * 1024)) ]; then
  echo "error: .gpu/ is over 60 MiB" >&2
  exit 1
fi
