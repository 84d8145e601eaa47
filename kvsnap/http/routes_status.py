"""``GET /health``, ``GET /v1/models[/{id}]`` and ``GET /v1/status``: whether the server is warm,
what it serves, and the engine's state as data."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from kvsnap import __version__
from kvsnap.http.api_errors import APIError
from kvsnap.http.context import ServerContext
from kvsnap.http.health import health_answer

# What an ordinary (non-admin) key sees: nothing that moves with other tenants' traffic
# (cache counters, memory, queue lengths) and no exact cached-token count, which would tell
# how far a prompt matched the operator's; no paths, no warm-up details.
TENANT_STATUS_FIELDS = ("warm", "requests", "rewarm_in_progress")
TENANT_REQUEST_FIELDS = ("id", "prompt_tokens", "completion_tokens")


def status_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()
    engine, config = ctx.engine, ctx.config

    @router.get("/health")
    async def health():
        status, body = health_answer(engine, config.served_model_name)
        return JSONResponse(body, status_code=status)

    def card(name: str) -> dict:
        return {"id": name, "object": "model", "created": int(ctx.started), "owned_by": "kvsnap"}

    @router.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card(name) for name in config.model_names]}

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id not in config.model_names:
            raise APIError(404, ctx.unknown_model(model_id), "model", "model_not_found")
        return card(model_id)

    @router.get("/v1/status")
    async def status(request: Request):
        tenant, admin = ctx.caller(request)
        # A thread, not the event loop: the engine's locks are never held for file I/O, but
        # /health must not depend on that.
        body = await run_in_threadpool(engine.status, None if admin else tenant)
        if not admin:
            body = {k: body[k] for k in TENANT_STATUS_FIELDS}
            body["requests"] = [
                {k: row[k] for k in TENANT_REQUEST_FIELDS} for row in body["requests"]
            ]
        body["version"] = __version__
        body["uptime_s"] = round(time.time() - ctx.started, 3)
        return body

    return router
