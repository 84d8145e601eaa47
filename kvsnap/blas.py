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


def openblas_loaded() -> bool:
    """Whether an OpenBLAS library is mapped into this process (Linux: /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as maps:
            return any("libopenblas" in line for line in maps)
    except OSError:
        return False


def openblas_warning() -> str | None:
    """One line for ``kvsnap serve``'s start when mlx runs its CPU matmuls on its own reference
    BLAS (Linux without OpenBLAS loaded); None elsewhere. Call it once mlx is loaded."""
    if not sys.platform.startswith("linux") or openblas_loaded():
        return None
    mx = sys.modules.get("mlx.core")
    if mx is not None and mx.default_device().type != mx.cpu:
        return None
    install = "apt-get install libopenblas0-pthread"
    if os.environ.get("KVSNAP_NO_OPENBLAS"):
        why, fix = "KVSNAP_NO_OPENBLAS is set", f"unset it (with `{install}` done)"
    elif find_openblas() is None:
        why, fix = "none is installed", f"install it: `{install}`"
    else:
        why, fix = "mlx was imported before kvsnap could preload it", "report this as a bug"
    return (
        f"OpenBLAS is not loaded ({why}): mlx's CPU matmuls run on its reference BLAS, several "
        f"times slower (prefill, decode, warm-up); {fix}"
    )
