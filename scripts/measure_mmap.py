#!/usr/bin/env python
"""Is a loaded snapshot memory-mapped? Measures RSS growth and /proc/self/maps (docs/design.md)."""

import gc
import os
import re
import tempfile

import mlx.core as mx


def rss_mib() -> float:
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1)) / 1024


def main() -> None:
    path = os.path.join(tempfile.mkdtemp(), "big.safetensors")
    a = mx.random.normal((100, 1024, 1024))
    mx.eval(a)
    mx.save_safetensors(path, {"x": a})
    del a
    gc.collect()
    mx.clear_cache()
    before = rss_mib()
    loaded = mx.load(path)
    mx.eval(loaded["x"])
    after = rss_mib()
    mapped = path in open("/proc/self/maps").read()
    size = os.path.getsize(path) / 2**20
    os.unlink(path)
    alive = mx.sum(loaded["x"]).item()
    print(
        f"file {size:.0f} MiB; RSS +{after - before:.0f} MiB on load; file mapped: {mapped}; "
        f"readable after unlink: {alive is not None}"
    )


if __name__ == "__main__":
    main()
