"""Reading a chain's parts at once: a bounded pool of reading threads whose mlx work runs on the
thread that started them.

mlx streams belong to a thread. A thread that evaluates anything gets a stream of its own whose
worker thread outlives it (one OS thread more per pool thread, on mlx 0.32), and a stream made on
one thread cannot be used on another. So the pool's threads only open, read and hash files; what
needs mlx (a buffer to read into, the tensor views of it) they hand to the calling thread through
``on_mlx_thread``, which the caller serves while it waits. No mlx import here.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TypeVar

T = TypeVar("T")

# Reads in flight at once: enough to keep a disk's queue busy and both cores copying.
MAX_READERS = 8
# A pool starts with one thread and adds one whenever a call asks for mlx memory (a real read)
# or nothing has finished for this long: calls that only find parts already in memory (tens of
# microseconds each) never pay for more threads (~0.1 ms each to start).
GROW_AFTER_S = 0.001


@dataclass
class _Job:
    """A call handed to the owner thread, and its outcome."""

    fn: Callable[..., Any]
    args: tuple
    done: threading.Event = field(default_factory=threading.Event)
    value: Any = None
    error: BaseException | None = None


class _Reader(threading.Thread):
    """A pool thread: it knows its pool, so ``on_mlx_thread`` can find the owner."""

    def __init__(self, pool: "_Pool", index: int):
        super().__init__(name=f"kvsnap-read-{index}", daemon=True)
        self.pool = pool

    def run(self) -> None:
        self.pool.work()


class _Pool:
    def __init__(self, calls: Sequence[Callable[[], Any]], limit: int):
        self.calls = calls
        self.limit = max(1, limit)
        self.results: list[Any] = [None] * len(calls)
        self.errors: dict[int, BaseException] = {}
        self.claimed = 0
        self.stopped = False
        self.started = 0
        self.lock = threading.Lock()
        # jobs for the owner thread, and None once per pool thread that has finished
        self.inbox: "queue.SimpleQueue[_Job | None]" = queue.SimpleQueue()

    def claim(self) -> int | None:
        with self.lock:
            if self.stopped or self.claimed >= len(self.calls):
                return None
            self.claimed += 1
            return self.claimed - 1

    def work(self) -> None:
        try:
            while (i := self.claim()) is not None:
                try:
                    self.results[i] = self.calls[i]()
                except BaseException as exc:  # raised on the caller's thread, in call order
                    with self.lock:
                        self.errors[i] = exc
                        self.stopped = True
        finally:
            self.inbox.put(None)

    def can_grow(self) -> bool:
        """Whether another reader would have a call to take. Once False it stays False (the
        counts only grow), so the owner may ask without the lock."""
        return not self.stopped and self.started < self.limit and self.claimed < len(self.calls)

    def grow(self) -> int:
        """Start one more reader while calls wait unclaimed (1 if it did)."""
        with self.lock:
            if not self.can_grow():
                return 0
            self.started += 1
            reader = _Reader(self, self.started)
        reader.start()
        return 1

    def hand_over(self, fn: Callable[..., T], args: tuple) -> T:
        job = _Job(fn, args)
        self.inbox.put(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.value

    def run(self) -> list[Any]:
        running = self.grow()
        try:
            while running:
                try:
                    # no timeout once growing cannot help: a long cold read wakes nobody
                    job = self.inbox.get(timeout=GROW_AFTER_S if self.can_grow() else None)
                except queue.Empty:  # a slow call: another reader beside it
                    running += self.grow()
                    continue
                if job is None:
                    running -= 1
                    continue
                try:
                    job.value = job.fn(*job.args)
                except BaseException as exc:  # the reader that asked raises it
                    job.error = exc
                job.done.set()
                # a call that needs mlx memory is a real read: let another start beside it
                running += self.grow()
        finally:
            with self.lock:
                self.stopped = True
            while running:  # interrupted: let every reader finish before leaving
                job = self.inbox.get()
                if job is None:
                    running -= 1
                else:
                    job.error = RuntimeError("the restore this read belonged to was interrupted")
                    job.done.set()
        if self.errors:
            raise self.errors[min(self.errors)]
        return self.results


def run_concurrently(calls: Sequence[Callable[[], T]], limit: int | None = None) -> list[T]:
    """Each call's result, in the calls' order, up to ``limit`` running at once on pool threads
    (one alone runs here). The first call, in that order, that raised has its exception raised
    once every started call has finished; calls not yet started then never start. A call does
    its mlx work through ``on_mlx_thread``."""
    if len(calls) <= 1:
        return [call() for call in calls]
    return _Pool(calls, min(limit or MAX_READERS, len(calls))).run()


def on_mlx_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the thread that owns the current read: here, unless this is a pool
    thread, whose owner runs it (mlx work must stay on the caller's thread and stream)."""
    thread = threading.current_thread()
    if isinstance(thread, _Reader):
        return thread.pool.hand_over(fn, args)
    return fn(*args)
