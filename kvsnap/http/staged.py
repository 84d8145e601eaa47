"""The app uvicorn serves from the moment the port opens, while the API itself is still being
built: importing fastapi, pydantic and the routes is ~0.2 s of CPU that need not stand between
a warm engine and a load balancer's first `/health` 200.

Until the API is built, ``GET /health`` is answered here from the engine's state (the same
answer the route gives, ``health.health_answer``) and every other request waits for it, then
goes through it whole (keys, limits, CORS, metrics). Nothing is refused for arriving early: a
request sent at the first 200 is served as soon as the routes exist, which is what
mlx_lm.server's 200 means too (its model loads on the first request). Uvicorn's lifespan is
answered here, so the port opens at once; the API's own lifespan is not run (the engine is
already started, and its shutdown is ``on_shutdown``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from concurrent.futures import Future
from typing import Any, Awaitable, Callable, Optional

from kvsnap.http.error_body import error_body
from kvsnap.http.health import health_answer

log = logging.getLogger("kvsnap")

ASGIApp = Callable[[dict, Callable, Callable], Awaitable[None]]


class StagedApp:
    """``build`` runs on a thread of its own (``start_building``); ``on_shutdown`` runs on a
    worker thread when uvicorn stops; ``on_build_failure`` is told a build that raised (the
    server then answers 503 and should stop); ``settled`` is set when the build ends."""

    def __init__(
        self,
        engine: Any,
        served_model_name: str,
        build: Callable[[], ASGIApp],
        on_shutdown: Callable[[], None],
        on_build_failure: Callable[[BaseException], None],
        settled: Optional[threading.Event] = None,
    ):
        self.engine = engine
        self.served_model_name = served_model_name
        self._build = build
        self._on_shutdown = on_shutdown
        self._on_build_failure = on_build_failure
        self._built: Future = Future()
        self._app: Optional[ASGIApp] = None  # set once built: later requests skip the wait
        # set when the build ends, built or failed (given: others wait on it too)
        self.settled = settled if settled is not None else threading.Event()

    def start_building(self) -> threading.Thread:
        thread = threading.Thread(target=self._run_build, name="kvsnap-api-build", daemon=True)
        thread.start()
        return thread

    def _run_build(self) -> None:
        try:
            app = self._build()
        except BaseException as exc:  # an import error too: reported, never a silent hang
            log.error("[kvsnap] building the HTTP API failed: %s: %s", type(exc).__name__, exc)
            self._built.set_exception(exc)
            self._on_build_failure(exc)
            return
        finally:
            self.settled.set()
        self._app = app
        self._built.set_result(app)

    @property
    def failed(self) -> Optional[BaseException]:
        return self._built.exception() if self._built.done() else None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":  # always here, however soon the build ends
            return await self._lifespan(receive, send)
        if self._app is not None:
            return await self._app(scope, receive, send)
        if scope["type"] == "http" and scope["method"] == "GET" and scope["path"] == "/health":
            if not self._built.done():
                status, body = health_answer(self.engine, self.served_model_name)
                return await _send_json(send, status, body)
        try:
            app = await asyncio.wrap_future(self._built)
        except BaseException as exc:  # the build failed: the server is stopping
            if scope["type"] != "http":
                return None
            message = f"the server failed to start its HTTP API ({type(exc).__name__}): see its log"
            return await _send_json(send, 503, error_body(message, "server_error", None, None))
        return await app(scope, receive, send)

    async def _lifespan(self, receive: Callable, send: Callable) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await asyncio.to_thread(self._on_shutdown)
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _send_json(send: Callable, status: int, body: dict) -> None:
    # starlette's JSONResponse's bytes, so the answer is the same before and after the build
    raw = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": raw})
