#!/usr/bin/env python3
"""Turns ep-bench runs (`ep-bench --json FILE`, schema ep-bench/1) into PNG
plots, from the newest run that has each kind of data:

- normal-tokens.png: normal mode, latency and GB/s against tokens per rank;
- normal-sms.png: normal mode, latency and GB/s against the SM count;
- ll-tokens.png: low-latency mode, latency and GB/s against tokens per rank;
- vs-nccl.png: ep against an NCCL all-to-all of the same payload (same run);
- vs-deepep.png: ep against the DeepEP figures of bench/data/deepep.json,
  where a run measured the same shape on the same device.
DeepEP's figures also appear as markers on the first three where they match.

    bench/plot.py [FILE.json ...] [--out DIR]     (default: bench/data/*.json -> bench/plots)

The data processing needs only the standard library; rendering needs
matplotlib, and without it the script says so, prints what it would have
plotted and exits 0.
"""
import argparse
import glob
import json
import sys
from collections import OrderedDict
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUN_SCHEMA = "ep-bench/1"
REFERENCE_SCHEMA = "ep-reference/1"

# ---------------------------------------------------------------------------
# Data: runs and reference figures
# ---------------------------------------------------------------------------


def load(paths):
    """(runs, references) of the JSON files; runs oldest first."""
    runs, refs = [], []
    for path in paths:
        data = json.loads(Path(path).read_text())
        data["path"] = Path(path).name
        schema = data.get("schema")
        if schema == RUN_SCHEMA:
            runs.append(data)
        elif schema == REFERENCE_SCHEMA:
            refs.append(data)
        else:
            raise ValueError(f"{path}: unknown schema {schema!r}")
    runs.sort(key=lambda r: (r.get("date", ""), r["path"]))
    return runs, refs


def shape(table):
    return (table.get("hidden"), table.get("topk"), table.get("experts"))


def op_rows(run, mode):
    """[(table, row)] of every row of the run's tables of ``mode``."""
    return [(t, r) for t in run["tables"] if t["mode"] == mode for r in t["rows"]
            if r.get("median_us") is not None]


def sweep(run, mode, axis, fixed):
    """The largest sweep of ``axis`` ("tokens" or "sms") in ``run``: rows
    grouped by op, at one value of ``fixed`` and one shape, sorted by the
    swept value. Returns (description, {op: [row]}) or None when no group
    has at least 3 values."""
    groups = OrderedDict()
    for table, row in op_rows(run, mode):
        key = (shape(table), row.get(fixed))
        groups.setdefault(key, OrderedDict()).setdefault(row["op"], {})[row[axis]] = (table, row)
    best = None
    for (shp, fixed_value), ops in groups.items():
        points = max(len(v) for v in ops.values())
        if points >= 3 and (best is None or points > best[0]):
            series = OrderedDict((op, [r for _, (_, r) in sorted(v.items())]) for op, v in ops.items())
            tables = {id(t): t for v in ops.values() for t, _ in v.values()}
            best = (points, shp, fixed_value, series, list(tables.values()))
    if best is None:
        return None
    _, shp, fixed_value, series, tables = best
    return {"shape": shp, fixed: fixed_value, "series": series, "tables": tables}


def newest(runs, pick):
    """(run, data) of the newest run for which ``pick(run)`` is not None."""
    for run in reversed(runs):
        data = pick(run)
        if data is not None:
            return run, data
    return None, None


def reference_points(refs, run, mode, match):
    """[(reference, point)] measured on the run's device at a shape that
    ``match(point)`` accepts."""
    out = []
    for ref in refs:
        if ref.get("device") != run.get("device"):
            continue
        for point in ref["points"]:
            if point["mode"] == mode and match(point):
                out.append((ref, point))
    return out


def describe_run(run):
    return f"{run.get('device', '?')}, {run.get('ranks', '?')} ranks, {run.get('date', '?')}"


def series_of(rows_by_op, axis, metric):
    """Line series: x = ``axis``, y = ``metric`` (with p10/p90 for latency)."""
    out = []
    for op, rows in rows_by_op.items():
        pts = [r for r in rows if r.get(metric) is not None]
        if len(pts) < 2:
            continue
        s = {"label": op, "x": [r[axis] for r in pts], "y": [r[metric] for r in pts]}
        if metric == "median_us":
            s["lo"] = [r.get("p10_us") for r in pts]
            s["hi"] = [r.get("p90_us") for r in pts]
        out.append(s)
    return out


def marker_series(points, axis, metric):
    """DeepEP's figures as marker-only series."""
    return [{"label": f"{ref['name']}: {p['op']}", "x": [p[axis]], "y": [p[metric]],
             "marker_only": True, "like": p["ep_op"]} for ref, p in points
            if p.get(metric) is not None]


