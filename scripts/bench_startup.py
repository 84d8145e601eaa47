#!/usr/bin/env python
"""Start-up benchmark sweeps: cold vs --warm-prompts vs --kv-snapshots (see docs/benchmarks.md).

    python scripts/bench_startup.py --size qwen3-0.6b --tokens 256,1024,2048,4096 --reps 5
    --budget-min 60
    python scripts/bench_startup.py --size tiny --tokens 512 --agents 1,10,100 --reps 5
    python scripts/bench_startup.py --size tiny --tokens 100 --agents 1000 --reps 3 \
        --ready-only --modes cold,kv-snapshots --before /tmp/before    # issue 41 item 5

Every launch records the server's CPU seconds at ready beside the wall time; with more than
one agent the per-agent cost over a cold launch is printed in wall and CPU milliseconds.
--before ROOT launches each mode from that checkout too (``MODE@ROOT``), interleaved.

Writes raw and median CSVs (and PNG plots with --plot) under --out.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvsnap.blas import preload_openblas  # noqa: E402

preload_openblas()

from kvsnap.tools.bench_startup import (  # noqa: E402
    SweepPoint,
    medians,
    per_agent,
    run_point,
    write_csv,
    write_raw,
)
from kvsnap.tools.demo import DemoSpec, make_demo_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size", default="tiny", choices=("tiny", "qwen3-0.6b"))
    ap.add_argument("--model", help="use this model directory instead of a demo model")
    ap.add_argument("--tokens", default="512", help="comma-separated system-prompt lengths")
    ap.add_argument("--agents", default="1", help="comma-separated agent counts")
    ap.add_argument(
        "--reps", type=int, default=5, help="launches per mode and point (median reported)"
    )
    ap.add_argument(
        "--budget-min", type=float, default=60.0, help="stop launching after this many minutes"
    )
    ap.add_argument(
        "--workdir", default=".kvsnap-bench", help="models, agents files, stores, server logs"
    )
    ap.add_argument("--out", default="docs/bench", help="CSV (and PNG) output folder")
    ap.add_argument("--tag", default="", help="suffix for output file names")
    ap.add_argument(
        "--ready-only",
        action="store_true",
        help="measure launch -> ready only, send no first request",
    )
    ap.add_argument(
        "--modes",
        default="cold,warm-prompts,kv-snapshots",
        help="comma-separated modes to launch (warm-prompts prefills at every launch: drop it for "
        "long prompts)",
    )
    ap.add_argument("--before", help="also launch every mode from this checkout, interleaved")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if args.before:
        modes += [f"{m}@{Path(args.before).resolve()}" for m in modes]

    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = (
        Path(args.model).resolve()
        if args.model
        else make_demo_model(workdir / f"demo-{args.size}", DemoSpec(size=args.size))
    )
    env = {"KVSNAP_CACHE_DIR": str(workdir / "cache")}
    os.environ.update(env)
    deadline = time.monotonic() + args.budget_min * 60
    rows = []
    for agents in [int(a) for a in args.agents.split(",")]:
        for tokens in [int(t) for t in args.tokens.split(",")]:
            point = SweepPoint(
                model=model,
                prompt_tokens=tokens,
                agents=agents,
                reps=args.reps,
                modes=tuple(modes),
                request=not args.ready_only,
            )
            rows += run_point(point, workdir, deadline, env)
            if time.monotonic() > deadline:
                break
    tag = args.tag or f"{model.name}"
    write_raw(out / f"startup-{tag}-raw.csv", rows)
    med = medians(rows)
    write_csv(out / f"startup-{tag}-median.csv", med)
    for m in med:
        print(
            f"{m['prompt_tokens']:>5}t x{m['agents']:<3} {m['mode']:<13} n={m['launches']} ready "
            f"{m['ready_s']:.2f}s warm-up {m['warmup_s']:.2f}s "
            f"TTFT {m['ttft_s'] * 1000:.1f} ms first-token-from-launch "
            f"{m['first_token_from_launch_s']:.2f}s TPOT {m['tpot_s'] * 1000:.1f} ms RSS "
            f"{m['rss_mb']:.0f} MB CPU {m['cpu_s']:.2f}s cached {m['cached_tokens']}"
        )
    for a in per_agent(med):
        print(
            f"{a['prompt_tokens']:>5}t x{a['agents']:<5} {a['mode']}: "
            f"{a['ms_per_agent']:.2f} ms / agent wall, {a['cpu_ms_per_agent']:.2f} ms / agent CPU "
            "over a cold launch"
        )
    print(f"load average at the end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
