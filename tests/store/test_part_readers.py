"""The pool that reads a chain's parts at once: results in order, the first failure in order
raised, a bound on reads in flight, and mlx work handed to the calling thread."""

from __future__ import annotations

import threading
import time

import pytest

from kvsnap.store.part_readers import MAX_READERS, on_mlx_thread, run_concurrently


def test_results_come_back_in_call_order_whatever_order_they_finish_in():
    def call(i):
        def run():
            time.sleep(0.002 * (5 - i))  # the last call finishes first
            return i

        return run

    assert run_concurrently([call(i) for i in range(6)]) == list(range(6))


def test_two_calls_are_in_flight_at_once():
    # a serial loop never lets the first call past the barrier: it times out and fails
    both = threading.Barrier(2, timeout=10)
    assert run_concurrently([both.wait, both.wait]) in ([0, 1], [1, 0])


def test_no_more_than_the_bound_run_at_once():
    lock, now, most = threading.Lock(), [0], [0]

    def call():
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        on_mlx_thread(lambda: None)  # a real read asks for mlx memory: the pool grows
        time.sleep(0.01)
        with lock:
            now[0] -= 1

    run_concurrently([call] * 40, limit=3)
    assert most[0] == 3
    run_concurrently([call] * 40)
    assert 2 <= most[0] <= MAX_READERS


def test_the_first_failure_in_call_order_is_raised_not_the_first_to_happen():
    started = []

    def fails(tag, delay):
        def run():
            started.append(tag)
            time.sleep(delay)
            raise ValueError(tag)

        return run

    def ok():
        started.append("ok")
        on_mlx_thread(lambda: None)
        return "ok"

    calls = [ok, ok, fails("slow", 0.3), ok, fails("fast", 0.0)] + [ok] * 40
    with pytest.raises(ValueError, match="^slow$"):
        run_concurrently(calls)
    # once a failure is seen no further call starts: at most one per reader after it
    assert "slow" in started and "fast" in started
    assert len(started) <= 5 + MAX_READERS


def test_mlx_work_runs_on_the_calling_thread_and_its_errors_reach_the_caller():
    caller = threading.get_ident()
    seen = []

    def call():
        seen.append(on_mlx_thread(threading.get_ident))
        return threading.get_ident()

    workers = run_concurrently([call] * 5)
    assert seen == [caller] * 5
    assert caller not in workers

    def bad():
        on_mlx_thread(lambda: 1 / 0)

    with pytest.raises(ZeroDivisionError):
        run_concurrently([bad, bad])


def test_a_single_call_runs_here_without_a_thread():
    assert run_concurrently([threading.get_ident]) == [threading.get_ident()]
    assert run_concurrently([]) == []
