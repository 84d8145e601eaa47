#!/usr/bin/env python
"""Markdown tables and goal checks from the benchmark CSVs (pasted into docs/benchmarks.md).

python scripts/bench_report.py --startup docs/bench/startup-qwen3-0.6b-median.csv --restore
docs/bench/restore.csv
"""

from __future__ import annotations

import argparse
import csv

MODES = ("cold", "warm-prompts", "kv-snapshots")


def load(path: str) -> list[dict]:
    return list(csv.DictReader(open(path)))


def table(rows: list[dict], key: str) -> str:
    out = [
        f"| {key.replace('_', ' ')} | mode | launches | launch → warm-ready (s) | warm-up phase "
        f"(s) | first TTFT (s) | launch → first token (s) | TPOT (ms) | RSS (MB) | cached tokens |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r[key]} | {r['mode']} | {r['launches']} | {float(r['ready_s']):.2f} | "
            f"{float(r['warmup_s']):.2f} | {float(r['ttft_s']):.2f} | "
            f"{float(r['first_token_from_launch_s']):.2f} | {float(r['tpot_s']) * 1000:.0f} | "
            f"{float(r['rss_mb']):.0f} | {float(r['cached_tokens']):.0f} |"
        )
    return "\n".join(out)


def goals(rows: list[dict], key: str, at: str) -> str:
    by = {(r[key], r["mode"]): r for r in rows}
    if not all((at, m) in by for m in MODES):
        return f"(no complete point at {key}={at})"
    c, w, s = (by[(at, m)] for m in MODES)
    f = lambda r, k: float(r[k])  # noqa: E731
    lines = [
        (
            "warm-up phase: --warm-prompts / --kv-snapshots >= 20x",
            f(w, "warmup_s") / max(f(s, "warmup_s"), 1e-9),
            lambda v: v >= 20,
            "{:.0f}x",
        ),
        (
            "launch -> warm-ready: kv-snapshots / cold <= 1.1",
            f(s, "ready_s") / f(c, "ready_s"),
            lambda v: v <= 1.1,
            "{:.2f}",
        ),
        (
            "first-request TTFT: kv-snapshots / warm-prompts within 1.0 +- 0.1",
            f(s, "ttft_s") / f(w, "ttft_s"),
            lambda v: abs(v - 1) <= 0.1,
            "{:.2f}",
        ),
        (
            "first-request TTFT: cold / kv-snapshots >= 5x",
            f(c, "ttft_s") / f(s, "ttft_s"),
            lambda v: v >= 5,
            "{:.1f}x",
        ),
        (
            "TPOT: kv-snapshots within 5 % of cold",
            f(s, "tpot_s") / f(c, "tpot_s"),
            lambda v: abs(v - 1) <= 0.05,
            "{:.2f}",
        ),
    ]
    out = [f"| goal ({key} = {at}) | measured | met |", "|---|---:|---|"]
    for name, value, ok, fmt in lines:
        out.append(f"| {name} | {fmt.format(value)} | {'yes' if ok(value) else 'no'} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--startup", action="append", default=[])
    ap.add_argument("--key", default="prompt_tokens")
    ap.add_argument("--at", default="2048")
    ap.add_argument("--restore")
    args = ap.parse_args()
    for path in args.startup:
        rows = load(path)
        key = "agents" if len({r["agents"] for r in rows}) > 1 else args.key
        print(f"### {path}\n\n{table(rows, key)}\n")
        if key == "prompt_tokens":
            print(goals(rows, key, args.at) + "\n")
    if args.restore:
        rows = load(args.restore)
        print("| what | page cache | seconds | MB/s |\n|---|---|---:|---:|")
        for r in rows:
            print(
                f"| {r['what']} | {r['page_cache']} | {float(r['seconds']):.3f} | "
                f"{float(r['MB_per_s']):.0f} |"
            )
        by = {(r["what"], r["page_cache"]): float(r["seconds"]) for r in rows}
        ratio = by[("read bytes", "warm")] / by[("restore", "warm")]
        fresh = by[("read into new buffer", "warm")] / by[("restore", "warm")]
        print(
            f"\nrestore speed / page-cache read speed: {ratio:.2f} (goal >= 0.5: "
            f"{'met' if ratio >= 0.5 else 'not met'}); / read into a new buffer: {fresh:.2f}; "
            f"evicted: {by[('read bytes', 'evicted')] / by[('restore', 'evicted')]:.2f}; prefill / "
            f"restore: {by[('prefill', '-')] / by[('restore', 'evicted')]:.0f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
