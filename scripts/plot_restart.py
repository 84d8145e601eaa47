#!/usr/bin/env python
"""Plot and summarise scripts/bench_restart.py's results (docs/benchmarks.md, "Conversations
across a restart").

    python scripts/plot_restart.py .kvsnap-bench/restart/results.json docs/bench/restart

Writes PREFIX.png (TTFT p50 and cached share per turn, one line per server and restart way)
and PREFIX.md (the turn-4 table and the goals), and prints the table.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"kvsnap-persist": "#1b9e77", "kvsnap": "#d95f02", "vllm-mlx": "#7570b3"}
STYLES = {"none": "-", "sigterm": "--", "kill9": ":"}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def cells(rows: list[dict]) -> dict:
    out: dict = defaultdict(list)
    for r in rows:
        out[(r["server"], r["way"], r["turn"])].append(r)
    return out


def turn_row(rs: list[dict]) -> dict:
    ttft = [r["ttft_s"] for r in rs]
    tpot = [r["tpot_s"] for r in rs if r.get("tpot_s")]
    prompt = sum(r["prompt_tokens"] or 0 for r in rs)
    cached = sum(r["cached_tokens"] or 0 for r in rs)
    return {
        "ttft_p50": statistics.median(ttft),
        "ttft_p95": pct(ttft, 0.95),
        "tpot": statistics.median(tpot) if tpot else None,
        "cached": cached,
        "prompt": prompt,
    }


def main() -> int:
    results, prefix = Path(sys.argv[1]), Path(sys.argv[2])
    rows = json.loads(results.read_text())
    by = cells(rows)
    runs = sorted({(r["server"], r["way"]) for r in rows})
    turns = sorted({r["turn"] for r in rows})
    restart_turn = min(r["turn"] for r in rows if "restart_ready_s" in r)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for server, way in runs:
        stats = [turn_row(by[(server, way, t)]) for t in turns]
        label = f"{server} / {way}"
        style = {"color": COLORS.get(server, "#444"), "linestyle": STYLES.get(way, "-")}
        ax1.plot(turns, [s["ttft_p50"] for s in stats], marker="o", label=label, **style)
        ax2.plot(
            turns, [100 * s["cached"] / max(1, s["prompt"]) for s in stats], marker="o", **style
        )
    for ax in (ax1, ax2):
        ax.axvline(restart_turn - 0.5, color="#bbbbbb", linewidth=1)
        ax.set_xlabel("turn (restart before turn %d)" % restart_turn)
        ax.set_xticks(turns)
    ax1.set_ylabel("TTFT p50 (s)")
    ax2.set_ylabel("prompt tokens from cache (%)")
    ax1.legend(fontsize=7)
    fig.suptitle("Conversations across a restart (scripts/bench_restart.py)")
    fig.tight_layout()
    fig.savefig(prefix.parent / (prefix.name + ".png"), dpi=110)
    t, p = restart_turn, restart_turn - 1
    lines = [
        f"| server | restart | turn-{t} TTFT p50 | p95 | vs never restarted | cached turn {t} "
        f"| share of turn-{p} prompt cached | TPOT turns 1-{p} |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = {}
    for server, way in runs:
        if way == "none":
            base[server] = turn_row(by[(server, way, restart_turn)])["ttft_p50"]
    reference = base.get("kvsnap", base.get("kvsnap-persist"))
    for server, way in runs:
        t4 = turn_row(by[(server, way, restart_turn)])
        t3 = by[(server, way, restart_turn - 1)]
        prev_prompt = sum(r["prompt_tokens"] or 0 for r in t3)
        early = [r["tpot_s"] for t in turns if t < restart_turn for r in by[(server, way, t)]]
        tpot = statistics.median([x for x in early if x]) if any(early) else None
        ratio = f"{t4['ttft_p50'] / reference:.2f}x" if reference else "–"
        tpot_text = f"{1000 * tpot:.1f} ms" if tpot else "–"
        lines.append(
            f"| {server} | {way} | {t4['ttft_p50']:.2f} s | {t4['ttft_p95']:.2f} s | {ratio} "
            f"| {t4['cached']}/{t4['prompt']} | {100 * t4['cached'] / max(1, prev_prompt):.1f} % "
            f"| {tpot_text} |"
        )
    table = "\n".join(lines)
    (prefix.parent / (prefix.name + ".md")).write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
