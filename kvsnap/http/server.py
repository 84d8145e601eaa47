"""The OpenAI-compatible HTTP server: ``create_app(engine, config)`` assembles the routers.

State lives in one ``ServerContext`` per app, not in globals. The routes:
``routes_generation`` (chat and text completions), ``routes_status`` (health, models,
status), ``routes_cache`` (the prefix-cache admin endpoint) and ``metrics`` (Prometheus,
with the request counter middleware); errors in OpenAI's shape come from ``api_errors``;
bodies read as JSON whatever their type, and CORS, from ``compat``.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from typing import Any, Optional

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from kvsnap import __version__
from kvsnap.http.agent_recorder import AgentRecorder
from kvsnap.http.api_errors import install_error_handlers
from kvsnap.http.compat import JsonBodies, add_cors
from kvsnap.http.context import ServerConfig, ServerContext
from kvsnap.http.guard import GuardMiddleware
from kvsnap.http.metrics import RequestCounter, metrics_router
from kvsnap.http.routes_anthropic import AnthropicErrorShape, messages_router
from kvsnap.http.routes_cache import cache_router
from kvsnap.http.routes_generation import generation_router
from kvsnap.http.routes_responses import responses_router
from kvsnap.http.routes_status import status_router
from kvsnap.runtime.engine.engine import Engine

__all__ = ["ServerConfig", "create_app"]


def create_app(
    engine: Engine, config: ServerConfig, recorder: Optional[AgentRecorder] = None
) -> FastAPI:
    """``recorder``: serve --record-agents (agent prefixes appended to a warm-prompt file)."""
    ctx = ServerContext(engine, config, recorder=recorder)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        ctx.started = time.time()
        if not engine.loaded.is_set():
            engine.start()
        try:
            yield
        finally:
            await run_in_threadpool(engine.shutdown)

    # With keys, the schema pages are off: they would be the one unauthenticated surface left.
    docs: dict[str, Any] = (
        {}
        if not config.auth.enabled
        else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    )
    app = FastAPI(title="kvsnap", version=__version__, lifespan=lifespan, **docs)
    routers = [
        status_router(ctx),
        cache_router(ctx),
        generation_router(ctx),
        messages_router(ctx),
        responses_router(ctx),
        metrics_router(ctx.metrics, ctx.require_admin),
    ]
    app.add_middleware(JsonBodies)  # innermost: every route reads its body as JSON
    app.add_middleware(GuardMiddleware, auth=config.auth, max_body_bytes=config.max_request_bytes)
    app.add_middleware(AnthropicErrorShape)  # outside the guard: its 401 and 413 too
    add_cors(app, config.allowed_origins)  # outside the guard: preflights carry no key
    # added last, so outermost: the guard's refusals are counted too
    routes = [route for router in routers for route in router.routes]
    app.add_middleware(RequestCounter, metrics=ctx.metrics, routes=routes)
    install_error_handlers(app, routes)
    for router in routers:
        app.include_router(router)
    return app
