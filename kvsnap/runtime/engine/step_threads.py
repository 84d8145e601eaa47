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
from typing import Callable

from kvsnap.blas import BlasThreads

PROC_STAT = "/proc/stat"
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# /proc/stat's busy columns: user nice system (idle iowait) irq softirq steal
BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)


def busy_seconds(cpus: frozenset[int] | None = None, path: str = PROC_STAT) -> float | None:
    """CPU seconds the ``cpus`` (None: every core of the host) have spent busy since boot, from
    /proc/stat; None where it cannot be read."""
    try:
        with open(path) as stat:
            lines = stat.readlines()
    except OSError:
        return None
    ticks, seen = 0, False
    for line in lines:
        fields = line.split()
        if not fields or not fields[0].startswith("cpu"):
            continue
        name = fields[0][3:]
        # the "cpu" total line for the whole host, each "cpuN" line for only the cores we run on
        if (cpus is None) != (name == "") or (cpus is not None and int(name) not in cpus):
            continue
        values = [int(v) for v in fields[1:]]
        ticks += sum(values[i] for i in BUSY_COLUMNS if i < len(values))
        seen = True
    return ticks / TICKS if seen else None


def own_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def our_cpus() -> frozenset[int] | None:
    """The cores this process may run on (a container's cpuset); None where unknown (macOS)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:
        return None


def cgroup_cpu_quota(path: str = "/sys/fs/cgroup/cpu.max") -> float | None:
    """Cores' worth of CPU a cgroup v2 quota allows this process (``docker --cpus``), or None
    where there is none or it cannot be read."""
    try:
        with open(path) as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max" or float(period) <= 0:
        return None
    return float(quota) / float(period)


def usable_cores() -> int:
    """The cores this process may run on: its cpuset."""
    cpus = our_cpus()
    return len(cpus) if cpus else (os.cpu_count() or 1)


def threads_for_idle_cores(cores: int, others: float, most: int, quota: float | None = None) -> int:
    """Threads for a decode step: the cores ``others`` (cores' worth of other processes' work)
    leave idle, no more than a CPU ``quota`` allows, rounded, at least 1 and at most ``most``.
    (Other cgroups' processes spend no part of our quota, so the two bounds stay apart.)"""
    idle = cores - others if quota is None else min(cores - others, quota)
    return max(1, min(most, round(idle)))


@dataclass
class OthersLoad:
    """Cores' worth of CPU other processes used on our cores, over the last ``interval`` seconds
    or more (read between steps: two small reads, at most once per interval)."""

    interval: float = 0.5
    # the cores watched: those this process may run on (others elsewhere do not slow it)
    cpus: frozenset[int] | None = field(default_factory=our_cpus)
    stat_path: str = PROC_STAT
    own_seconds: Callable[[], float] = own_cpu_seconds
    clock: Callable[[], float] = time.monotonic
    _last: tuple[float, float, float] | None = None  # (monotonic, their busy s, own s)
    _value: float = 0.0

    def read(self) -> float | None:
        now = self.clock()
        if self._last is not None and now - self._last[0] < self.interval:
            return self._value
        busy = busy_seconds(self.cpus, self.stat_path)
        if busy is None:
            return None
        own = self.own_seconds()
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
    quota: float | None = field(default_factory=cgroup_cpu_quota)  # docker --cpus, cgroup v2
    others: OthersLoad = field(default_factory=OthersLoad)

    def before_step(self, decoding_only: bool) -> None:
        if self.blas is None:
            return
        want = self.decoding_threads() if decoding_only else self.blas.default
        # the count is the process's: read it back, as another engine may have set it
        if want != self.blas.current():
            self.blas.use(want)

    def decoding_threads(self) -> int:
        assert self.blas is not None
        if self.decode is not None:
            return self.blas.default if self.decode == 0 else min(self.decode, self.blas.default)
        others = self.others.read()
        if others is None:  # no /proc/stat: OpenBLAS's own count
            return self.blas.default
        return threads_for_idle_cores(self.cores, others, self.blas.default, self.quota)

    def restore(self) -> None:
        """OpenBLAS's own count again, for work outside the batch (the rewarmer's prefills)."""
        self.before_step(decoding_only=False)
