#!/usr/bin/env bash
# Installs the CUDA 13.0 compiler tool chain (nvcc, cicc, ptxas, headers,
# libdevice), the pinned NCCL (whose device-API headers the network kernels
# are compiled against, and whose library the NCCL example links), and the
# CUTLASS/CuTe headers the fused kernels build on (the nvidia-cutlass wheel,
# headers only: its Python code generator and that code's dependencies are
# not used, hence --no-deps) from NVIDIA's PyPI wheels into <repo root>/.venv,
# so the kernels build on a machine without a CUDA toolkit and without a GPU.
#
# The versions are pinned to 13.0: the GPU driver the kernels run under is
# CUDA 13.0, and a newer nvcc emits code (PTX ISA / fatbin versions) that an
# older driver refuses to load. NCCL is pinned because kernels built on its
# device API only work with the NCCL version of their headers (the library
# checks this at run time).
#
# Idempotent: a second run finds the marker file and a working nvcc and
# does nothing. build.rs finds the venv's nvcc by itself; set NVCC to use
# another one.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo_root/.venv"
marker="$venv/.cuda-tools-13.0.88-nccl-2.28.9"

# The wheels put the tool chain under site-packages/nvidia/cu13/.
find_nvcc() {
    local found
    found=$(find "$venv/lib" -path '*/site-packages/nvidia/cu13/bin/nvcc' -type f 2>/dev/null | head -n 1)
    [[ -n "$found" ]] && echo "$found"
}

# The wheel puts the headers under site-packages/cutlass_library/source/include.
have_cutlass() {
    find "$venv/lib" -path '*/site-packages/cutlass_library/source/include/cute/tensor.hpp' \
        2>/dev/null | grep -q .
}

if [[ -f "$marker" ]] && nvcc_path=$(find_nvcc) && "$nvcc_path" --version >/dev/null 2>&1 \
    && have_cutlass; then
    echo "CUDA tools already installed: $nvcc_path"
    exit 0
fi

if [[ ! -x "$venv/bin/python" ]]; then
    python3 -m venv "$venv" || {
        echo "error: python3 -m venv failed (on Debian/Ubuntu: apt-get install python3-venv)" >&2
        exit 1
    }
fi

"$venv/bin/python" -m pip install --quiet \
    nvidia-cuda-nvcc==13.0.88 \
    nvidia-cuda-runtime==13.0.88 \
    nvidia-cuda-cccl==13.0.85 \
    nvidia-cuda-crt==13.0.88 \
    nvidia-nvvm==13.0.88 \
    nvidia-nccl-cu13==2.28.9
"$venv/bin/python" -m pip install --quiet --no-deps nvidia-cutlass==4.2.0.0

nvcc_path=$(find_nvcc) || {
    echo "error: the nvidia-cuda-nvcc wheel installed no nvcc under $venv" >&2
    exit 1
}
"$nvcc_path" --version >/dev/null
have_cutlass || {
    echo "error: the nvidia-cutlass wheel installed no CUTLASS headers under $venv" >&2
    exit 1
}
touch "$marker"
echo "CUDA tools installed: $nvcc_path"
