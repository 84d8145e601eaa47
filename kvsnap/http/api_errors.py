"""Every error the server sends is OpenAI's JSON error shape with a 4xx/5xx status, never a
plain-text page: ``APIError`` for the routes' own refusals, and handlers for the rest."""

from __future__ import annotations

import json
import logging
from typing import Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute

from kvsnap.errors import KvsnapError
from kvsnap.http.error_body import error_body
from kvsnap.http.limits import RequestRejected

log = logging.getLogger("kvsnap.http.server")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: Optional[str] = None,
        code: Optional[str] = None,
        type_: str = "invalid_request_error",
        headers: Optional[dict] = None,
    ):
        self.status, self.message, self.param, self.code, self.type, self.headers = (
            status,
            message,
            param,
            code,
            type_,
            headers,
        )
        super().__init__(message)


def error_response(
    status: int,
    message: str,
    param: Optional[str] = None,
    code: Optional[str] = None,
    type_: str = "invalid_request_error",
    headers: Optional[dict] = None,
) -> JSONResponse:
    return JSONResponse(
        error_body(message, type_, param, code), status_code=status, headers=headers
    )


def validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    """The first validation error as one line naming the field and the value, and the field."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return (
            f"the request body is not valid JSON "
            f"({first.get('ctx', {}).get('error', first.get('msg'))})",
            None,
        )
    given = first.get("input")
    # default=repr: an input that is not JSON (bytes) is shown, never a failed error page
    shown = (
        json.dumps(given, default=repr)[:80]
        if given is not None and not isinstance(given, dict)
        else ""
    )
    return f"{param or 'body'}: {first.get('msg')}" + (f" (got {shown})" if shown else ""), param


def install_error_handlers(app: FastAPI, routes: Sequence[BaseRoute] = ()) -> None:
    """``routes``: what the app serves, named by a 404 for a path none of them has."""
    served = sorted(
        f"{method} {route.path}"
        for route in routes
        if isinstance(route, APIRoute)
        for method in sorted(route.methods or ())
    )

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc)
        return error_response(400, message, param, "invalid_value")

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.type, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        message = str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":  # no route has this path
            message = (
                f"no route for {request.method} {request.url.path[:200]}; this server serves "
                f"{', '.join(served)} (docs/server.md)"
            )
        return error_response(
            exc.status_code,
            message,
            None,
            codes.get(exc.status_code),
            "invalid_request_error" if exc.status_code < 500 else "server_error",
        )

    @app.exception_handler(RequestRejected)
    async def on_rejected(request: Request, exc: RequestRejected):
        return error_response(400, str(exc), exc.param, "invalid_value")

    @app.exception_handler(KvsnapError)
    async def on_kvsnap_error(request: Request, exc: KvsnapError):
        return error_response(400, str(exc), None, "invalid_value")

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        # Never a plain-text 500; the details go to the log, not to the client.
        log.exception("[kvsnap] unexpected error on %s %s", request.method, request.url.path)
        return error_response(
            500,
            f"internal error ({type(exc).__name__}); the server log has the details",
            None,
            "internal_error",
            "server_error",
        )
