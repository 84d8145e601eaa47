"""Load Debian's OpenBLAS before mlx on Linux: mlx-cpu's bundled reference BLAS is ~40x slower.

Must run before the first ``import mlx.core``; afterwards it does nothing.
Set KVSNAP_NO_OPENBLAS=1 to keep mlx's own BLAS. Loaded here, its idle worker spins for
2^16 cycles, not OpenBLAS's 2^28 (``THREAD_TIMEOUT``; ``OPENBLAS_THREAD_TIMEOUT`` overrides).
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from dataclasses import dataclass

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)

# OpenBLAS's default (28: ~0.1 s of spinning after every call) keeps its worker thread busy
# through each gap between a server's matmuls, a core burnt while the model runs elsewhere
# (~3-5 ms of CPU per generated token at 16 clients); 2^16 cycles (~25 us) still
# covers back-to-back calls. A user's own OPENBLAS_THREAD_TIMEOUT wins.
THREAD_TIMEOUT = "16"


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
    # read by OpenBLAS when it loads: its idle worker spins 2^N cycles before sleeping
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", THREAD_TIMEOUT)
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    return path


def mapped_openblas_paths() -> list[str]:
    """The OpenBLAS libraries mapped into this process (Linux: /proc/self/maps), in map order."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                if "libopenblas" in os.path.basename(path) and path not in paths:
                    paths.append(path)
    except OSError:
        return []
    return paths


def loaded_openblas_path() -> str | None:
    """The OpenBLAS mapped into this process, the one kvsnap preloads first; None without one."""
    paths = mapped_openblas_paths()
    ours = find_openblas()
    if ours is not None and os.path.realpath(ours) in paths:
        return os.path.realpath(ours)
    return paths[0] if paths else None


def openblas_loaded() -> bool:
    """Whether an OpenBLAS library is mapped into this process (Linux: /proc/self/maps)."""
    return loaded_openblas_path() is not None


@dataclass(frozen=True)
class BlasThreads:
    """The loaded OpenBLAS's thread count, set between model steps.

    Between 1 and the count OpenBLAS started with, a change only sets the count the next call
    reads (no thread is made or joined), so a call already running is not disturbed.
    """

    library: ctypes.CDLL
    default: int  # what OpenBLAS chose at load: its cores, or OPENBLAS_NUM_THREADS

    def use(self, threads: int) -> None:
        """Later BLAS calls split over ``threads`` (0 or more than the default: the default)."""
        n = self.default if threads <= 0 else min(threads, self.default)
        self.library.openblas_set_num_threads(ctypes.c_int(n))

    def current(self) -> int:
        return int(self.library.openblas_get_num_threads())


def openblas_threads() -> BlasThreads | None:
    """The thread control of the OpenBLAS in this process; None without one (macOS, Linux with
    mlx's own BLAS), or where setting it between calls is not a plain count: an OpenMP build
    (the count is the calling thread's own) or one that pins threads to cores (a change
    re-pins the caller)."""
    path = loaded_openblas_path()
    if path is None or path.endswith(" (deleted)"):  # upgraded on disk since it was mapped
        return None
    try:  # the mapped library again (dlopen returns its handle), never a second copy
        library = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0))
    except OSError:
        return None
    calls = ("openblas_set_num_threads", "openblas_get_num_threads", "openblas_get_parallel")
    if not all(hasattr(library, f) for f in calls) or not hasattr(library, "openblas_get_config"):
        return None
    library.openblas_get_num_threads.restype = ctypes.c_int
    library.openblas_get_parallel.restype = ctypes.c_int
    library.openblas_get_config.restype = ctypes.c_char_p
    config = library.openblas_get_config() or b""
    if library.openblas_get_parallel() != 1 or b"NO_AFFINITY" not in config:
        return None
    try:  # the pool OpenBLAS made at load, which a lower count set since does not shrink
        pool = ctypes.c_int.in_dll(library, "blas_num_threads").value
    except ValueError:  # not exported by this build: the count now
        pool = 0
    return BlasThreads(library, max(pool, int(library.openblas_get_num_threads()), 1))


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
