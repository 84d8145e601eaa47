#!/usr/bin/env python
"""Plot the start-up benchmark CSVs (docs/bench/*.csv) into PNGs for docs/benchmarks.md.

    python scripts/plot_bench.py --median docs/bench/startup-qwen3-0.6b-median.csv --x prompt_tokens --out docs/bench/qwen3-0.6b
    python scripts/plot_bench.py --median docs/bench/startup-tiny-agents-median.csv --x agents --out docs/bench/tiny-agents
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MODES = ("cold", "warm-prompts", "kv-snapshots")
COLORS = {"cold": "#888888", "warm-prompts": "#d95f02", "kv-snapshots": "#1b9e77"}
PANELS = [
    ("ready_s", "launch → warm-ready (s)"),
    ("ttft_s", "first agent request TTFT (s)"),
    ("first_token_from_launch_s", "launch → first token of first request (s)"),
    ("warmup_s", "warm-up phase: model loaded → warm (s)"),
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--median", required=True)
    ap.add_argument("--x", default="prompt_tokens", choices=("prompt_tokens", "agents"))
    ap.add_argument("--out", required=True, help="output path prefix")
    ap.add_argument("--title", default="")
    ap.add_argument("--panels", default=",".join(f for f, _ in PANELS), help="comma-separated fields to plot (ready_s alone for --ready-only runs)")
    args = ap.parse_args()
    panels = [(f, label) for f, label in PANELS if f in args.panels.split(",")]

    rows = list(csv.DictReader(open(args.median)))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    axes = axes[0]
    for ax, (field, label) in zip(axes, panels):
        for mode in MODES:
            # A cold server has no warm-up phase (0 s): nothing to draw on a log axis.
            pts = sorted((float(r[args.x]), float(r[field])) for r in rows if r["mode"] == mode and float(r[field]) > 0)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=mode, color=COLORS[mode])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("system-prompt tokens" if args.x == "prompt_tokens" else "agents")
        ax.set_title(label, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    out = Path(args.out + ".png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
