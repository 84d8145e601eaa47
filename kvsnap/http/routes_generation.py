"""``POST /v1/chat/completions`` and ``POST /v1/completions``: a prompt becomes tokens, the
engine generates, the answer goes back whole or as server-sent events."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any, AsyncIterator, Callable, Optional, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from kvsnap.chat import encode_prompt, normalize_messages
from kvsnap.errors import MessageError
from kvsnap.http.api_errors import APIError
from kvsnap.http.chat_prompt import answer_splitter, chat_prompt_tokens
from kvsnap.http.context import ServerContext
from kvsnap.http.error_body import error_body
from kvsnap.http.handoff import LoopHandoff
from kvsnap.http.limits import check_template_kwargs, check_token_ids
from kvsnap.http.logprobs import chat_logprobs, completion_logprobs, text_length
from kvsnap.http.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_chunk,
    chat_response,
    completion_response,
    new_id,
)
from kvsnap.http.tool_calls import AnswerSplitter, check_tool_choice
from kvsnap.runtime.engine.engine import GenerationRequest, RequestState

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
ERROR_TYPE = re.compile(r"([A-Z][A-Za-z0-9_]{0,60}): ")  # "TypeName: text", as the engine reports

log = logging.getLogger("kvsnap.http.server")
T = TypeVar("T")


def failure_message(state: RequestState, detail: Any) -> str:
    """What a client hears of a failed generation: the error type only (an exception's text
    may hold paths or other requests' data, and goes to every request of the batch); the
    detail goes to the server log."""
    log.warning("[kvsnap] request %d failed: %s", state.id, detail)
    found = ERROR_TYPE.match(str(detail))
    kind = found.group(1) if found else "error"
    return f"generation failed ({kind}); the server log has the details"


class _Bridge:
    """Hands engine-thread events to one request's asyncio queue; ``on_end`` runs on the loop
    once the engine has finished the request, however it ended (even unread), and is given
    its state. Events go through the loop's ``LoopHandoff`` (one loop wake-up per engine
    step); ``get`` joins the tokens already queued into one (a reader that fell behind sends
    one chunk for them, not one each)."""

    def __init__(self, handoff: LoopHandoff, on_end: Callable[[RequestState], None]):
        self.handoff = handoff
        self.queue: asyncio.Queue = asyncio.Queue()
        self.on_end = on_end
        self.ended = False
        self._held: tuple[str, Any] | None = None  # an event read past the joined tokens

    def __call__(self, state: RequestState, kind: str, payload: Any) -> None:
        self.handoff.send(self.queue.put_nowait, (kind, payload))
        # An error may follow a finish: the slot is released and the request timed only once.
        if kind in ("done", "error") and not self.ended:
            self.ended = True
            self.handoff.send(self.on_end, state)

    async def get(self) -> tuple[str, Any]:
        """The next event; consecutive "token" events already queued come as one, their texts
        joined in order."""
        if self._held is not None:
            event, self._held = self._held, None
        else:
            event = await self.queue.get()
        if event[0] != "token" or self.queue.empty():
            return event
        texts = [event[1]]
        while not self.queue.empty():
            nxt = self.queue.get_nowait()
            if nxt[0] != "token":
                self._held = nxt
                break
            texts.append(nxt[1])
        return "token", "".join(texts)


def generation_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()
    engine = ctx.engine

    def chat_tokens(req: ChatCompletionRequest, tenant: str) -> list[int]:
        """Check, normalise, render and tokenize: a worker thread's job, never the loop's."""
        ctx.check_text(req, ("messages", "tools", "chat_template_kwargs", "stop"))
        check_tool_choice(req.tool_choice, req.tools)
        try:
            messages = normalize_messages(req.messages, "messages")
        except MessageError as exc:
            raise APIError(400, str(exc), exc.where, "invalid_value") from None
        allowed = ctx.model_limits()["template_kwargs"]
        kwargs = check_template_kwargs(req.chat_template_kwargs, allowed)
        tokens = chat_prompt_tokens(ctx, messages, req.tools, kwargs, req.tool_choice, "messages")
        if ctx.recorder is not None:
            ctx.recorder.record("chat", {"messages": req.messages, "tools": req.tools}, tenant)
        return tokens

    def completion_tokens(req: CompletionRequest) -> list[int]:
        ctx.check_text(req, ("prompt", "stop"))
        if isinstance(req.prompt, str):
            if not req.prompt:
                raise APIError(400, "prompt is empty; give some text", "prompt", "invalid_value")
            tokens = encode_prompt(engine.lm.tokenizer, req.prompt)
            if not tokens:  # e.g. only characters the tokenizer drops: nothing to run
                raise APIError(
                    400, "prompt encodes to no tokens; give some text", "prompt", "invalid_value"
                )
            return tokens
        if not req.prompt:
            raise APIError(
                400,
                "prompt is an empty list; give at least one token id",
                "prompt",
                "invalid_value",
            )
        return list(req.prompt)

    @router.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        ctx.check_model(req.model)
        ctx.check_ready()
        ctx.check_sizes(req)
        return await admitted(
            ctx,
            req,
            lambda: chat_tokens(req, ctx.caller(request)[0]),
            new_id("chatcmpl"),
            "chat",
            request,
            lambda tokens: answer_splitter(ctx, req.tools, req.tool_choice, tokens),
        )

    @router.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        ctx.check_model(req.model)
        ctx.check_ready()
        return await admitted(
            ctx, req, lambda: completion_tokens(req), new_id("cmpl"), "completion", request
        )

    return router


async def admitted(
    ctx: ServerContext,
    req: Any,
    tokens_of: Callable[[], list[int]],
    rid: str,
    kind: str,
    request: Request,
    split: Optional[Callable[[list[int]], AnswerSplitter]] = None,
):
    """A request holds an in-flight slot from before its prompt is prepared (so requests
    rejected after the work count toward 429 too), and prepares it in a worker thread, a
    bounded number at a time (``/health`` stays responsive)."""
    tokens = await prepared(ctx, tokens_of)
    return await generate(ctx, req, tokens, rid, kind, request, split(tokens) if split else None)


async def prepared(ctx: ServerContext, prepare: Callable[[], T]) -> T:
    """Take an in-flight slot and prepare the prompt in a worker thread; the slot is given
    back here if preparing fails, else by the engine's end of the request (``submit``)."""
    ctx.admit()
    try:
        async with ctx.preparing():
            return await run_in_threadpool(prepare)
    except BaseException:
        ctx.release()
        raise


