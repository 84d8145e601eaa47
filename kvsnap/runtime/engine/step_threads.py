"""OpenBLAS's threads per batch step: every thread for a step that computes prompts; for a step
that only decodes, no more threads than the cores other processes leave idle.

A decode step's matmuls are a few rows thin. On idle cores splitting them pays (mid, 16 rows on
2k tokens: 117 against 124 ms a step; at Qwen3-0.6B's widths 278 against 459-472 ms). On busy
ones each of a step's ~60 calls waits for its second thread to be scheduled: with 2 busy
processes on the 2 cores a 2-thread mid step took 870-1,040 ms, a 1-thread one 210-260 ms.
Set between steps, a count binds the calls that start after it (mlx-lm runs the next decode step
ahead, so a switch lags by up to one step).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from kvsnap.blas import BlasThreads

PROC_STAT = "/proc/stat"
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# /proc/stat's busy columns: user nice system (idle iowait) irq softirq steal
BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)


def host_busy_seconds(path: str = PROC_STAT) -> float | None:
    """CPU seconds every core of the host has spent busy since boot; None where unreadable."""
    try:
        with open(path) as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    values = [int(v) for v in fields[1:]]
    return sum(values[i] for i in BUSY_COLUMNS if i < len(values)) / TICKS


def own_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def threads_for_idle_cores(cores: int, others: float, most: int) -> int:
    """Threads for a decode step: the cores ``others`` (cores' worth of other processes' work)
    leave idle, rounded, at least 1 and at most ``most``."""
    return max(1, min(most, round(cores - others)))


@dataclass
class OthersLoad:
    """Cores' worth of CPU the host's other processes used, over the last ``interval`` seconds
    or more (read between steps: two small reads, at most once per interval)."""

    interval: float = 0.5
    _last: tuple[float, float, float] | None = None  # (monotonic, host busy s, own s)
    _value: float = 0.0

    def read(self) -> float | None:
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self.interval:
            return self._value
        busy = host_busy_seconds()
        if busy is None:
            return None
        own = own_cpu_seconds()
        if self._last is not None:
            then, busy0, own0 = self._last
            # ticks are coarse: a sample can see this process's seconds before the host's
            self._value = max(0.0, ((busy - busy0) - (own - own0)) / (now - then))
        self._last = (now, busy, own)
        return self._value


@dataclass
class StepThreads:
    """Sets the count before each batch step. ``decode``: threads for a step that only decodes
    (None: by the idle cores; 0: OpenBLAS's own count)."""

    blas: BlasThreads | None  # None: no OpenBLAS in this process (macOS, mlx's own BLAS)
    decode: int | None = None
    cores: int = field(default_factory=usable_cores)
    others: OthersLoad = field(default_factory=OthersLoad)
    _now: int = -1  # the count last set (-1: never set here)

    def before_step(self, decoding_only: bool) -> None:
        if self.blas is None:
            return
        want = self.decoding_threads() if decoding_only else self.blas.default
        if want != self._now:
            self.blas.use(want)
            self._now = want

    def decoding_threads(self) -> int:
        assert self.blas is not None
        if self.decode is not None:
            return self.blas.default if self.decode == 0 else min(self.decode, self.blas.default)
        others = self.others.read()
        if others is None:  # no /proc/stat: OpenBLAS's own count
            return self.blas.default
        return threads_for_idle_cores(self.cores, others, self.blas.default)

    def restore(self) -> None:
        """OpenBLAS's own count again, for work outside the batch (the rewarmer's prefills)."""
        self.before_step(decoding_only=False)