def sweep_plot(name, run, data, mode, axis, refs):
    shp = data["shape"]
    fixed = "sms" if axis == "tokens" else "tokens"
    fixed_value = data.get(fixed)
    match = lambda p: ((p["hidden"], p["topk"], p["experts"]) == shp  # noqa: E731
                       and (mode == "ll" or p.get(fixed) == fixed_value or fixed_value is None))
    refs_here = reference_points(refs, run, mode, match)
    what = "normal mode" if mode == "normal" else "low-latency mode"
    fixed_text = ""
    if fixed_value is not None:
        fixed_text = f", {fixed_value} SMs" if fixed == "sms" else f", {fixed_value} tokens"
    title = (f"ep {what}: hidden {shp[0]}, top-{shp[1]} of {shp[2]} experts{fixed_text} "
             f"({describe_run(run)})")
    xlabel = "tokens per rank" if axis == "tokens" else "SMs (num_sms)"
    return {
        "name": name, "kind": "lines", "title": title, "source": run["path"],
        "panels": [
            {"ylabel": "median latency, us (p10-p90 band)", "xlabel": xlabel, "log": axis == "tokens",
             "series": series_of(data["series"], axis, "median_us")
             + marker_series(refs_here, axis, "median_us")},
            {"ylabel": "GB/s (received token bytes / median)", "xlabel": xlabel,
             "log": axis == "tokens", "series": series_of(data["series"], axis, "gbps")},
        ],
    }


# ep's op names against an NCCL all-to-all of the same payload.
NCCL_OPS = {
    "normal": ["dispatch BF16", "dispatch FP8", "combine BF16 source-order"],
    "ll": ["LL dispatch FP8 (weights at dispatch)", "LL combine BF16 (weights at combine)",
           "LL dispatch+combine, CUDA graph, per pair (weights at combine)"],
}


def nccl_panel(run, data, mode):
    series = []
    for op in NCCL_OPS[mode]:
        rows = [r for r in data["series"].get(op, []) if r.get("nccl_us") is not None]
        if len(rows) < 2:
            continue
        x = [r["tokens"] for r in rows]
        series.append({"label": f"ep: {op}", "x": x, "y": [r["median_us"] for r in rows]})
        series.append({"label": "NCCL all-to-all of the same payload (dashed)", "x": x,
                       "y": [r["nccl_us"] for r in rows], "dashed": True, "pair": True})
    what = "normal mode" if mode == "normal" else "low-latency mode"
    return {"ylabel": "median latency, us", "xlabel": "tokens per rank", "log": True,
            "title": f"{what} ({describe_run(run)})", "series": series}


def deepep_bars(runs, refs):
    """Bars of ep (newest run with the same device and shape) against each
    reference point."""
    bars = []
    for ref in refs:
        for p in ref["points"]:
            for run in reversed(runs):
                if run.get("device") != ref.get("device"):
                    continue
                found = [r for t, r in op_rows(run, p["mode"])
                         if r["op"] == p["ep_op"] and r["tokens"] == p["tokens"]
                         and shape(t) == (p["hidden"], p["topk"], p["experts"])
                         and (p["mode"] == "ll" or r.get("sms") == p.get("sms"))]
                if found:  # the run's first table of that shape: its dedicated run
                    bars.append({"label": f"{p['op']}\n({p['tokens']} tokens)", "mode": p["mode"],
                                 "ep": found[0]["median_us"], "ref": p["median_us"],
                                 "shape": (p["hidden"], p["topk"], p["experts"]),
                                 "sms": p.get("sms"),
                                 "ref_name": ref["name"], "run": run["path"],
                                 "device": run["device"]})
                    break
    return bars


def build_plots(runs, refs):
    """Every plot the data allows: name -> plot description (no rendering)."""
    plots = []
    run, data = newest(runs, lambda r: sweep(r, "normal", "tokens", "sms"))
    if run:
        plots.append(sweep_plot("normal-tokens", run, data, "normal", "tokens", refs))
        normal_tokens = (run, data)
    else:
        normal_tokens = None
    run, data = newest(runs, lambda r: sweep(r, "normal", "sms", "tokens"))
    if run:
        plots.append(sweep_plot("normal-sms", run, data, "normal", "sms", refs))
    run, data = newest(runs, lambda r: sweep(r, "ll", "tokens", "sms"))
    ll_tokens = (run, data) if run else None
    if run:
        plots.append(sweep_plot("ll-tokens", run, data, "ll", "tokens", refs))
    panels = [nccl_panel(r, d, m) for m, rd in (("normal", normal_tokens), ("ll", ll_tokens))
              if rd for r, d in [rd]]
    panels = [p for p in panels if p["series"]]
    if panels:
        plots.append({"name": "vs-nccl", "kind": "lines", "panels": panels,
                      "title": "ep against an NCCL all-to-all of the same bytes per peer",
                      "source": ", ".join(sorted({rd[0]["path"] for rd in (normal_tokens, ll_tokens)
                                                  if rd}))})
    bars = deepep_bars(runs, refs)
    if bars:
        plots.append({"name": "vs-deepep", "kind": "bars", "bars": bars,
                      "title": f"ep against {bars[0]['ref_name']} at the same shapes: hidden "
                               f"7168, top-8 of 256 experts ({bars[0]['device']})"
                      if all(b["shape"] == (7168, 8, 256) for b in bars) else
                      f"ep against {bars[0]['ref_name']} at the same shapes ({bars[0]['device']})",
                      "source": ", ".join(sorted({b["run"] for b in bars}))})
    return plots


