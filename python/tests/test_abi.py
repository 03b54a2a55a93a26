"""The ctypes definitions (python/ep/_abi.py, generated from include/ep.h)
against the C compiler's view of the header and the loaded library's."""
import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

import ep
from ep import _abi, _lib

ROOT = Path(__file__).resolve().parents[2]
HEADER = ROOT / "include" / "ep.h"


def c_layout(tmp_path):
    """{struct: (sizeof, {field: offsetof})} as the C compiler lays out ep.h."""
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None or not HEADER.is_file():
        pytest.fail("this test needs a C compiler and the checkout's include/ep.h")
    lines = ["#include <stddef.h>", "#include <stdio.h>", '#include "ep.h"', "int main(void) {"]
    for struct in _abi.STRUCTS:
        name = struct.__name__
        lines.append(f'  printf("{name} - %zu\\n", sizeof({name}));')
        for field, _ in struct._fields_:
            lines.append(f'  printf("{name} {field} %zu\\n", offsetof({name}, {field}));')
    lines += ["  return 0;", "}"]
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "layout"
    subprocess.run([compiler, "-std=c99", "-I", str(HEADER.parent), str(src), "-o", str(exe)],
                   check=True)
    layout = {}
    for line in subprocess.run([str(exe)], check=True, capture_output=True,
                               text=True).stdout.splitlines():
        struct, field, value = line.split()
        size, fields = layout.setdefault(struct, [0, {}])
        if field == "-":
            layout[struct][0] = int(value)
        else:
            fields[field] = int(value)
    return layout


def test_every_struct_matches_the_c_compilers_layout(tmp_path):
    layout = c_layout(tmp_path)
    assert set(layout) == {s.__name__ for s in _abi.STRUCTS}
    for struct in _abi.STRUCTS:
        size, offsets = layout[struct.__name__]
        assert ctypes.sizeof(struct) == size, struct.__name__
        for field, _ in struct._fields_:
            assert getattr(struct, field).offset == offsets[field], f"{struct.__name__}.{field}"


def test_the_library_reports_the_same_struct_sizes_and_exports_every_function():
    lib = _lib.library()
    for name, struct in _abi.INIT_FUNCTIONS.items():
        assert _lib._library_struct_size(lib, name) == ctypes.sizeof(struct), name
    assert [f for f in _abi.FUNCTIONS if not _lib.has_function(f)] == []
    assert ep.api_version() == ep.API_VERSION


def test_every_define_of_the_header_is_a_python_constant():
    import re

    names = set(re.findall(r"^#define (EP_\w+) -?\d+$", HEADER.read_text(), flags=re.M))
    assert names and names <= set(vars(_abi))
