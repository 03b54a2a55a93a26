#!/usr/bin/env bash
# Runs every test: formatting, lints, the header check, unit and API tests,
# the C, C++ and Python examples, and the C tests under valgrind.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-cuda-tools.sh >/dev/null
cargo fmt --check
cargo clippy --release --all-targets -- -D warnings
cargo build --release   # the cdylib that the C, C++ and Python examples load
cargo test --release
scripts/valgrind-c-tests.sh
