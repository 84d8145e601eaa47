"""API keys and the request-body cap, as one pure ASGI middleware in front of every route.

Pure ASGI (not ``BaseHTTPMiddleware``) so streaming responses and client disconnects pass
through untouched. A caller's identity reaches the routes as ``scope["state"]``:
``tenant`` (a fingerprint of its key, never the key) and ``admin``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass
from typing import Iterable, Optional

from starlette.exceptions import HTTPException

from kvsnap.errors import UsageError
from kvsnap.http.error_body import error_body

OPEN_PATHS = frozenset({"/health"})  # load balancers probe it without a key

API_KEY_ENV = "KVSNAP_API_KEY"
ADMIN_API_KEY_ENV = "KVSNAP_ADMIN_API_KEY"
MIN_KEY_LENGTH = 8


def keys_from(flags: Iterable[str] | None, env_value: str | None, flag: str) -> tuple[str, ...]:
    """Keys from repeated flags plus a comma-separated environment variable."""
    keys = [k.strip() for k in (flags or [])] + [k.strip() for k in (env_value or "").split(",")]
    keys = [k for k in keys if k]
    for k in keys:
        if len(k) < MIN_KEY_LENGTH or any(c.isspace() for c in k):
            raise UsageError(
                f"{flag}: a key must be at least {MIN_KEY_LENGTH} characters with no spaces (got "
                f"one of {len(k)} characters); generate one with `python -c 'import secrets; "
                f"print(secrets.token_urlsafe(32))'`"
            )
    return tuple(dict.fromkeys(keys))


def fingerprint(key: str) -> str:
    """Names a tenant in status and cache scopes without revealing its key."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Auth:
    api_keys: tuple[str, ...] = ()
    admin_keys: tuple[str, ...] = ()

    @classmethod
    def from_flags(
        cls,
        api_keys: Iterable[str] | None,
        admin_keys: Iterable[str] | None,
        environ: dict | None = None,
    ) -> "Auth":
        env = os.environ if environ is None else environ
        return cls(
            keys_from(api_keys, env.get(API_KEY_ENV), "--api-key"),
            keys_from(admin_keys, env.get(ADMIN_API_KEY_ENV), "--admin-api-key"),
        )

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys or self.admin_keys)

    @staticmethod
    def _match(given: str, keys: tuple[str, ...]) -> bool:
        # Compare against every key, always: the time taken says nothing about which matched.
        found = False
        for k in keys:
            found |= hmac.compare_digest(given.encode(), k.encode())
        return found

    def identify(self, authorization: Optional[str]) -> Optional[tuple[str, bool]]:
        """(tenant, is_admin) for a valid ``Authorization`` header, else None."""
        if not authorization:
            return None
        scheme, _, given = authorization.partition(" ")
        given = given.strip()
        if scheme.lower() != "bearer" or not given:
            return None
        is_admin = self._match(given, self.admin_keys)
        if is_admin or self._match(given, self.api_keys):
            return fingerprint(given), is_admin
        return None


class BodyTooLarge(HTTPException):
    """An HTTPException, so FastAPI's body parser passes it through as a 413 instead of a 400."""

    def __init__(self, limit: int):
        super().__init__(
            413,
            f"the request body is over {limit} bytes; send less, or start the server with a larger "
            f"--max-request-bytes",
        )


def _error_response(status: int, message: str, code: str, headers: tuple = ()) -> tuple[dict, dict]:
    body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
    raw = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *headers,
    ]
    return {"type": "http.response.start", "status": status, "headers": raw}, {
        "type": "http.response.body",
        "body": body,
    }


class GuardMiddleware:
    def __init__(self, app, auth: Auth, max_body_bytes: int):
        self.app = app
        self.auth = auth
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        state = scope.setdefault("state", {})
        state["tenant"], state["admin"] = "", True
        if self.auth.enabled and scope.get("path") not in OPEN_PATHS:
            headers = dict(scope.get("headers") or [])
            who = self.auth.identify(headers.get(b"authorization", b"").decode("latin-1"))
            api_key = headers.get(b"x-api-key", b"").decode("latin-1").strip()
            if who is None and api_key:  # Anthropic's header (Claude Code sends its key so)
                who = self.auth.identify(f"Bearer {api_key}")
            if who is None:
                start, body = _error_response(
                    401,
                    "missing or invalid API key; send `Authorization: Bearer <key>` or "
                    "`x-api-key: <key>`",
                    "invalid_api_key",
                    ((b"www-authenticate", b"Bearer"),),
                )
                await send(start)
                return await send(body)
            state["tenant"], state["admin"] = who
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await self._too_large(send)
        seen = 0
        started = False

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge:
            if not started:
                await self._too_large(send)

    async def _too_large(self, send):
        start, body = _error_response(
            413, BodyTooLarge(self.max_body_bytes).detail, "request_too_large"
        )
        await send(start)
        await send(body)
