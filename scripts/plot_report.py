"""Plot what scripts/pair_report.py measured: the target's forward-time curve and the speedup of
each method and k per prompt, one panel row per dtype.

    .venv/bin/python scripts/plot_report.py out/pair_bfloat16.json out/pair_float32.json \
        -o docs/pair_report.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", type=Path)
    ap.add_argument("-o", "--output", type=Path, default=Path("docs/pair_report.png"))
    args = ap.parse_args()
    reports = [json.loads(p.read_text()) for p in args.reports]
    fig, axes = plt.subplots(len(reports), 2, figsize=(13, 4.2 * len(reports)), squeeze=False,
                             gridspec_kw={"width_ratios": [1, 2.4]})
    for row, report in zip(axes, reports, strict=True):
        curve = {int(k): v for k, v in report["forward_ms"].items()}
        row[0].plot(list(curve), list(curve.values()), marker="o")
        row[0].set(xscale="log", xlabel="new tokens in one forward pass", ylabel="ms",
                   title=f"target forward time, {report['dtype']} (context 200)", ylim=(0, None))
        row[0].set_xticks(list(curve), [str(k) for k in curve])
        runs = [r for r in report["runs"] if r["method"] != "none"]
        prompts = list(dict.fromkeys(r["prompt"] for r in runs))
        configs = list(dict.fromkeys((r["method"], r["k"]) for r in runs))
        width = 0.8 / len(configs)
        for i, (method, k) in enumerate(configs):
            ys = [next(r["speedup"] for r in runs if r["prompt"] == p and r["method"] == method
                       and r["k"] == k) for p in prompts]
            row[1].bar([x + i * width for x in range(len(prompts))], ys, width,
                       label=f"{method} k={k}")
        row[1].axhline(1.0, color="black", linewidth=0.8)
        row[1].set_xticks([x + 0.4 - width / 2 for x in range(len(prompts))], prompts)
        row[1].set(ylabel="speedup over plain decoding",
                   title=f"greedy, 256 new tokens, {report['dtype']}")
        row[1].legend(ncol=2, fontsize=8)
    fig.tight_layout()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.output, dpi=110)
    print(args.output)


if __name__ == "__main__":
    main()
