#!/usr/bin/env python
"""Restore one snapshot vs read its bytes vs prefill the same tokens (see docs/benchmarks.md).

    python scripts/bench_restore.py --store .kvsnap-bench/snaps-demo-qwen3-0.6b-2048t-1a --model
    .kvsnap-bench/demo-qwen3-0.6b

Each measurement runs with the file in the page cache ("warm") and after evicting it
with posix_fadvise(DONTNEED) ("evicted"); medians of --reps runs. Restore = what the
server does: checksum the file, mx.load it, build the cache objects, evaluate them.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvsnap.blas import preload_openblas  # noqa: E402

preload_openblas()

import mlx.core as mx  # noqa: E402

from kvsnap.key import KVSettings  # noqa: E402
from kvsnap.runtime.model.loading import load_model  # noqa: E402
from kvsnap.runtime.prefill.chunked import prefill  # noqa: E402
from kvsnap.snapshot.codec import decode_cache  # noqa: E402
from kvsnap.store.local import Store  # noqa: E402


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_bytes(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(16 << 20):
            pass


def read_into_new_buffer(path: Path) -> None:
    """What any restore must at least do: fault in fresh memory of the file's size and fill it."""
    buf = bytearray(path.stat().st_size)
    with open(path, "rb", buffering=0) as f:
        f.readinto(buf)


def restore(store: Store, path: Path) -> None:
    info = store.inspect(path)
    cache = decode_cache(store.load_arrays(info), info.layers)
    mx.eval([c.state for c in cache])


def timed(fn, reps: int, before=None) -> float:
    times = []
    for _ in range(reps):
        if before:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--store", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prefill-reps", type=int, default=1)
    ap.add_argument("--out", default="docs/bench/restore.csv")
    args = ap.parse_args()

    store = Store.open(args.store, readonly=True)
    path = max(store.snapshot_files(), key=lambda p: p.stat().st_size)
    size_mb = path.stat().st_size / 2**20
    rows = []
    for cache_state, before in (
        ("warm", lambda: read_bytes(path)),
        ("evicted", lambda: evict(path)),
    ):
        for what, fn in (
            ("read bytes", lambda: read_bytes(path)),
            ("read into new buffer", lambda: read_into_new_buffer(path)),
            ("restore", lambda: restore(store, path)),
        ):
            secs = timed(fn, args.reps, before)
            rows.append(
                {
                    "what": what,
                    "page_cache": cache_state,
                    "seconds": round(secs, 4),
                    "MB_per_s": round(size_mb / secs, 1),
                    "file_MB": round(size_mb, 1),
                }
            )
    lm = load_model(args.model, KVSettings())
    tokens = store.read_tokens(store.inspect(path))
    secs = timed(lambda: mx.eval([c.state for c in prefill(lm, tokens)]), args.prefill_reps)
    rows.append(
        {
            "what": "prefill",
            "page_cache": "-",
            "seconds": round(secs, 4),
            "MB_per_s": round(size_mb / secs, 1),
            "file_MB": round(size_mb, 1),
        }
    )
    for r in rows:
        print(
            f"{r['what']:<21} {r['page_cache']:<8} {r['seconds'] * 1000:10.1f} ms  "
            f"{r['MB_per_s']:9.1f} MB/s"
        )
    by = {(r["what"], r["page_cache"]): r["seconds"] for r in rows}
    print(
        f"restore / read bytes speed, page cache warm: "
        f"{by[('read bytes', 'warm')] / by[('restore', 'warm')]:.2f}; evicted: "
        f"{by[('read bytes', 'evicted')] / by[('restore', 'evicted')]:.2f}"
    )
    print(
        f"restore / read into a new buffer, page cache warm: "
        f"{by[('read into new buffer', 'warm')] / by[('restore', 'warm')]:.2f}; evicted: "
        f"{by[('read into new buffer', 'evicted')] / by[('restore', 'evicted')]:.2f}"
    )
    print(
        f"prefill / restore (evicted): {by[('prefill', '-')] / by[('restore', 'evicted')]:.0f}x; "
        f"{len(tokens)} tokens"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
