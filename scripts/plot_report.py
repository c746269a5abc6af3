#!/usr/bin/env python3
"""Plots a `pdsim testbed` report (out/report.json) as PNGs.

  ttft_cdf.png          TTFT CDF, disaggregated vs colocated (when the report has both)
  tpot_cdf.png          TPOT CDF, the same
  layer_latency.png     per-layer KV transfer latency (step ready on prefill -> landed on decode):
                        p50 / p90 / p99 per layer
  overlap.png           per request: transfer time hidden behind prefill compute vs exposed, and
                        the report's exposed_fraction

Usage: plot_report.py REPORT.json [--out DIR]
Needs Python 3 and matplotlib (Debian: python3-matplotlib; scripts/bootstrap.sh installs it).
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def lifecycle(report, key):
    return [r[key] for r in report.get("lifecycle", []) if r.get("ok") and r.get(key) is not None]


def cdf(ax, values, label):
    if not values:
        return
    xs = sorted(values)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)}, p50={xs[len(xs) // 2]:.1f})")


def plot_cdfs(report, key, title, path):
    fig, ax = plt.subplots(figsize=(6, 4))
    cdf(ax, lifecycle(report, key), report.get("mode", "run"))
    if report.get("colocated"):
        cdf(ax, lifecycle(report["colocated"], key), "colocated")
    ax.set_xlabel(f"{title} (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{title} CDF")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_layers(report, path):
    rows = report.get("layer_latency_us_by_layer", [])
    fig, ax = plt.subplots(figsize=(6, 4))
    if rows:
        layers = [r["layer"] for r in rows]
        for q, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ax.plot(layers, [r[q] / 1000 for r in rows], style, label=q)
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no transfer (colocated run)", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("layer")
    ax.set_ylabel("ready -> landed (ms)")
    ax.set_title("per-layer KV transfer latency")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_overlap(report, path):
    rows = [r for r in report.get("lifecycle", []) if r.get("ok") and r.get("transfer_ms", 0) > 0]
    fig, ax = plt.subplots(figsize=(7, 4))
    if rows:
        ids = [r["id"] for r in rows]
        exposed = [r["exposed_transfer_ms"] for r in rows]
        hidden = [max(0.0, r["transfer_ms"] - r["exposed_transfer_ms"]) for r in rows]
        ax.bar(ids, hidden, label="hidden behind prefill compute")
        ax.bar(ids, exposed, bottom=hidden, label="exposed (after the prefill forward)")
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no transfer (colocated run)", ha="center", va="center", transform=ax.transAxes)
    frac = report.get("transfer", {}).get("exposed_fraction", 0.0)
    cfg = report.get("config", {})
    ax.set_title(f"transfer overlap: exposed_fraction {frac:.3f} (layerwise {'on' if cfg.get('layerwise', True) else 'off'})")
    ax.set_xlabel("request")
    ax.set_ylabel("KV in flight (ms)")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report")
    ap.add_argument("extra", nargs="*", help="ignored (e.g. the requests CSV)")
    ap.add_argument("--out", default=None, help="output directory (default: the report's)")
    args = ap.parse_args()
    with open(args.report) as f:
        report = json.load(f)
    out = args.out or os.path.dirname(os.path.abspath(args.report))
    os.makedirs(out, exist_ok=True)
    written = []
    for name, fn in (("ttft_cdf.png", lambda p: plot_cdfs(report, "ttft_ms", "TTFT", p)),
                     ("tpot_cdf.png", lambda p: plot_cdfs(report, "tpot_ms", "TPOT", p)),
                     ("layer_latency.png", lambda p: plot_layers(report, p)),
                     ("overlap.png", lambda p: plot_overlap(report, p))):
        path = os.path.join(out, name)
        fn(path)
        written.append(path)
    print("plots: " + " ".join(written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
