"""mlx_lm.server's request fields that load models, held to the model the server was started with.

mlx-lm's handler loads whatever a request's ``model``, ``adapters`` and ``draft_model`` name:
any path on the server's disk (its error text then says which exist), and every request that
names another one than the last replaces the loaded model. ``kvsnap mlx-lm serve`` refuses
those fields unless they name what the server serves (``--allow-request-models`` keeps
upstream's behaviour): the check reads only the request, never the disk, so a refusal says
nothing about which paths exist. The served model's other spellings (its ``/v1/models`` id)
are mapped to the loaded model, so naming it neither reloads it nor misses the warm entries.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional

from kvsnap.errors import UsageError

ALLOW_OPTION = "--allow-request-models"
DEFAULT = "default_model"


def spellings(path: str | None) -> tuple[Any, ...]:
    """How a request may name the server's ``path``: as given, and as ``/v1/models`` lists it
    (the resolved folder, when it is one)."""
    if path is None:
        return (None,)
    local = Path(path)
    return (path, str(local.resolve())) if local.exists() else (path,)


@dataclass(frozen=True)
class ServedModel:
    """What the server was started with (``--model``, ``--adapter-path``, ``--draft-model``)."""

    model: str | None
    adapter: str | None
    draft: str | None
    # How requests may name each (``spellings``): looked up once, at start, not per request.
    model_names: tuple[Any, ...] = ()
    adapter_names: tuple[Any, ...] = ()
    draft_names: tuple[Any, ...] = ()

    @classmethod
    def of(cls, cli_args: Any) -> "ServedModel":
        model = getattr(cli_args, "model", None)
        adapter = getattr(cli_args, "adapter_path", None)
        draft = getattr(cli_args, "draft_model", None)
        return cls(model, adapter, draft, spellings(model), spellings(adapter), spellings(draft))

    def refusal(self, body: dict) -> tuple[str, str] | None:
        """``(field, message)`` for the first field of ``body`` that would load something else."""
        # (field, what it loads, values that keep the served one, the served one)
        fields = (
            ("model", "a model", (DEFAULT, *self.model_names), self.model),
            ("adapters", "an adapter", (None, *self.adapter_names), self.adapter),
            ("draft_model", "a draft model", (DEFAULT, *self.draft_names), self.draft),
        )
        for name, role, kept, served in fields:
            if name not in body:
                continue
            value = body[name]
            # A tuple, not a set: ``in`` compares with ==, so a list or dict value cannot raise.
            if value in kept:
                continue
            given = "none" if served is None else json.dumps(served)
            return name, (
                f"request field {name!r} = {json.dumps(value)} names {role} to load from the "
                f"server's disk, and this server loads only the one it was started with "
                f"({given}): omit {name!r} or name the served one. To let requests load other "
                f"models, adapters and draft models, start it with `kvsnap mlx-lm serve "
                f"{ALLOW_OPTION}` (mlx_lm.server's own behaviour)"
            )
        return None


def alias_served_names(model_provider: Any, served: ServedModel) -> None:
    """Map the served model's other spellings to the loaded model in mlx-lm's ``ModelProvider``
    (its ``_model_map`` is the documented place for such names), so naming it does not reload."""
    for name in served.model_names:
        if name is not None:
            model_provider._model_map[name] = served.model
            model_provider._adapter_map[name] = served.adapter
    for name in served.draft_names:
        if name is not None:
            model_provider._draft_model_map[name] = served.draft


# (field, message, code) of a POST body refused with a 400, or None
Refusal = Optional[tuple[str, str, str]]


def refusing_handler(
    api_handler: type[BaseHTTPRequestHandler], check: Callable[[dict], Refusal]
) -> type:
    """mlx-lm's ``APIHandler`` that answers 400 (OpenAI's error shape) to a POST whose JSON
    body ``check`` refuses; any other POST is mlx-lm's. Handlers wrap one another: each reads
    the body once and hands the bytes on."""
    # Imported here, at start-up: a refusal then reads no module from disk.
    from kvsnap.http.error_body import error_body

    class RequestModelGuard(api_handler):  # type: ignore[valid-type, misc]
        # Set by socketserver's setup(); declared here, where the Any base cannot say it.
        rfile: BinaryIO

        def do_POST(self) -> None:
            length = self._content_length()
            if length is None:
                return super().do_POST()  # mlx-lm's own 411 or 400, reading no body
            if length < 0:
                # mlx-lm would read a negative length as "to the end of the stream": a body
                # this check never saw.
                return self._refuse_length()
            raw = self.rfile.read(length)
            refused = _refusal(raw, check)
            if refused is not None:
                return self._refuse(*refused)
            # mlx-lm reads the body itself: give it the bytes read here, then the socket again.
            socket_file = self.rfile
            self.rfile = io.BytesIO(raw)
            try:
                return super().do_POST()
            finally:
                self.rfile = socket_file

        def _content_length(self) -> int | None:
            """Content-Length as mlx-lm reads it (``int``); None when absent or not a number."""
            try:
                return int(self.headers.get("Content-Length"))
            except (TypeError, ValueError):
                return None

        def _refuse_length(self) -> None:
            self._set_completion_headers(400)
            self.end_headers()
            given = self.headers.get("Content-Length")
            message = (
                f"Content-Length {given} is negative: send the body's length in bytes "
                "(kvsnap mlx-lm serve reads no body of unknown length)"
            )
            body = error_body(message, code="invalid_content_length")
            self.wfile.write(json.dumps(body).encode())

        def _refuse(self, field: str, message: str, code: str) -> None:
            self._set_completion_headers(400)
            self.end_headers()
            body = error_body(message, param=field, code=code)
            self.wfile.write(json.dumps(body).encode())

    return RequestModelGuard


def _refusal(raw: bytes, check: Callable[[dict], Refusal]) -> Refusal:
    try:
        body = json.loads(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None  # mlx-lm answers its own 400 for a body that is not JSON
    return check(body) if isinstance(body, dict) else None


def model_refusal(served: ServedModel) -> Callable[[dict], Refusal]:
    def check(body: dict) -> Refusal:
        refused = served.refusal(body)
        return None if refused is None else (*refused, "request_model_refused")

    return check


def guard_request_models(server: Any) -> None:
    """Serve through ``refusing_handler``: wraps mlx-lm's ``run`` (``main`` calls it with the
    ``ModelProvider``, before any thread starts) and ``_run_http_server``, which both
    mlx-lm's own ``run`` and kvsnap's warm ``run`` call with the response generator."""
    upstream_run, upstream_http = server.run, server._run_http_server

    def run(host, port, model_provider, *args, **kwargs):
        if ServedModel.of(model_provider.cli_args).model is None:
            raise UsageError(
                "kvsnap mlx-lm serve without --model loads whatever model each request "
                f"names; add --model MODEL (the one model it serves), or {ALLOW_OPTION} for "
                "mlx_lm.server's own behaviour"
            )
        return upstream_run(host, port, model_provider, *args, **kwargs)

    def run_http_server(host, port, response_generator, server_class=None, handler_class=None):
        model_provider = response_generator.model_provider
        served = ServedModel.of(model_provider.cli_args)
        alias_served_names(model_provider, served)
        handler = refusing_handler(handler_class or server.APIHandler, model_refusal(served))
        extra = {"server_class": server_class} if server_class is not None else {}
        return upstream_http(host, port, response_generator, handler_class=handler, **extra)

    server.run, server._run_http_server = run, run_http_server