async def generate(
    ctx: ServerContext,
    req: Any,
    tokens: list[int],
    rid: str,
    kind: str,
    request: Request,
    answer: Optional[AnswerSplitter] = None,
):
    """Check the token ids and the length, submit, and answer (streamed or whole); the
    caller holds an in-flight slot, which the engine's end of the request releases."""
    config = ctx.config
    where = "prompt" if kind == "completion" else "messages"
    state, bridge = await submit(ctx, req, tokens, request, where)
    if req.stream:
        return StreamingResponse(
            stream_events(ctx, state, bridge, rid, kind, req, answer),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    if not await wait_for_answer(ctx, state, bridge, request):
        return JSONResponse(
            error_body(
                "the client disconnected", "invalid_request_error", None, "client_disconnected"
            ),
            status_code=499,
        )
    u = ctx.reported_usage(state)
    finish = "length" if state.finish_reason == "length" else "stop"
    name = config.served_model_name
    lp = _logprobs(ctx, state, kind, list(state.logprobs))
    if kind == "chat":
        body = chat_response(rid, name, state.text, finish, u, lp)
        if answer is not None and answer.active:
            answer.feed(state.text)
            answer.finish()
            body["choices"][0]["message"].update(answer.message())
            body["choices"][0]["finish_reason"] = answer.finish_reason(state.finish_reason)
        return body
    return completion_response(rid, name, state.text, finish, u, logprobs=lp)


async def submit(
    ctx: ServerContext, req: Any, tokens: list[int], request: Request, where: str
) -> tuple[RequestState, _Bridge]:
    """Check the token ids and the length and hand the request to the engine. ``req`` has
    the sampling fields every generation API shares (``requested_max_tokens``,
    ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``wanted_top_logprobs``, ``seed``,
    ``stop_list``, ``cache_salt``); ``where`` names the prompt's field in errors."""
    config = ctx.config
    bridge = _Bridge(ctx.handoffs.current(), ctx.release)
    try:
        check_token_ids(tokens, ctx.model_limits()["vocab"], where)
        cap = getattr(req, "max_tokens_is_a_cap", False)
        max_tokens = ctx.resolve_max_tokens(req.requested_max_tokens, len(tokens), cap)
        tenant, _ = ctx.caller(request)
        namespace = f"{tenant}/{req.cache_salt or ''}" if (tenant or req.cache_salt) else ""
        default = config.sampling
        gen = GenerationRequest(
            tokens=tokens,
            max_tokens=max_tokens,
            temperature=float(_given(req.temperature, default.temperature)),
            top_p=float(_given(req.top_p, default.top_p)),
            top_k=max(0, _given(req.top_k, default.top_k)),
            min_p=float(_given(req.min_p, default.min_p)),
            top_logprobs=req.wanted_top_logprobs,
            seed=req.seed,
            stop=tuple(req.stop_list),
            namespace=namespace,
            tenant=tenant,
            capture=config.request_prefix_cache,
        )
        # --shared-tier: another replica's turn of this conversation
        if gen.capture and ctx.engine.asks_shared_tier():
            await run_in_threadpool(ctx.engine.fetch_shared, tokens, namespace)
        state = ctx.engine.submit(gen, bridge)
    except BaseException:
        ctx.release()  # not submitted: the engine will not end it, so release the slot here
        raise
    return state, bridge


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value


def _logprobs(
    ctx: ServerContext, state: RequestState, kind: str, entries: list, offset: int = 0
) -> dict | None:
    """The answer's ``logprobs`` for ``entries`` (None when the request asked for none)."""
    if state.request.top_logprobs is None:
        return None
    token_bytes = ctx.token_bytes()
    if kind == "chat":
        return chat_logprobs(entries, token_bytes)
    return completion_logprobs(entries, token_bytes, offset)


async def wait_for_answer(
    ctx: ServerContext, state: RequestState, bridge: _Bridge, request: Request
) -> bool:
    """Wait until the engine finishes ``state``; False if the client left first (the request
    is then cancelled: nobody will read its answer)."""
    finished = False
    loop = asyncio.get_running_loop()
    next_check = loop.time() + DISCONNECT_POLL_S
    try:
        while True:
            if not bridge.queue.empty():  # no timer per token: only an empty queue waits
                event, payload = bridge.queue.get_nowait()
            else:
                try:
                    event, payload = await asyncio.wait_for(bridge.queue.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    event = None
            # tokens may arrive faster than the poll: check by the clock
            if loop.time() >= next_check:
                next_check = loop.time() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    break
            if event is None or event == "token":
                continue
            if event == "error":
                finished = True
                raise APIError(
                    500, failure_message(state, payload), None, "generation_failed", "server_error"
                )
            if event == "done":
                finished = True
                break
    finally:
        if not finished:
            ctx.engine.cancel(state)
    return finished


async def stream_events(
    ctx: ServerContext,
    state: RequestState,
    bridge: _Bridge,
    rid: str,
    kind: str,
    req: Any,
    answer: Optional[AnswerSplitter] = None,
) -> AsyncIterator[bytes]:
    model = ctx.config.served_model_name
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    finished = False
    sent = 0  # log-probability entries sent so far
    offset = 0  # the completions' text_offset of the next entry

    def new_logprobs() -> dict | None:
        """The entries the engine kept since the last chunk (it keeps a token's entry before
        its text goes out)."""
        nonlocal sent, offset
        entries = state.logprobs[sent:]
        sent += len(entries)
        lp = _logprobs(ctx, state, kind, entries, offset)
        if lp is not None and kind == "completion":
            offset += text_length(entries, ctx.token_bytes())
        return lp

    def sse(obj: dict) -> bytes:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()

    try:
        if kind == "chat":
            yield sse(chat_chunk(rid, model, {"role": "assistant", "content": ""}))
        while True:
            event, payload = await bridge.get()
            if event == "token" and answer is not None and answer.active:
                # text inside markers is never sent; a chunk per delta field, in order
                for i, delta in enumerate(answer.feed(payload)):
                    lp = new_logprobs() if i == 0 else None
                    yield sse(chat_chunk(rid, model, delta, logprobs=lp))
            elif event == "token":
                lp = new_logprobs()
                yield sse(
                    chat_chunk(rid, model, {"content": payload}, logprobs=lp)
                    if kind == "chat"
                    else completion_response(rid, model, payload, None, None, logprobs=lp)
                )
            elif event == "error":
                finished = True
                yield sse(
                    error_body(
                        failure_message(state, payload), "server_error", None, "generation_failed"
                    )
                )
                break
            else:
                finished = True
                finish = "length" if state.finish_reason == "length" else "stop"
                if answer is not None and answer.active:
                    for delta in answer.finish():
                        yield sse(chat_chunk(rid, model, delta))
                    finish = answer.finish_reason(state.finish_reason)
                u = ctx.reported_usage(state)
                lp = new_logprobs()
                if kind == "chat":
                    yield sse(chat_chunk(rid, model, {}, finish, logprobs=lp))
                else:
                    yield sse(completion_response(rid, model, "", finish, None, logprobs=lp))
                if include_usage:
                    last = (
                        chat_chunk(rid, model, {}, None, u)
                        if kind == "chat"
                        else completion_response(rid, model, "", None, u)
                    )
                    last["choices"] = []
                    yield sse(last)
                break
        yield b"data: [DONE]\n\n"
    finally:
        if not finished:
            # The client went away mid-stream: free its batch slot now.
            ctx.engine.cancel(state)
