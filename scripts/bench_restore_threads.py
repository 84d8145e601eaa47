"""Restore throughput against fresh-memory reads, with one and two reading threads.

    python scripts/bench_restore_threads.py STORE/snapshots/<key>.safetensors --reps 7

Every measurement reads the file (in the page cache) into freshly allocated memory, as a
restore must: (a) a plain read into a new bytearray, (b) the same split over two threads,
(c) kvsnap's restore (``Store.load_arrays``: one read into an mlx buffer, checksum, views).
Prints medians and GB/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from kvsnap.blas import preload_openblas

preload_openblas()


def read_fresh(path: Path, threads: int) -> float:
    size = path.stat().st_size
    buf = bytearray(size)  # fresh pages: first touch happens inside the read, as in a restore
    view = memoryview(buf)
    bounds = [size * i // threads for i in range(threads + 1)]

    def part(lo: int, hi: int) -> None:
        with open(path, "rb", buffering=0) as f:
            f.seek(lo)
            done = lo
            while done < hi:
                done += f.readinto(view[done:hi])

    t0 = time.perf_counter()
    workers = [
        threading.Thread(target=part, args=(bounds[i], bounds[i + 1])) for i in range(threads)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.perf_counter() - t0


def restore(path: Path) -> float:
    import mlx.core as mx

    from kvsnap.store.local import Store

    store = Store.open(path.parent.parent, readonly=True)
    info = store.inspect(path)
    t0 = time.perf_counter()
    arrays = store.load_arrays(info)
    mx.eval(list(arrays.values()))
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("file", type=Path)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    size = args.file.stat().st_size
    results: dict[str, list[float]] = {
        "read, 1 thread": [],
        "read, 2 threads": [],
        "kvsnap restore": [],
    }
    for _ in range(args.reps):  # interleaved
        results["read, 1 thread"].append(read_fresh(args.file, 1))
        results["read, 2 threads"].append(read_fresh(args.file, 2))
        results["kvsnap restore"].append(restore(args.file))
    print(
        f"{args.file.name}: {size / 2**20:.0f} MiB, medians of {args.reps}, "
        f"os.cpu_count()={os.cpu_count()}"
    )
    for name, times in results.items():
        med = statistics.median(times)
        print(f"  {name:16s} {med:6.3f} s  {size / med / 1e9:5.2f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
