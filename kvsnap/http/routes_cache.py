"""``DELETE /v1/cache/prefix``: drop the request prefixes and re-warm from the snapshots (admin)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from kvsnap.http.context import ServerContext


def cache_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()
    engine = ctx.engine

    @router.delete("/v1/cache/prefix")
    async def clear_prefix(request: Request):
        ctx.require_admin(request)
        ctx.check_ready()
        cleared = len(engine.prefix) if engine.prefix is not None else 0
        engine.clear_prefix_cache(rewarm=True)  # coalesced into a re-warm already running
        return {"status": "cleared", "rewarm_scheduled": True, "cleared_entries": cleared}

    return router
