#!/usr/bin/env bash
# Runs the C API test (tests/c/api_test.c) under valgrind on the host backend.
# Fails on any memory error and on "definitely lost" leaks; "possibly lost" and
# "still reachable" blocks (thread-locals and once-initialised statics of the
# Rust runtime, stacks of the detached rendezvous threads) are counted in the
# summary but are no errors.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v valgrind >/dev/null 2>&1; then
    echo "valgrind-c-tests: valgrind is not installed (apt-get install valgrind)" >&2
    exit 1
fi
if [ ! -f target/release/libep.so ] || [ -n "$(find src include build.rs Cargo.toml -newer target/release/libep.so -print -quit)" ]; then
    cargo build --release
fi

out=target/c-tests
mkdir -p "$out"
"${CC:-cc}" -std=c99 -O1 -g -Wall -Wextra -Werror -pedantic -Iinclude tests/c/api_test.c \
    -o "$out/api_test" -Ltarget/release -lep -lm -Wl,-rpath,"$PWD/target/release"


log="$out/valgrind.log"
rm -f "$out/api_test.ep-log"
status=0
# The test's deliberate failures are logged (EP_LOG_LEVEL warn): into a file,
# so the log's file path runs under valgrind too and this output stays short.
EP_BACKEND=host EP_LOG_FILE="$out/api_test.ep-log" valgrind --error-exitcode=1 --leak-check=full \
    --errors-for-leak-kinds=definite --show-leak-kinds=definite \
    --log-file="$log" "$out/api_test" || status=$?

sed -n '/HEAP SUMMARY/,$p' "$log"
if [ "$status" -ne 0 ]; then
    echo "valgrind-c-tests: FAILED (exit status $status); full log: $log" >&2
    grep -E "Invalid|uninitialised|definitely lost|Mismatched|overlap" "$log" | head -20 >&2 || true
    exit 1
fi
echo "valgrind-c-tests: ok"
