"""Model load alone, snapshot prefetch alone, and both at once (the prefetch on a second thread, as
the engine runs it).

python scripts/bench_overlap_ab.py load|prefetch|both MODEL_DIR STORE_DIR
"""

import os
import sys
import threading
import time

os.environ.setdefault("KVSNAP_CACHE_DIR", ".kvsnap-bench/cache")
from kvsnap.blas import preload_openblas

preload_openblas()
from pathlib import Path

import mlx.core as mx

from kvsnap.key import KVSettings
from kvsnap.runtime.model.loading import load_model
from kvsnap.runtime.warmup.prefetch import prefetch

M = Path(sys.argv[2])
S = sys.argv[3]
mode = sys.argv[1]
t0 = time.perf_counter()
if mode == "prefetch":
    p = prefetch(S, M, KVSettings(), 2**31)
    print("prefetch", round(time.perf_counter() - t0, 2), len(p.arrays))
elif mode == "load":
    lm = load_model(M)
    print("load", round(time.perf_counter() - t0, 2))
else:
    box = {}

    def th():
        s = mx.new_stream(mx.cpu)
        with mx.stream(s):
            t = time.perf_counter()
            box["p"] = prefetch(S, M, KVSettings(), 2**31)
            box["t"] = time.perf_counter() - t

    x = threading.Thread(target=th)
    x.start()
    lm = load_model(M)
    tl = time.perf_counter() - t0
    x.join()
    print(
        "both",
        round(time.perf_counter() - t0, 2),
        "load",
        round(tl, 2),
        "prefetch",
        round(box["t"], 2),
    )
