#!/usr/bin/env python3
"""Generates python/ep/_abi.py (ctypes constants, structs and function
signatures) from include/ep.h, so the Python package never keeps a mirror of
the header by hand.

    scripts/gen-python-abi.py            # rewrite python/ep/_abi.py
    scripts/gen-python-abi.py --check    # exit 1 if it is stale

scripts/gen-header.sh runs it after regenerating the header; tests/header.rs
runs --check. The header is cbindgen's output, a small regular subset of C:
`#define EP_* <integer>`, scalar and opaque typedefs, `typedef struct ... {
fields } name;` and one prototype per function. Anything else in it is an
error here, never silently skipped.

Mapping: every pointer becomes `c_void_p` (fields and parameters take plain
addresses, `byref()` or None), a struct passed by value or embedded stays its
Structure, fixed arrays become ctypes arrays, `const char *` results become
`c_char_p`.
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADER = ROOT / "include" / "ep.h"
OUTPUT = ROOT / "python" / "ep" / "_abi.py"

SCALARS = {
    "int32_t": "c_int32",
    "uint32_t": "c_uint32",
    "uint8_t": "c_uint8",
    "int64_t": "c_int64",
    "uint64_t": "c_uint64",
    "size_t": "c_size_t",
    "float": "c_float",
    "double": "c_double",
    "int": "c_int",
    "char": "c_char",
}


class HeaderError(Exception):
    pass


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def parse(text):
    """Returns (constants, typedefs, opaque, structs, functions) of the header."""
    text = strip_comments(text)
    constants = []
    for name, value in re.findall(r"^#define\s+(EP_\w+)\s+(-?\d+)\s*$", text, flags=re.M):
        constants.append((name, int(value)))
    for line in re.findall(r"^#define\s+(EP_\w+)\s*(.*)$", text, flags=re.M):
        if line[0] != "EP_H" and not re.fullmatch(r"-?\d+", line[1].strip()):
            raise HeaderError("unsupported macro %s %r" % line)

    typedefs = {}  # alias -> C type text
    opaque = []
    structs = []  # (name, [(field, ctype text, array length or None)])
    body = re.sub(r"^\s*#[^\n]*", "", text, flags=re.M)
    for name, fields in re.findall(r"typedef\s+struct\s+(\w+)\s*\{(.*?)\}\s*\1\s*;", body, flags=re.S):
        parsed = []
        for decl in fields.split(";"):
            decl = " ".join(decl.split())
            if not decl:
                continue
            m = re.fullmatch(r"(.+?)\s*\b(\w+)(?:\[(\w+)\])?", decl)
            if not m:
                raise HeaderError("cannot parse field %r of %s" % (decl, name))
            parsed.append((m.group(2), m.group(1).strip(), m.group(3)))
        structs.append((name, parsed))
    body = re.sub(r"typedef\s+struct\s+(\w+)\s*\{.*?\}\s*\1\s*;", "", body, flags=re.S)
    for name, alias in re.findall(r"typedef\s+struct\s+(\w+)\s+(\w+)\s*;", body):
        if name != alias:
            raise HeaderError("typedef struct %s %s: names differ" % (name, alias))
        opaque.append(name)
    body = re.sub(r"typedef\s+struct\s+(\w+)\s+(\w+)\s*;", "", body)
    for target, alias in re.findall(r"typedef\s+([^;]+?)\s*\b(\w+)\s*;", body):
        typedefs[alias] = " ".join(target.split())
    body = re.sub(r"typedef\s+[^;]+;", "", body)

    functions = []  # (name, result type text, [(param, type text)])
    for result, name, params in re.findall(r"([\w\s\*]+?)\s*\b(ep_\w+)\s*\(([^)]*)\)\s*;", body):
        plist = []
        params = " ".join(params.split())
        if params and params != "void":
            for p in params.split(","):
                m = re.fullmatch(r"(.+?)\s*\b(\w+)", p.strip())
                if not m:
                    raise HeaderError("cannot parse parameter %r of %s" % (p, name))
                plist.append((m.group(2), m.group(1).strip()))
        functions.append((name, " ".join(result.split()), plist))
    leftover = re.sub(r'extern\s+"C"\s*\{|\}|struct\s+(CUstream_st|ncclComm)\s*;', "", body)
    leftover = re.sub(r"[\w\s\*]+?\bep_\w+\s*\([^)]*\)\s*;", "", leftover)
    if leftover.strip():
        raise HeaderError("unparsed text in the header: %r" % leftover.strip()[:200])
    return constants, typedefs, opaque, structs, functions


class Types:
    """C type text -> ctypes expression."""

    def __init__(self, typedefs, opaque, structs):
        self.typedefs = typedefs
        self.opaque = set(opaque)
        self.structs = {name for name, _ in structs}

    def ctype(self, text, result=False):
        t = text.replace("const ", "").strip()
        t = re.sub(r"\s*\*", "*", t)
        if t.endswith("*"):
            base = t.rstrip("*").strip()
            if result and base == "char" and t.count("*") == 1:
                return "c_char_p"
            self.known(base)
            return "c_void_p"
        if t.startswith("struct "):
            t = t[len("struct "):].strip()
        if t == "void":
            return "None"
        if t in SCALARS:
            return SCALARS[t]
        if t in self.structs:
            return t
        if t in self.typedefs:
            return self.ctype(self.typedefs[t], result)
        raise HeaderError("unknown C type %r" % text)

    def known(self, base):
        base = base.replace("struct ", "").strip()
        if base in ("void", "CUstream_st", "ncclComm") or base in SCALARS or base in self.opaque \
                or base in self.structs or base in self.typedefs:
            return
        raise HeaderError("pointer to unknown type %r" % base)


def generate(text):
    constants, typedefs, opaque, structs, functions = parse(text)
    types = Types(typedefs, opaque, structs)
    out = []
    for name, value in constants:
        out.append("%s = %d" % (name, value))
    out.append("")
    for name, fields in structs:
        out.append("")
        out.append("class %s(Structure):" % name)
        out.append("    _fields_ = [")
        for field, ctext, length in fields:
            ct = types.ctype(ctext)
            if length is not None:
                ct = "%s * %s" % (ct, length)
            out.append('        ("%s", %s),' % (field, ct))
        out.append("    ]")
        out.append("")
    out.append("")
    out.append("STRUCTS = (")
    for name, _ in structs:
        out.append("    %s," % name)
    out.append(")")
    out.append("")
    out.append("# name: (result, [parameter types], [parameter names])")
    out.append("FUNCTIONS = {")
    for name, result, params in functions:
        rt = types.ctype(result, result=True)
        pts = ", ".join(types.ctype(t) for _, t in params)
        names = ", ".join('"%s"' % p for p, _ in params)
        out.append('    "%s": (%s, [%s], [%s]),' % (name, rt, pts, names))
    out.append("}")
    out.append("")
    # ep_*_init functions fill one struct: the library's struct_size of it
    # is checked against ctypes' at load time.
    inits = []
    for name, _result, params in functions:
        if name.endswith("_init") and len(params) == 1:
            base = params[0][1].replace("struct ", "").rstrip("*").strip()
            if base in types.structs:
                inits.append((name, base))
    out.append("# ep_*_init function: the struct it fills")
    out.append("INIT_FUNCTIONS = {")
    for name, base in inits:
        out.append('    "%s": %s,' % (name, base))
    out.append("}")
    out.append("")
    body = "\n".join(out)
    used = sorted({name for name in re.findall(r"\b(c_\w+)\b", body)}, key=str.lower)
    head = [
        '"""ctypes view of include/ep.h: generated by scripts/gen-python-abi.py; do not edit.',
        "",
        "Every pointer is a c_void_p; structs are ctypes Structures with the",
        "header's field names; FUNCTIONS maps each function to (result, [params]).",
        '"""',
        "from ctypes import %s" % ", ".join(["Structure"] + used),
        "",
    ]
    return "\n".join(head) + "\n" + body


def main(argv):
    check = "--check" in argv
    fresh = generate(HEADER.read_text())
    if check:
        current = OUTPUT.read_text() if OUTPUT.exists() else ""
        if current != fresh:
            print("python/ep/_abi.py is stale: run scripts/gen-python-abi.py (or scripts/gen-header.sh)",
                  file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
