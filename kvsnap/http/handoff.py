"""Engine-thread events handed to the event loop in batches: one wake-up of the loop per
decode step, not one per token.

The engine thread delivers a token to every running request in a step, microseconds apart.
``call_soon_threadsafe`` per token wrote the loop's self-pipe and woke the loop once per token
(16 requests: 16 syscalls and wake-ups a step); here the first event after a flush schedules
one flush and the events that follow join it, in order.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any, Callable


class LoopHandoff:
    """Calls ``fn(arg)`` on ``loop`` for each ``send``, in the order sent, batched."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable[[Any], None], Any]] = []
        self.flushes = 0  # loop wake-ups so far (tests count them)

    def send(self, fn: Callable[[Any], None], arg: Any) -> None:
        """From any thread: ``fn(arg)`` runs on the loop soon, after every call sent before."""
        with self._lock:
            self._pending.append((fn, arg))
            if len(self._pending) > 1:  # a flush is already scheduled and will take this one
                return
        self.loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            calls, self._pending = self._pending, []
        self.flushes += 1
        for i, (fn, arg) in enumerate(calls):
            try:
                fn(arg)
            except BaseException:
                # the rest still run, in order; the error surfaces as the loop's would
                self.loop.call_soon(self._run_rest, calls[i + 1 :])
                raise

    def _run_rest(self, calls: list[tuple[Callable[[Any], None], Any]]) -> None:
        with self._lock:
            self._pending[:0] = calls
        self._flush()


class Handoffs:
    """One ``LoopHandoff`` per running event loop (an app normally has one loop; tests make a
    loop per client), forgotten with its loop."""

    def __init__(self) -> None:
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopHandoff] = (
            weakref.WeakKeyDictionary()
        )

    def current(self) -> LoopHandoff:
        """The running loop's hand-off (made on first use)."""
        loop = asyncio.get_running_loop()
        found = self._by_loop.get(loop)
        if found is None:
            found = self._by_loop[loop] = LoopHandoff(loop)
        return found
