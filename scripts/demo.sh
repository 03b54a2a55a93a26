#!/usr/bin/env bash
# Builds the library and runs the C demo: N ranks (default 4) as processes,
# on the host backend unless EP_BACKEND=gpu is set.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-cuda-tools.sh >/dev/null
cargo build --release
mkdir -p target/examples
cc -std=c99 -O2 -Wall -Wextra -Werror -pedantic -Iinclude examples-c/demo.c -o target/examples/demo \
   -Ltarget/release -lep -ldl -lm -Wl,-rpath,"$PWD/target/release"
EP_BACKEND="${EP_BACKEND:-host}" target/examples/demo "${1:-4}"
