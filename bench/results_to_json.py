#!/usr/bin/env python3
"""Converts the ep-bench tables recorded in bench/RESULTS.md into the JSON
that `ep-bench --json` writes (schema ep-bench/1), one file per section, so
bench/plot.py can plot runs made before ep-bench had --json.

    bench/results_to_json.py [bench/RESULTS.md] [--out bench/data]

Each file says where it came from ("source": the section's heading). Only
tables with ep-bench's own columns are taken (the before/after comparison
tables are not); a table title without the shape takes the section's
earlier one, else ep-bench's defaults (hidden 7168, top-8 of 256 experts).
"""
import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
COLUMNS = ["op", "tokens", "SMs", "median us", "p10 us", "p90 us", "GB/s", "NCCL a2a us"]
# Columns of later runs: the copy floor and the time over it.
FLOOR_COLUMNS = COLUMNS + ["copy floor us", "x floor"]
DEFAULT_SHAPE = {"hidden": 7168, "topk": 8, "experts": 256}


def number(cell):
    """A table cell as a number, None for '-', 'n/a' or empty."""
    cell = cell.strip()
    try:
        return float(cell) if "." in cell else int(cell)
    except ValueError:
        return None


def cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def shape_of(title, previous):
    shape = dict(previous)
    m = re.search(r"hidden (\d+)", title)
    if m:
        shape["hidden"] = int(m.group(1))
    m = re.search(r"top-(\d+) of (\d+)", title)
    if m:
        shape["topk"], shape["experts"] = int(m.group(1)), int(m.group(2))
    return shape


def slug(text):
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def convert_section(heading, lines):
    """The run of one '## ...' section, or None when it has no ep-bench table."""
    run_line = next((l for l in lines if re.match(r"^\d{4}-\d\d-\d\d .*UTC, ", l)), "")
    date = run_line.split(",")[0].strip() if run_line else heading.split(" - ")[0].strip()
    device = re.search(r"(\d+ x [^,]+)", run_line or heading)
    ranks = re.search(r"(\d+) ranks?", run_line)
    nccl = re.search(r"(NCCL \d+\.\d+\.\d+)", run_line)
    commands = re.findall(r"`(ep-bench[^`]*)`", run_line)
    timing = re.search(r"timing: ([^,]+(?:\([^)]*\))?)", run_line)
    tables, title, shape = [], "", dict(DEFAULT_SHAPE)
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("**") and line.endswith("**"):
            title = line.strip("*")
        elif line.startswith("| op |"):
            header = cells(line)
            body = []
            i += 2  # header and separator
            while i < len(lines) and lines[i].startswith("|"):
                body.append(cells(lines[i]))
                i += 1
            if header not in (COLUMNS, FLOOR_COLUMNS):
                continue
            shape = shape_of(title, shape)
            rows = [{"op": c[0], "tokens": number(c[1]), "sms": number(c[2]),
                     "median_us": number(c[3]), "p10_us": number(c[4]), "p90_us": number(c[5]),
                     "gbps": number(c[6]), "nccl_us": number(c[7]),
                     **({"floor_us": number(c[8])} if header == FLOOR_COLUMNS else {})}
                    for c in body]
            mode = "ll" if all(r["op"].startswith("LL") for r in rows) else "normal"
            sms = re.search(r"(\d+) SMs", title)
            iters = re.search(r"(\d+) iterations", title)
            tables.append({
                "title": title, "mode": mode, **shape,
                "iterations": int(iters.group(1)) if iters else None,
                "sms": int(sms.group(1)) if sms and mode == "normal" else None,
                "rows": rows,
            })
            continue
        i += 1
    if not tables:
        return None
    return {
        "schema": "ep-bench/1",
        "source": f"bench/RESULTS.md, section \"## {heading}\" (converted by "
                  f"bench/results_to_json.py)",
        "date": date,
        "device": device.group(1).strip() if device else "",
        "ranks": int(ranks.group(1)) if ranks else None,
        "backend": "gpu",
        "timing": timing.group(1).strip() if timing else "",
        "nccl": nccl.group(1) if nccl else "",
        "command": " ; ".join(commands),
        "tables": tables,
    }


def convert(text):
    """[(file name, run)] of every section with ep-bench tables."""
    runs = []
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    for section in sections:
        heading, _, body = section.partition("\n")
        run = convert_section(heading.strip(), [l.strip() for l in body.splitlines()])
        if run is not None:
            # <date>-<device>-<commit>-<modes>.json, e.g. 2026-11-23-2xh200-641c231-ll-normal.json
            parts = [p.strip() for p in heading.split(" - ")]
            device = re.sub(r"\s*\(.*\)", "", parts[1] if len(parts) > 1 else "")
            commits = re.findall(r"\b([0-9a-f]{7,40})\b", heading)
            modes = sorted({t["mode"] for t in run["tables"]})
            name = "-".join([parts[0], slug(device).replace("-x-", "x"),
                             commits[-1] if commits else slug(parts[-1])[:20], *modes])
            runs.append((f"{name}.json", run))
    return runs


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="?", default=str(HERE / "RESULTS.md"))
    parser.add_argument("--out", default=str(HERE / "data"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, run in convert(Path(args.results).read_text()):
        (out / name).write_text(json.dumps(run, indent=2) + "\n")
        rows = sum(len(t["rows"]) for t in run["tables"])
        print(f"{out / name}: {len(run['tables'])} tables, {rows} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
