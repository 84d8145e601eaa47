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
    ("cores", "others", "most", "threads"),
    [
        (2, 0.0, 2, 2),  # idle host: every thread
        (2, 0.4, 2, 2),  # a light neighbour leaves ~1.6 cores
        (2, 0.7, 2, 1),
        (2, 2.0, 2, 1),  # both cores busy: one thread, never 0
        (2, 5.0, 2, 1),
        (16, 3.2, 16, 13),
        (16, 0.0, 8, 8),  # never more than OpenBLAS has
    ],
)
def test_threads_for_idle_cores(cores, others, most, threads):
    assert threads_for_idle_cores(cores, others, most) == threads


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
