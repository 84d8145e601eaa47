"""What clients written for other servers send: bodies read as JSON whatever their
``Content-Type`` (as mlx_lm.server reads them), and CORS for browser clients, only for the
origins ``--allowed-origins`` names.

``JsonBodies`` is one pure ASGI middleware in front of every route, so a route added later
gets it too: a POST, PUT or PATCH whose ``Content-Type`` is not JSON (curl's ``-d`` sends
``application/x-www-form-urlencoded``) reaches the routes as ``application/json``, and a
body that is not JSON is the usual 400, never bytes a handler cannot show.
"""

from __future__ import annotations

from typing import Sequence

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
JSON_TYPE = (b"content-type", b"application/json")
CORS_METHODS = ("GET", "POST", "DELETE", "OPTIONS")


def is_json_type(value: bytes) -> bool:
    """``application/json`` or ``application/*+json``, whatever its parameters."""
    media = value.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (
        media.startswith(b"application/") and media.endswith(b"+json")
    )


class JsonBodies:
    """Every request body is read as JSON: a body method's non-JSON ``Content-Type`` (or none)
    becomes ``application/json`` before any route sees the request."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("method") in BODY_METHODS:
            headers = list(scope.get("headers") or [])
            kept = [(k, v) for k, v in headers if k != b"content-type"]
            types = [v for k, v in headers if k == b"content-type"]
            if len(types) != 1 or not is_json_type(types[0]):
                scope = {**scope, "headers": [*kept, JSON_TYPE]}
        await self.app(scope, receive, send)


def add_cors(app: FastAPI, origins: Sequence[str]) -> None:
    """Browser clients from ``origins`` (``*`` for any): preflights answered without a key,
    answers (refusals too) marked readable by them. Nothing when ``origins`` is empty.

    Added after the key guard, so outside it: a preflight carries no key, and a 401 must
    reach the page to be read. No credentials mode: keys travel in ``Authorization``."""
    if not origins:
        return
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(origins),
        allow_methods=list(CORS_METHODS),
        allow_headers=["*"],
        max_age=600,
    )
