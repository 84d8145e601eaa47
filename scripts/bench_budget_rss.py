"""Resident memory of a server whose budget pins only some of many snapshots (the rest indexed).

    python scripts/bench_budget_rss.py --model M --agents agents.json --store S --budgets
    0,50,100,200,2048

For each --cache-memory-mb: launch `kvsnap serve`, wait for warm, read RSS and /v1/status
(pinned bytes, loaded and indexed snapshots), stop. A cold launch gives the baseline.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import httpx

from kvsnap.tools.bench_startup import child_rss_mb
from kvsnap.tools.serverproc import start_server


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--agents", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--budgets", default="0,50,100,200,2048")
    ap.add_argument("--workdir", default=".kvsnap-bench")
    args = ap.parse_args(argv)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    print("budget_mb,rss_mb,pinned_mb,loaded,indexed,ready_s")
    for budget in ["cold", *args.budgets.split(",")]:
        extra = (
            []
            if budget == "cold"
            else [
                "--warm-prompts",
                args.agents,
                "--kv-snapshots",
                args.store,
                "--no-write-back",
                "--cache-memory-mb",
                budget,
            ]
        )
        server = start_server(
            args.model, ["--continuous-batching", *extra], work / f"budget-{budget}.log"
        )
        try:
            ready = server.wait_ready(600)
            status = httpx.get(f"{server.url}/v1/status").json()
            rss = child_rss_mb(server.proc.pid)
            snaps = status["snapshots"]
            print(
                f"{budget},{rss:.0f},{status['cache']['current_memory_mb']:.1f},"
                f"{snaps.get('loaded', 0)},{snaps.get('indexed', 0)},{ready:.2f}",
                flush=True,
            )
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
