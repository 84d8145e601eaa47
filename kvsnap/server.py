"""The OpenAI-compatible HTTP server: ``create_app(engine)``; state lives in the app, not in globals."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import __version__
from .engine import Engine, GenerationRequest, RequestState
from .errors import KvsnapError, MessageError, TemplateError
from .prompts import encode_prompt, normalize_messages, request_tokens
from .schemas import ChatCompletionRequest, CompletionRequest, chat_chunk, chat_response, completion_response, error_body, new_id, usage

log = logging.getLogger("kvsnap.server")


@dataclass
class ServerConfig:
    served_model_name: str
    model_aliases: tuple[str, ...] = ()
    default_max_tokens: int = 256
    context_length: Optional[int] = None


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None, type_: str = "invalid_request_error"):
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        super().__init__(message)


def _error(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None, type_: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON ({first.get('ctx', {}).get('error', first.get('msg'))})", None
    given = first.get("input")
    shown = json.dumps(given)[:80] if given is not None and not isinstance(given, dict) else ""
    return f"{param or 'body'}: {first.get('msg')}" + (f" (got {shown})" if shown else ""), param


class _Bridge:
    """Hands engine-thread events to one request's asyncio queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def __call__(self, state: RequestState, kind: str, payload: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))


def create_app(engine: Engine, config: ServerConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.engine = engine
        app.state.config = config
        app.state.started = time.time()
        if not engine.loaded.is_set():
            engine.start()
        try:
            yield
        finally:
            await run_in_threadpool(engine.shutdown)

    app = FastAPI(title="kvsnap", version=__version__, lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return _error(400, message, param, "invalid_value")

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return _error(exc.status, exc.message, exc.param, exc.code, exc.type)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), None, None, "invalid_request_error" if exc.status_code < 500 else "server_error")

    def check_model(name: str) -> None:
        if name not in (config.served_model_name, *config.model_aliases):
            raise APIError(404, f"model {name!r} is not served here; use {config.served_model_name!r} (see GET /v1/models)", "model", "model_not_found")

    def check_ready() -> None:
        if engine.failed is not None:
            raise APIError(503, f"the engine failed to start: {engine.failed}", None, "engine_failed", "server_error")

    def resolve_max_tokens(requested: Optional[int], prompt_len: int) -> int:
        ctx = config.context_length
        max_tokens = requested if requested is not None else config.default_max_tokens
        if ctx is not None:
            if prompt_len >= ctx:
                raise APIError(400, f"the prompt has {prompt_len} tokens but the model's context is {ctx}; shorten the messages", "messages", "context_length_exceeded")
            if requested is not None and prompt_len + requested > ctx:
                raise APIError(400, f"max_tokens {requested} + {prompt_len} prompt tokens exceed the model's context of {ctx}; ask for at most {ctx - prompt_len}", "max_tokens", "context_length_exceeded")
            max_tokens = min(max_tokens, ctx - prompt_len)
        return max_tokens

    async def run(req, tokens: list[int], rid: str, kind: str, request: Request):
        max_tokens = resolve_max_tokens(req.requested_max_tokens, len(tokens))
        bridge = _Bridge(asyncio.get_running_loop())
        gen = GenerationRequest(tokens=tokens, max_tokens=max_tokens, temperature=float(req.temperature), top_p=float(req.top_p), seed=req.seed, stop=tuple(req.stop_list))
        state = engine.submit(gen, bridge)
        if req.stream:
            return StreamingResponse(_stream(state, bridge, rid, kind, req, request), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            while True:
                event, payload = await bridge.queue.get()
                if event == "error":
                    raise APIError(500, f"generation failed: {payload}", None, "generation_failed", "server_error")
                if event == "done":
                    break
        except asyncio.CancelledError:
            engine.cancel(state)
            raise
        u = usage(state.prompt_tokens, state.completion_tokens, state.cached_tokens)
        finish = "length" if state.finish_reason == "length" else "stop"
        if kind == "chat":
            return chat_response(rid, config.served_model_name, state.text, finish, u)
        return completion_response(rid, config.served_model_name, state.text, finish, u)

    async def _stream(state: RequestState, bridge: _Bridge, rid: str, kind: str, req, request: Request) -> AsyncIterator[bytes]:
        model = config.served_model_name
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        finished = False

        def sse(obj: dict) -> bytes:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()

        try:
            if kind == "chat":
                yield sse(chat_chunk(rid, model, {"role": "assistant", "content": ""}))
            while True:
                event, payload = await bridge.queue.get()
                if event == "token":
                    yield sse(chat_chunk(rid, model, {"content": payload}) if kind == "chat" else completion_response(rid, model, payload, None, None))
                elif event == "error":
                    finished = True
                    yield sse(error_body(f"generation failed: {payload}", "server_error", None, "generation_failed"))
                    break
                else:
                    finished = True
                    finish = "length" if state.finish_reason == "length" else "stop"
                    u = usage(state.prompt_tokens, state.completion_tokens, state.cached_tokens)
                    if kind == "chat":
                        yield sse(chat_chunk(rid, model, {}, finish))
                    else:
                        yield sse(completion_response(rid, model, "", finish, None))
                    if include_usage:
                        last = chat_chunk(rid, model, {}, None, u) if kind == "chat" else completion_response(rid, model, "", None, u)
                        last["choices"] = []
                        yield sse(last)
                    break
            yield b"data: [DONE]\n\n"
        finally:
            if not finished:
                # The client went away mid-stream: free its batch slot now.
                engine.cancel(state)

    @app.get("/health")
    async def health():
        if engine.failed is not None:
            return JSONResponse({"status": "failed", "warm": False, "error": str(engine.failed)}, status_code=503)
        if not engine.warm.is_set():
            return JSONResponse({"status": "warming", "warm": False}, status_code=503)
        return {"status": "ok", "warm": True, "model": config.served_model_name}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.served_model_name, "object": "model", "created": int(app.state.started), "owned_by": "kvsnap"}]}

    @app.get("/v1/status")
    async def status():
        body = engine.status()
        body["version"] = __version__
        body["uptime_s"] = round(time.time() - app.state.started, 3)
        return body

    @app.delete("/v1/cache/prefix")
    async def clear_prefix():
        check_ready()
        cleared = engine.prefix.clear() if engine.prefix is not None else 0
        engine.clear_prefix_cache(rewarm=True)
        return {"status": "cleared", "rewarm_scheduled": True, "cleared_entries": cleared}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        check_model(req.model)
        check_ready()
        try:
            messages = normalize_messages(req.messages, "messages")
        except MessageError as exc:
            raise APIError(400, str(exc), exc.where, "invalid_value") from None
        try:
            tokens = await run_in_threadpool(request_tokens, engine.lm.tokenizer, messages, req.tools, req.chat_template_kwargs)
        except TemplateError as exc:
            raise APIError(400, str(exc), "messages", "invalid_value") from None
        if not tokens:
            raise APIError(400, "the messages render to an empty prompt", "messages", "invalid_value")
        return await run(req, tokens, new_id("chatcmpl"), "chat", request)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
        check_ready()
        if isinstance(req.prompt, str):
            if not req.prompt:
                raise APIError(400, "prompt is empty; give some text", "prompt", "invalid_value")
            tokens = await run_in_threadpool(encode_prompt, engine.lm.tokenizer, req.prompt)
        else:
            vocab = int(engine.lm.config.get("vocab_size") or 0)
            if not req.prompt or any(t < 0 or (vocab and t >= vocab) for t in req.prompt):
                raise APIError(400, f"prompt token ids must be a non-empty list of ids in [0, {vocab})", "prompt", "invalid_value")
            tokens = list(req.prompt)
        return await run(req, tokens, new_id("cmpl"), "completion", request)

    @app.exception_handler(KvsnapError)
    async def on_kvsnap_error(request: Request, exc: KvsnapError):
        return _error(400, str(exc), None, "invalid_value")

    return app
