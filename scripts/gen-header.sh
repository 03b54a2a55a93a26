#!/usr/bin/env bash
# Regenerates include/ep.h from src/capi with cbindgen (through the header test),
# then the Python package's ctypes view of it (python/ep/_abi.py).
set -euo pipefail
cd "$(dirname "$0")/.."
EP_UPDATE_HEADER=1 cargo test --release --test header header_is_up_to_date
python3 scripts/gen-python-abi.py
