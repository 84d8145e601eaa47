"""OpenAI's JSON error body, in a module of its own: the connection guard needs it before the
API's schemas (pydantic) are imported."""

from __future__ import annotations

from typing import Optional


def error_body(
    message: str,
    type_: str = "invalid_request_error",
    param: Optional[str] = None,
    code: Optional[str] = None,
) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
