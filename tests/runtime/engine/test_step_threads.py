"""OpenBLAS's threads per batch step (issue 41 item 1): a decode step takes no more threads
than the cores other processes leave idle, a prompt step every thread. The engine's use of it
is tested in test_engine.py (fixed counts); here the automatic count on a really busy host."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvsnap.blas import find_openblas, openblas_threads, preload_openblas
from kvsnap.runtime.engine.step_threads import (
    OthersLoad,
    StepThreads,
    cgroup_cpu_quota,
    threads_for_idle_cores,
    usable_cores,
)

preload_openblas()

needs_openblas = pytest.mark.skipif(
    find_openblas() is None or not sys.platform.startswith("linux"),
    reason="Debian's libopenblas0-pthread is not installed",
)
SPIN = "import time\nend = time.time() + 30\nwhile time.time() < end: pass"


@pytest.mark.parametrize(
    ("cores", "others", "most", "quota", "threads"),
    [
        (2, 0.0, 2, None, 2),  # idle host: every thread
        (2, 0.4, 2, None, 2),  # a light neighbour leaves ~1.6 cores
        (2, 0.7, 2, None, 1),
        (2, 2.0, 2, None, 1),  # both cores busy: one thread, never 0
        (2, 5.0, 2, None, 1),
        (16, 3.2, 16, None, 13),
        (16, 0.0, 8, None, 8),  # never more than OpenBLAS has
        (16, 0.0, 16, 2.0, 2),  # docker --cpus 2 on an idle 16-core host
        (16, 10.0, 16, 2.0, 2),  # other cgroups' work spends none of our quota
        (16, 15.5, 16, 2.0, 1),  # but a full host still leaves us no idle core
    ],
)
def test_threads_for_idle_cores(cores, others, most, quota, threads):
    assert threads_for_idle_cores(cores, others, most, quota) == threads


def spinners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(n)]


def test_others_load_counts_another_process_spinning_and_not_this_one():
    load = OthersLoad(interval=0.0)
    procs = spinners(1)
    try:
        load.read()
        time.sleep(1.0)
        others = load.read()
        # this process spins too, and must not count
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            pass
        after = load.read()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert others is not None and others >= 0.6, others
    # the spinner's core, not this process's second one (other tests may add some)
    assert after is not None and after < others + 1.0, (others, after)


@needs_openblas
def test_a_decode_step_on_busy_cores_takes_one_thread_and_a_prompt_step_every_thread():
    blas = openblas_threads()
    if blas is None or blas.default < 2:
        pytest.skip("OpenBLAS runs one thread here")
    cores = usable_cores()
    threads = StepThreads(blas, None, cores=cores, others=OthersLoad(interval=0.5))
    procs = spinners(cores)
    try:
        threads.before_step(decoding_only=True)  # the first reading
        time.sleep(1.0)
        threads.before_step(decoding_only=True)
        assert blas.current() == 1
        threads.before_step(decoding_only=False)
        assert blas.current() == blas.default
        threads.before_step(decoding_only=True)
        assert blas.current() == 1
        threads.restore()
        assert blas.current() == blas.default
    finally:
        for p in procs:
            p.kill()
            p.wait()
        blas.use(0)


@needs_openblas
def test_a_fixed_count_ignores_the_host():
    blas = openblas_threads()
    if blas is None or blas.default < 2:
        pytest.skip("OpenBLAS runs one thread here")
    try:
        StepThreads(blas, 1).before_step(decoding_only=True)
        assert blas.current() == 1
        StepThreads(blas, 0).before_step(decoding_only=True)
        assert blas.current() == blas.default
        StepThreads(blas, 64).before_step(decoding_only=True)  # capped at OpenBLAS's pool
        assert blas.current() == blas.default
    finally:
        blas.use(0)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_others_load_watches_only_the_cores_it_is_given():
    """A container's cpuset: work on other cores of the host does not slow this process."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one core")
    pinned = cpus[-1]
    proc = subprocess.Popen(
        [sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{pinned}}})\n{SPIN}"]
    )
    try:
        on_it = OthersLoad(interval=0.0, cpus=frozenset({pinned}))
        on_it.read()
        time.sleep(1.0)
        assert (on_it.read() or 0.0) >= 0.6
    finally:
        proc.kill()
        proc.wait()
    # a core the host does not have: unknown, and the caller keeps OpenBLAS's own count
    assert OthersLoad(cpus=frozenset({10_000})).read() is None


def stat_file(path, per_cpu_ticks: list[int]) -> None:
    """A /proc/stat: the total line, then one line per core (user nice system idle ... steal)."""
    lines = [f"cpu  {sum(per_cpu_ticks)} 0 0 999999 50 0 0 0 0 0"]
    lines += [f"cpu{i} {t} 0 0 99999 5 0 0 0 0 0" for i, t in enumerate(per_cpu_ticks)]
    path.write_text("\n".join(lines) + "\nintr 1 2 3\nctxt 4\n")


def test_others_load_is_the_cores_busy_time_less_this_process_s_over_the_wall(tmp_path):
    from kvsnap.runtime.engine.step_threads import TICKS

    stat, clock, own = tmp_path / "stat", [100.0], [10.0]
    load = OthersLoad(
        interval=0.5,
        cpus=frozenset({0, 1}),
        stat_path=str(stat),
        own_seconds=lambda: own[0],
        clock=lambda: clock[0],
    )
    stat_file(stat, [0, 0, 0])
    assert load.read() == 0.0  # the first reading: nothing to compare yet
    # 2 s later: cores 0 and 1 busy 3.0 s in all, 0.8 s of it ours; core 2 (not ours) 2 s more
    stat_file(stat, [int(1.5 * TICKS), int(1.5 * TICKS), 2 * TICKS])
    clock[0], own[0] = 102.0, 10.8
    assert load.read() == pytest.approx((3.0 - 0.8) / 2.0)
    clock[0] = 102.3  # within the interval: the same reading, the file not read again
    stat.unlink()
    assert load.read() == pytest.approx(1.1)
    clock[0] = 103.0
    assert load.read() is None  # unreadable: the caller keeps OpenBLAS's own count


def test_a_cgroup_quota_caps_the_cores(tmp_path):
    quota = tmp_path / "cpu.max"
    quota.write_text("150000 100000\n")
    assert cgroup_cpu_quota(str(quota)) == 1.5
    quota.write_text("max 100000\n")
    assert cgroup_cpu_quota(str(quota)) is None
    quota.write_text("garbage")
    assert cgroup_cpu_quota(str(quota)) is None
    assert cgroup_cpu_quota(str(tmp_path / "absent")) is None


@needs_openblas
def test_the_count_is_read_back_so_two_engines_do_not_fight():
    """The count is the process's: a StepThreads must not trust what it set last."""
    blas = openblas_threads()
    if blas is None or blas.default < 2:
        pytest.skip("OpenBLAS runs one thread here")
    a, b = StepThreads(blas, 1), StepThreads(blas, 0)
    try:
        a.before_step(decoding_only=True)
        b.before_step(decoding_only=True)  # another engine decodes on every thread
        a.before_step(decoding_only=True)
        assert blas.current() == 1
    finally:
        blas.use(0)
