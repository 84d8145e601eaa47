"""The bridge between the engine thread and a request's coroutine (routes_generation._Bridge)."""

from __future__ import annotations

import asyncio

from kvsnap.http.routes_generation import _Bridge


def test_an_error_after_a_finish_ends_the_request_once():
    """The engine may send "error" after "done" (a late failure): the slot is released and the
    request timed once, else the in-flight count drifts below the real load."""
    ended: list[object] = []

    async def run() -> list[tuple[str, object]]:
        bridge = _Bridge(asyncio.get_running_loop(), ended.append)
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
