#!/usr/bin/env python3
"""Plots of dta-bench results (results.json files written by build*/bin/dta-bench).

Usage:
    python bench/plot_bench.py --out DIR results1.json results2.json ...

Writes into DIR:
    throughput_<workload>.png   rollout tokens/s per method, grouped by model size
    memory_<workload>.png       peak memory (GiB) per method, grouped by model size
    compression_<model>.png     speedup of each method vs dense-ckpt against the workload's C
                                (one point per workload; the ideal curve from the FLOP model too)
Methods that ran out of memory are marked "OOM" above their group; n/a methods are left out.
"""

import argparse
import json
import math
import os
import re
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402

MODEL_ORDER = ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b"]
METHOD_ORDER = ["dense", "dense-ckpt", "packed", "packed-ckpt"]  # then dta variants as they come


def load(paths):
    runs = []
    for path in paths:
        try:
            with open(path) as f:
                run = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            sys.exit(f"plot_bench: cannot read {path}: {e}")
        if run.get("tool") != "dta-bench" or "methods" not in run:
            sys.exit(f"plot_bench: {path} is not a dta-bench results.json")
        run["_path"] = path
        runs.append(run)
    if not runs:
        sys.exit("plot_bench: no results given")
    return runs


def file_part(name):
    """A model or workload name as part of a file name: a config path becomes its file's stem."""
    base = os.path.basename(name)
    base = base[:-5] if base.endswith(".json") else base
    return re.sub(r"[^A-Za-z0-9._-]", "_", base) or "unnamed"


def model_key(name):
    name = name.lower()
    return (MODEL_ORDER.index(name), name) if name in MODEL_ORDER else (len(MODEL_ORDER), name)


def method_order(runs):
    """Methods that ran (or ran out of memory) anywhere: the baselines first, then the rest."""
    seen = []
    for run in runs:
        for m in run["methods"]:
            if m["status"] != "n/a" and m["name"] not in seen:
                seen.append(m["name"])
    return [m for m in METHOD_ORDER if m in seen] + [m for m in seen if m not in METHOD_ORDER]


def colors(methods):
    cmap = plt.get_cmap("tab10" if len(methods) <= 10 else "tab20")
    return {m: cmap(i % cmap.N) for i, m in enumerate(methods)}


def devices(runs):
    return ", ".join(sorted({r["device"]["name"] for r in runs}))


def grouped_bars(ax, groups, methods, value, ylabel, title):
    """groups: list of (group label, {method: method record}); value(record) -> float or None."""
    width = 0.8 / max(1, len(methods))
    color = colors(methods)
    for i, method in enumerate(methods):
        xs, ys = [], []
        for g, (_, records) in enumerate(groups):
            rec = records.get(method)
            x = g + (i - (len(methods) - 1) / 2) * width
            if rec is None or rec["status"] == "n/a":
                continue
            v = value(rec) if rec["status"] == "ok" else None
            if v is None:
                if rec["status"] == "OOM":
                    ax.text(x, 0, "OOM", rotation=90, ha="center", va="bottom", fontsize=7, color="crimson")
                continue
            xs.append(x)
            ys.append(v)
        if xs:
            ax.bar(xs, ys, width, label=method, color=color[method])
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([label for label, _ in groups])
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(axis="y", alpha=0.3)


def plot_per_workload(runs, out, methods):
    by_workload = defaultdict(list)
    for run in runs:
        by_workload[run["label"]].append(run)
    written = []
    for workload, wruns in sorted(by_workload.items()):
        wruns.sort(key=lambda r: model_key(r["model"]["name"]))
        groups = []
        for run in wruns:
            c = run["workload"]["compression"]
            groups.append((f"{file_part(run['model']['name'])}\n(C={c:.2f})", {m["name"]: m for m in run["methods"]}))
        device = devices(wruns)
        for kind, value, ylabel in [
            ("throughput", lambda m: m["rollout_tokens_per_second"], "rollout tokens / s"),
            ("memory", lambda m: m["peak_memory_gib"], "peak memory (GiB)"),
        ]:
            fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups) * max(1, len(methods)) / 3), 4.5))
            grouped_bars(ax, groups, methods, value, ylabel, f"{workload}: {kind} per method ({device})")
            path = os.path.join(out, f"{kind}_{file_part(workload)}.png")
            fig.tight_layout()
            fig.savefig(path, dpi=120)
            plt.close(fig)
            written.append(path)
    return written


def plot_compression(runs, out, methods):
    by_model = defaultdict(list)
    for run in runs:
        by_model[run["model"]["name"]].append(run)
    written = []
    for model, mruns in sorted(by_model.items(), key=lambda kv: model_key(kv[0])):
        mruns.sort(key=lambda r: r["workload"]["compression"])
        fig, ax = plt.subplots(figsize=(7, 4.5))
        plotted = False
        color = colors(methods)
        for method in methods:
            xs, ys, labels = [], [], []
            for run in mruns:
                rec = next((m for m in run["methods"] if m["name"] == method), None)
                if rec and rec["status"] == "ok" and rec.get("speedup_vs_dense_ckpt") is not None:
                    xs.append(run["workload"]["compression"])
                    ys.append(rec["speedup_vs_dense_ckpt"])
                    labels.append(run["label"])
            if xs:
                ax.plot(xs, ys, marker="o", label=method, color=color[method])
                plotted = True
        ideal = [(r["workload"]["compression"], r["flops"]["ideal_speedup_vs_dense_ckpt"]) for r in mruns]
        ax.plot(*zip(*ideal), linestyle="--", marker="x", color="gray", label="ideal (FLOP model)")
        for run, (x, y) in zip(mruns, ideal):
            ax.annotate(run["label"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color="gray")
        if not plotted:
            plt.close(fig)
            continue
        ax.axhline(1, color="black", linewidth=0.5)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set_ylim(bottom=0)
        ax.set_xlabel("workload compression C (rollout tokens / unique tokens)")
        ax.set_ylabel("speedup vs dense-ckpt (step time)")
        ax.set_title(f"{file_part(model)}: throughput vs compression ({devices(mruns)})")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, which="both")
        path = os.path.join(out, f"compression_{file_part(model)}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for the PNG files")
    parser.add_argument("results", nargs="+", help="results.json files written by dta-bench")
    args = parser.parse_args()
    runs = load(args.results)
    os.makedirs(args.out, exist_ok=True)
    methods = method_order(runs)
    written = plot_per_workload(runs, args.out, methods) + plot_compression(runs, args.out, methods)
    for path in written:
        print(path)
    if not any(math.isfinite(m.get("rollout_tokens_per_second") or math.nan) for r in runs for m in r["methods"]):
        print("plot_bench: no method finished in these results", file=sys.stderr)


if __name__ == "__main__":
    main()
