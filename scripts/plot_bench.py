#!/usr/bin/env python
"""Plot the start-up benchmark CSVs (docs/bench/*.csv) into PNGs for docs/benchmarks.md.

python scripts/plot_bench.py --median docs/bench/startup-qwen3-0.6b-median.csv --x prompt_tokens
--out docs/bench/qwen3-0.6b
python scripts/plot_bench.py --median docs/bench/startup-tiny-agents-median.csv --x agents --out
docs/bench/tiny-agents
python scripts/plot_bench.py --table RESULTS/summary.json --out docs/bench/table   #
scripts/bench_table.py: one PNG per family
"""

from __future__ import annotations

import argparse
import csv
import json
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


# scripts/bench_table.py's modes: one line each; vllm-mlx dashed, the same colour per mode kind.
TABLE_LINES = {
    "kvsnap-cold": ("kvsnap cold", "#888888", "-"),
    "kvsnap-warm": ("kvsnap --warm-prompts", "#d95f02", "-"),
    "kvsnap-snap": ("kvsnap --warm-prompts --kv-snapshots", "#1b9e77", "-"),
    "vllm-cold": ("vllm-mlx cold", "#888888", "--"),
    "vllm-warm": ("vllm-mlx --warm-prompts", "#d95f02", "--"),
    "vllm-kvsnap": ("kvsnap vllm-mlx serve --kv-snapshots --warm-prompts", "#1b9e77", "--"),
}


def plot_table(summary_path: Path, out_prefix: str) -> list[Path]:
    """One PNG per family from bench_table.py's summary.json: median TTFT vs concurrency, a line
    per server and mode."""
    summary = json.loads(Path(summary_path).read_text())
    cells = list(summary["cells"].values())
    written = []
    for family in summary["meta"]["families"]:
        rows = [c for c in cells if c["family"] == family and c["ttft_s"] is not None]
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for mode, (label, color, style) in TABLE_LINES.items():
            pts = sorted((c["concurrency"], c["ttft_s"]) for c in rows if c["mode"] == mode)
            if pts:
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    marker="o",
                    linestyle=style,
                    color=color,
                    label=label,
                )
        ax.set_xticks(sorted({c["concurrency"] for c in rows}))
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("TTFT, median (s)")
        ax.set_title(rows[0]["label"], fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        out = Path(f"{out_prefix}-{family}.png")
        fig.savefig(out, dpi=110)
        plt.close(fig)
        written.append(out)
    return written


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--table", help="bench_table.py's summary.json: one TTFT-vs-concurrency plot per family"
    )
    ap.add_argument("--median", help="a start-up benchmark median CSV")
    ap.add_argument("--x", default="prompt_tokens", choices=("prompt_tokens", "agents"))
    ap.add_argument("--out", required=True, help="output path prefix")
    ap.add_argument("--title", default="")
    ap.add_argument(
        "--panels",
        default=",".join(f for f, _ in PANELS),
        help="comma-separated fields to plot (ready_s alone for --ready-only runs)",
    )
    args = ap.parse_args()
    if args.table:
        for path in plot_table(Path(args.table), args.out):
            print(f"wrote {path}")
        return 0
    if not args.median:
        ap.error("give --median CSV or --table summary.json")
    panels = [(f, label) for f, label in PANELS if f in args.panels.split(",")]

    rows = list(csv.DictReader(open(args.median)))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    axes = axes[0]
    for ax, (field, label) in zip(axes, panels):
        for mode in MODES:
            # A cold server has no warm-up phase (0 s): nothing to draw on a log axis.
            pts = sorted(
                (float(r[args.x]), float(r[field]))
                for r in rows
                if r["mode"] == mode and float(r[field]) > 0
            )
            if pts:
                ax.plot(
                    [p[0] for p in pts], [p[1] for p in pts], "o-", label=mode, color=COLORS[mode]
                )
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
