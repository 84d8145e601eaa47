"""Load Debian's OpenBLAS before mlx on Linux: mlx-cpu's bundled reference BLAS is ~40x slower.

Must run before the first ``import mlx.core``; afterwards it does nothing.
Set KVSNAP_NO_OPENBLAS=1 to keep mlx's own BLAS.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)


def find_openblas() -> str | None:
    for pattern in CANDIDATES:
        for path in sorted(glob.glob(pattern)):
            if os.path.exists(path):
                return path
    return None


def preload_openblas() -> str | None:
    """Return the library loaded, or None when skipped (not Linux, disabled, too late, absent)."""
    if not sys.platform.startswith("linux") or os.environ.get("KVSNAP_NO_OPENBLAS"):
        return None
    if "mlx.core" in sys.modules:
        return None
    path = find_openblas()
    if path is None:
        return None
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    return path
