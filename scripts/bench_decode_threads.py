#!/usr/bin/env python
"""One batched decode step on 1 and on every OpenBLAS thread, on idle and on busy cores
(issue 41 item 1: why a decode step takes the cores other processes leave idle).

    python scripts/bench_decode_threads.py --shape mid --busy 0,2
    python scripts/bench_decode_threads.py --shape 0.6b-4l --busy 0,2

In process, no server: the fp32 model of scripts/bench_concurrent.py's shape, ROWS rows each
holding CONTEXT tokens of KV, one token per row per step (mlx-lm's model call, evaluated),
the cache held at CONTEXT. Per busy level (that many spinning processes beside it) the thread
counts alternate 2, 1, 2, 1 (or OpenBLAS's own count for 2), STEPS timed steps each after two
untimed; prints the median step, this process's CPU seconds per wall second and the load
average, one JSON line per measure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from kvsnap.blas import openblas_threads, preload_openblas  # noqa: E402

preload_openblas()
import mlx.core as mx  # noqa: E402
from bench_concurrent import SHAPES, make_model, start_busy  # noqa: E402


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", default="mid", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--busy", default="0,2", help="spinning processes per measure, e.g. 0,2")
    ap.add_argument("--workdir", type=Path, default=Path(".kvsnap-bench/concurrent"))
    args = ap.parse_args(argv)
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    blas = openblas_threads()
    if blas is None:
        print("no OpenBLAS in this process: nothing to compare", file=sys.stderr)
        return 1
    args.workdir.mkdir(parents=True, exist_ok=True)
    model, _ = load(str(make_model(args.shape, args.workdir.resolve())))
    cache = make_prompt_cache(model)
    prompt = mx.array([[i % 700 for i in range(args.context)]] * args.rows)
    for start in range(0, args.context, 512):
        model(prompt[:, start : start + 512], cache=cache)
        mx.eval([c.state for c in cache])

    def median_step(n: int) -> float:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            mx.eval(model(mx.array([[5]] * args.rows), cache=cache))
            times.append(time.perf_counter() - t0)
            for c in cache:
                c.offset -= 1  # the context stays at CONTEXT
        return statistics.median(times)

    for busy in [int(b) for b in args.busy.split(",")]:
        procs = start_busy(busy, limit_s=600)
        try:
            time.sleep(0.5)
            for threads in (blas.default, 1, blas.default, 1):
                blas.use(threads)
                median_step(2)
                cpu0, wall0 = cpu_seconds(), time.perf_counter()
                step = median_step(args.steps)
                wall = time.perf_counter() - wall0
                row = {
                    "shape": args.shape,
                    "rows": args.rows,
                    "context": args.context,
                    "busy": busy,
                    "threads": threads,
                    "step_ms": round(1000 * step, 1),
                    "cpu_per_wall": round((cpu_seconds() - cpu0) / wall, 2),
                    "load": [round(x, 2) for x in os.getloadavg()],
                }
                print(json.dumps(row), flush=True)
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    blas.use(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
