"""``DELETE /v1/cache/prefix``: drop the request prefixes (persisted ones too) and re-warm
from the snapshots (admin)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from kvsnap.http.context import ServerContext


def cache_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()
    engine = ctx.engine

    @router.delete("/v1/cache/prefix")
    async def clear_prefix(request: Request):
        ctx.require_admin(request)
        ctx.check_ready()
        # waits for the engine thread (off the event loop); coalesced into a running re-warm
        cleared = await run_in_threadpool(engine.clear_prefix_cache, True)
        # then the conversations persisted on disk (--persist-requests; None when off)
        removed = await run_in_threadpool(engine.purge_persisted)
        return {
            "status": "cleared",
            "rewarm_scheduled": True,
            "cleared_entries": cleared,
            "persisted_removed": removed,
        }

    return router