def summary(plot):
    if plot["kind"] == "bars":
        return f"{plot['name']}: {len(plot['bars'])} pairs of bars, from {plot['source']}"
    series = sum(len(p["series"]) for p in plot["panels"])
    points = sum(len(s["x"]) for p in plot["panels"] for s in p["series"])
    return f"{plot['name']}: {len(plot['panels'])} panels, {series} series, {points} points, " \
           f"from {plot['source']}"


# ---------------------------------------------------------------------------
# Rendering (matplotlib)
# ---------------------------------------------------------------------------


def render(plot, path, plt):
    if plot["kind"] == "bars":
        return render_bars(plot, path, plt)
    from matplotlib.ticker import FixedLocator, LogLocator, NullLocator, ScalarFormatter

    panels = plot["panels"]
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 5.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        color_of = {}  # op label -> colour, for its NCCL twin and reference markers
        last = None  # the op an NCCL twin ("pair") belongs to
        for s in panel["series"]:
            if s.get("marker_only"):
                continue
            if s.get("pair"):
                color = color_of[last]
                label = s["label"] if s["label"] not in color_of else "_nolegend_"
                color_of.setdefault(s["label"], color)
                ax.plot(s["x"], s["y"], "--", color=color, alpha=0.6, label=label)
                continue
            last = s["label"]
            color = color_of[last] = palette[len(color_of) % len(palette)]
            ax.plot(s["x"], s["y"], "-o", markersize=3.5, color=color, label=s["label"])
            if s.get("lo") and None not in s["lo"] and None not in s["hi"]:
                ax.fill_between(s["x"], s["lo"], s["hi"], color=color, alpha=0.15, linewidth=0)
        for s in panel["series"]:
            if s.get("marker_only"):
                like = color_of.get(s["like"], color_of.get(f"ep: {s['like']}", "black"))
                ax.plot(s["x"], s["y"], "*", color=like, markeredgecolor="black",
                        markersize=14, label=s["label"], zorder=5)
        xs = sorted({x for s in panel["series"] for x in s["x"]})
        if panel.get("log"):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_locator(LogLocator(base=10, subs=(2.0, 5.0)))
            ax.yaxis.set_minor_formatter(ScalarFormatter())
            ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.xaxis.set_major_locator(FixedLocator(xs))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_xlabel(panel["xlabel"])
        ax.set_ylabel(panel["ylabel"])
        if panel.get("title"):
            ax.set_title(panel["title"], fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(plot["title"], fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render_bars(plot, path, plt):
    modes = [m for m in ("normal", "ll") if any(b["mode"] == m for b in plot["bars"])]
    fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 5), squeeze=False)
    width = 0.38
    for ax, mode in zip(axes[0], modes):
        bars = [b for b in plot["bars"] if b["mode"] == mode]
        xs = range(len(bars))
        groups = (
            ax.bar([x - width / 2 for x in xs], [b["ep"] for b in bars], width, label="ep"),
            ax.bar([x + width / 2 for x in xs], [b["ref"] for b in bars], width,
                   label=bars[0]["ref_name"]),
        )
        for group in groups:
            for rect in group:
                ax.annotate(f"{rect.get_height():.1f}",
                            (rect.get_x() + rect.get_width() / 2, rect.get_height()),
                            ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([b["label"] for b in bars], fontsize=8)
        ax.set_ylabel("median latency, us (lower is better)")
        sms = {b["sms"] for b in bars}
        title = "normal mode" if mode == "normal" else "low-latency mode"
        if mode == "normal" and len(sms) == 1 and None not in sms:
            title += f", {sms.pop()} SMs"
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(plot["title"], fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help="ep-bench --json files and reference files "
                        "(default: bench/data/*.json)")
    parser.add_argument("--out", default=str(HERE / "plots"), help="directory of the PNGs")
    args = parser.parse_args(argv)
    files = args.files or sorted(glob.glob(str(HERE / "data" / "*.json")))
    runs, refs = load(files)
    plots = build_plots(runs, refs)
    print(f"{len(runs)} runs, {len(refs)} reference files, {len(plots)} plots")
    for plot in plots:
        print("  " + summary(plot))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: rendering skipped (pip install matplotlib)")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for plot in plots:
        path = out / f"{plot['name']}.png"
        render(plot, path, plt)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
