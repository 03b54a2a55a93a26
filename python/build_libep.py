"""The build hook of `pip install <checkout>` (pyproject.toml's cmdclass):
builds libep.so with cargo and puts it into the package.

Why a hook of our own rather than maturin or setuptools-rust: both build
Python extension modules (pyo3, cffi) with their own cargo invocation, which
compiles the crate a second time next to `cargo build --release`; the
package needs only the plain cdylib that cargo already makes, loaded with
ctypes by any Python 3. So: run `cargo build --release --lib` (a no-op when
the library is up to date), copy target/release/libep.so into the package,
and tag the wheel `py3-none-<platform>` (one wheel for every Python version;
not pure, as it carries a native library).

Environment: `CARGO` (default `cargo`), `CARGO_TARGET_DIR`; without `NVCC`,
`CUDA_HOME` or an `nvcc` on PATH, scripts/install-cuda-tools.sh first puts
the CUDA compiler wheels into the checkout's .venv (as scripts/demo.sh does).
"""
import json
import os
import shutil
import subprocess
from pathlib import Path

from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

ROOT = Path(__file__).resolve().parent.parent

# pyproject.toml sends setuptools' build and egg-info directories here.
(ROOT / "target" / "python-build").mkdir(parents=True, exist_ok=True)


def _cargo() -> str:
    return os.environ.get("CARGO", "cargo")


def _have_nvcc() -> bool:
    return bool(os.environ.get("NVCC") or os.environ.get("CUDA_HOME") or shutil.which("nvcc"))


def build_library() -> Path:
    """Builds libep.so (release) and returns its path."""
    if not _have_nvcc():
        subprocess.run([str(ROOT / "scripts" / "install-cuda-tools.sh")], check=True, cwd=ROOT)
    subprocess.run([_cargo(), "build", "--release", "--lib"], check=True, cwd=ROOT)
    meta = subprocess.run([_cargo(), "metadata", "--format-version", "1", "--no-deps"],
                          check=True, cwd=ROOT, stdout=subprocess.PIPE)
    target = Path(json.loads(meta.stdout)["target_directory"])
    lib = target / "release" / "libep.so"
    if not lib.is_file():
        raise RuntimeError(f"cargo build succeeded but {lib} is missing")
    return lib


class BuildPy(build_py):
    """build_py, then libep.so into the built package."""

    def run(self):
        super().run()
        lib = build_library()
        dest = Path(self.build_lib) / "ep" / "libep.so"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(lib, dest)
        os.chmod(dest, 0o755)


class BdistWheel(bdist_wheel):
    """A platform wheel for any Python 3: py3-none-<platform>."""

    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        _python, _abi, platform = super().get_tag()
        return "py3", "none", platform
