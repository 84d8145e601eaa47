"""The OpenAI-compatible HTTP server: ``create_app(engine)``; state lives in the app, not in globals."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvsnap import __version__
from kvsnap.runtime.engine import Engine, GenerationRequest, RequestState
from kvsnap.errors import KvsnapError, MessageError, TemplateError
from kvsnap.http.guard import Auth, GuardMiddleware
from kvsnap.prompts import encode_prompt, normalize_messages, request_tokens
from kvsnap.http.limits import RequestRejected, allowed_template_kwargs, check_template_kwargs, check_token_ids, context_length, find_lone_surrogate, vocab_bound
from kvsnap.http.schemas import ChatCompletionRequest, CompletionRequest, chat_chunk, chat_response, completion_response, error_body, new_id, usage

log = logging.getLogger("kvsnap.http.server")


DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there


@dataclass
class ServerConfig:
    served_model_name: str
    model_aliases: tuple[str, ...] = ()
    default_max_tokens: int = 256
    context_length: Optional[int] = None
    auth: Auth = Auth()
    max_request_bytes: int = 8 * 2**20
    max_inflight: int = 72  # running + queued requests; more get 429
    request_prefix_cache: bool = True
    # Partial matches on a prefix shared with other clients report cached tokens in these
    # steps, as OpenAI does (128): exact counts would spell out others' prompts token by token.
    cached_tokens_granularity: int = 128


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None, type_: str = "invalid_request_error", headers: Optional[dict] = None):
        self.status, self.message, self.param, self.code, self.type, self.headers = status, message, param, code, type_, headers
        super().__init__(message)


def _error(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None, type_: str = "invalid_request_error", headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


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
    """Hands engine-thread events to one request's asyncio queue; ``on_end`` runs on the loop
    once the engine has finished the request, however it ended (even unread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_end: Callable[[], None]):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.on_end = on_end

    def __call__(self, state: RequestState, kind: str, payload: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))
        if kind in ("done", "error"):
            self.loop.call_soon_threadsafe(self.on_end)


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

    # With keys, the schema pages are off: they would be the one unauthenticated surface left.
    docs = {} if not config.auth.enabled else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="kvsnap", version=__version__, lifespan=lifespan, **docs)
    app.add_middleware(GuardMiddleware, auth=config.auth, max_body_bytes=config.max_request_bytes)
    limits: dict = {}  # filled on first use: the model is loaded by then
    inflight = [0]  # requests submitted and not yet finished by the engine

    def release() -> None:
        inflight[0] -= 1

    def model_limits() -> dict:
        if not limits:
            limits["vocab"] = vocab_bound(engine.lm.model, engine.lm.config)
            limits["template_kwargs"] = allowed_template_kwargs(getattr(engine.lm.tokenizer, "chat_template", None))
            limits["context"] = config.context_length or context_length(engine.lm.config)
        return limits

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return _error(400, message, param, "invalid_value")

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return _error(exc.status, exc.message, exc.param, exc.code, exc.type, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        return _error(exc.status_code, str(exc.detail), None, codes.get(exc.status_code), "invalid_request_error" if exc.status_code < 500 else "server_error")

    @app.exception_handler(RequestRejected)
    async def on_rejected(request: Request, exc: RequestRejected):
        return _error(400, str(exc), exc.param, "invalid_value")

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        # Never a plain-text 500; the details go to the log, not to the client.
        log.exception("[kvsnap] unexpected error on %s %s", request.method, request.url.path)
        return _error(500, f"internal error ({type(exc).__name__}); the server log has the details", None, "internal_error", "server_error")

    def caller(request: Request) -> tuple[str, bool]:
        """(tenant, admin): admin = no keys configured, or an admin key."""
        return getattr(request.state, "tenant", ""), getattr(request.state, "admin", True)

    def require_admin(request: Request) -> None:
        # Without admin keys configured, every valid key may clear the cache (one trust level).
        if config.auth.admin_keys and not caller(request)[1]:
            raise APIError(403, "this needs an admin key (--admin-api-key / KVSNAP_ADMIN_API_KEY)", None, "insufficient_permissions")

    def check_text(req, fields: tuple[str, ...]) -> None:
        for name in fields:
            where = find_lone_surrogate(getattr(req, name, None), name)
            if where is not None:
                raise APIError(400, f"{where}: the text holds a lone surrogate code point, which is not valid Unicode; send UTF-8 text", where, "invalid_value")

    def check_model(name: str) -> None:
        if name not in (config.served_model_name, *config.model_aliases):
            raise APIError(404, f"model {name!r} is not served here; use {config.served_model_name!r} (see GET /v1/models)", "model", "model_not_found")

    def check_ready() -> None:
        if engine.failed is not None:
            raise APIError(503, f"the engine failed to start: {engine.failed}", None, "engine_failed", "server_error")

    def resolve_max_tokens(requested: Optional[int], prompt_len: int) -> int:
        ctx = model_limits()["context"]
        max_tokens = requested if requested is not None else config.default_max_tokens
        if ctx is not None:
            if prompt_len >= ctx:
                raise APIError(400, f"the prompt has {prompt_len} tokens but the model's context is {ctx}; shorten the messages", "messages", "context_length_exceeded")
            if requested is not None and prompt_len + requested > ctx:
                raise APIError(400, f"max_tokens {requested} + {prompt_len} prompt tokens exceed the model's context of {ctx}; ask for at most {ctx - prompt_len}", "max_tokens", "context_length_exceeded")
            max_tokens = min(max_tokens, ctx - prompt_len)
        return max_tokens

    def reported_usage(state: RequestState) -> dict:
        cached = state.cached_tokens
        if state.cache_shared_partial and config.cached_tokens_granularity > 1:
            cached -= cached % config.cached_tokens_granularity
        return usage(state.prompt_tokens, state.completion_tokens, cached)

    async def run(req, tokens: list[int], rid: str, kind: str, request: Request):
        check_token_ids(tokens, model_limits()["vocab"], "prompt" if kind == "completion" else "messages")
        max_tokens = resolve_max_tokens(req.requested_max_tokens, len(tokens))
        if inflight[0] >= config.max_inflight:
            raise APIError(429, f"the server has {inflight[0]} requests running or queued (--max-queued-requests); retry shortly", None, "rate_limit_exceeded", "rate_limit_error", {"Retry-After": "1"})
        tenant, _ = caller(request)
        namespace = f"{tenant}/{req.cache_salt or ''}" if (tenant or req.cache_salt) else ""
        bridge = _Bridge(asyncio.get_running_loop(), release)
        gen = GenerationRequest(tokens=tokens, max_tokens=max_tokens, temperature=float(req.temperature), top_p=float(req.top_p), seed=req.seed, stop=tuple(req.stop_list), namespace=namespace, tenant=tenant, capture=config.request_prefix_cache)
        inflight[0] += 1
        state = engine.submit(gen, bridge)
        if req.stream:
            return StreamingResponse(_stream(state, bridge, rid, kind, req, request), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        finished = False
        loop = asyncio.get_running_loop()
        next_check = loop.time() + DISCONNECT_POLL_S
        try:
            while True:
                try:
                    event, payload = await asyncio.wait_for(bridge.queue.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    event = None
                if loop.time() >= next_check:  # tokens may arrive faster than the poll: check by the clock
                    next_check = loop.time() + DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        break  # nobody will read the answer: stop generating it
                if event is None or event == "token":
                    continue
                if event == "error":
                    finished = True
                    raise APIError(500, f"generation failed: {payload}", None, "generation_failed", "server_error")
                if event == "done":
                    finished = True
                    break
        finally:
            if not finished:
                engine.cancel(state)
        if not finished:
            return JSONResponse(error_body("the client disconnected", "invalid_request_error", None, "client_disconnected"), status_code=499)
        u = reported_usage(state)
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
                    u = reported_usage(state)
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
    async def status(request: Request):
        tenant, admin = caller(request)
        # A thread, not the event loop: the engine's locks are never held for file I/O, but
        # /health must not depend on that.
        body = await run_in_threadpool(engine.status, None if admin else tenant)
        if not admin:
            # An ordinary key sees cache-wide counters and its own requests; no paths, no warm-up details.
            body = {k: body[k] for k in ("warm", "batch_size", "waiting", "requests", "cache", "requests_started", "rewarm_in_progress")}
        body["version"] = __version__
        body["uptime_s"] = round(time.time() - app.state.started, 3)
        return body

    @app.delete("/v1/cache/prefix")
    async def clear_prefix(request: Request):
        require_admin(request)
        check_ready()
        cleared = len(engine.prefix) if engine.prefix is not None else 0
        engine.clear_prefix_cache(rewarm=True)  # coalesced into a re-warm already running
        return {"status": "cleared", "rewarm_scheduled": True, "cleared_entries": cleared}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        check_model(req.model)
        check_ready()
        check_text(req, ("messages", "tools", "chat_template_kwargs", "stop"))
        try:
            messages = normalize_messages(req.messages, "messages")
        except MessageError as exc:
            raise APIError(400, str(exc), exc.where, "invalid_value") from None
        kwargs = check_template_kwargs(req.chat_template_kwargs, model_limits()["template_kwargs"])
        try:
            tokens = await run_in_threadpool(request_tokens, engine.lm.tokenizer, messages, req.tools, kwargs)
        except TemplateError as exc:
            raise APIError(400, str(exc), "messages", "invalid_value") from None
        if not tokens:
            raise APIError(400, "the messages render to an empty prompt", "messages", "invalid_value")
        return await run(req, tokens, new_id("chatcmpl"), "chat", request)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
        check_ready()
        check_text(req, ("prompt", "stop"))
        if isinstance(req.prompt, str):
            if not req.prompt:
                raise APIError(400, "prompt is empty; give some text", "prompt", "invalid_value")
            tokens = await run_in_threadpool(encode_prompt, engine.lm.tokenizer, req.prompt)
        else:
            if not req.prompt:
                raise APIError(400, "prompt is an empty list; give at least one token id", "prompt", "invalid_value")
            tokens = list(req.prompt)
        return await run(req, tokens, new_id("cmpl"), "completion", request)

    @app.exception_handler(KvsnapError)
    async def on_kvsnap_error(request: Request, exc: KvsnapError):
        return _error(400, str(exc), None, "invalid_value")

    return app
