"""The bridge between the engine thread and a request's coroutine (routes_generation._Bridge)
and the loop hand-off under it (handoff.LoopHandoff)."""

from __future__ import annotations

import asyncio
import threading

from kvsnap.http.handoff import Handoffs, LoopHandoff
from kvsnap.http.routes_generation import _Bridge


def test_an_error_after_a_finish_ends_the_request_once():
    """The engine may send "error" after "done" (a late failure): the slot is released and the
    request timed once, else the in-flight count drifts below the real load."""
    ended: list[object] = []

    async def run() -> list[tuple[str, object]]:
        bridge = _Bridge(LoopHandoff(asyncio.get_running_loop()), ended.append)
        state = object()
        bridge(state, "token", "a")
        bridge(state, "done", "stop")
        bridge(state, "error", "late")
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return [bridge.queue.get_nowait() for _ in range(bridge.queue.qsize())]

    events = asyncio.run(run())
    assert [kind for kind, _ in events] == ["token", "done", "error"]
    assert len(ended) == 1


def test_a_steps_events_from_the_engine_thread_wake_the_loop_once_in_order():
    """Sixteen requests' tokens of one engine step, sent from another thread before the loop
    runs: every one arrives, in the order sent, in one loop wake-up (not one per token)."""

    async def run() -> tuple[list[int], int]:
        handoff = LoopHandoff(asyncio.get_running_loop())
        got: list[int] = []
        sender = threading.Thread(target=lambda: [handoff.send(got.append, i) for i in range(16)])
        sender.start()
        sender.join()  # the loop is blocked here: nothing is delivered yet
        assert got == []
        for _ in range(3):
            await asyncio.sleep(0)
        return got, handoff.flushes

    got, flushes = asyncio.run(run())
    assert got == list(range(16))
    assert flushes == 1


def test_events_sent_after_a_flush_schedule_another():
    async def run() -> list[int]:
        handoff = LoopHandoff(asyncio.get_running_loop())
        got: list[int] = []
        handoff.send(got.append, 1)
        await asyncio.sleep(0)
        handoff.send(got.append, 2)
        await asyncio.sleep(0)
        assert handoff.flushes == 2
        return got

    assert asyncio.run(run()) == [1, 2]


def test_a_failing_call_does_not_drop_the_ones_after_it():
    errors: list[dict] = []

    def boom(_: object) -> None:
        raise RuntimeError("boom")

    async def run() -> list[int]:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, context: errors.append(context))
        handoff = LoopHandoff(loop)
        got: list[int] = []
        handoff.send(got.append, 1)
        handoff.send(boom, None)
        handoff.send(got.append, 2)
        for _ in range(4):
            await asyncio.sleep(0)
        return got

    assert asyncio.run(run()) == [1, 2]
    assert len(errors) == 1


def test_one_handoff_per_running_loop():
    handoffs = Handoffs()

    async def run() -> tuple[LoopHandoff, LoopHandoff]:
        return handoffs.current(), handoffs.current()

    a, b = asyncio.run(run())
    c, _ = asyncio.run(run())
    assert a is b
    assert c is not a


def test_tokens_already_queued_are_read_as_one_text_in_order():
    """A reader that fell behind gets the queued tokens joined (one SSE chunk, not one each);
    the end event after them still comes, on its own."""

    async def run() -> list[tuple[str, object]]:
        bridge = _Bridge(LoopHandoff(asyncio.get_running_loop()), lambda _s: None)
        state = object()
        for text in ("a", "b", "c"):
            bridge(state, "token", text)
        bridge(state, "done", "stop")
        await asyncio.sleep(0)
        first = [await bridge.get(), await bridge.get()]
        bridge(state, "token", "d")
        await asyncio.sleep(0)
        return [*first, await bridge.get()]

    assert asyncio.run(run()) == [("token", "abc"), ("done", "stop"), ("token", "d")]
