"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API, as
Claude Code speaks it. The body becomes kvsnap's chat in ``agent_requests`` (the same
conversion warm-prompt entries use), renders and generates as chat does, and the answer goes
back as Anthropic's content blocks: text, thinking and ``tool_use`` (through the same
splitter as chat's ``tool_calls``), whole or as Anthropic's server-sent events."""

from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator, ClassVar, Optional, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from kvsnap.agent_requests import AgentChat, anthropic_chat, arguments_object
from kvsnap.http.api_errors import APIError
from kvsnap.http.chat_prompt import agent_chat, answer_splitter, chat_prompt_tokens
from kvsnap.http.context import ServerContext
from kvsnap.http.routes_generation import (
    failure_message,
    prepared,
    submit,
    wait_for_answer,
)
from kvsnap.http.schemas import MAX_STOP_LENGTH, MAX_STOP_SEQUENCES, MAX_TOKENS_LIMIT, new_id
from kvsnap.http.tool_calls import AnswerSplitter
from kvsnap.runtime.engine.engine import RequestState

ANTHROPIC_PATH = "/v1/messages"
BODY_FIELDS = ("system", "messages", "tools", "tool_choice", "thinking")

log = logging.getLogger("kvsnap.http.server")


class MessagesRequest(BaseModel):
    """The fields kvsnap acts on; the rest (``metadata``, ``context_management``,
    ``output_config``, ``service_tier``, …) are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[StrictStr] = None
    max_tokens: StrictInt = Field(ge=1, le=MAX_TOKENS_LIMIT)
    messages: list[Any]
    system: Optional[Union[StrictStr, list[Any]]] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[dict] = None
    thinking: Optional[dict] = None
    stop_sequences: Optional[list[StrictStr]] = Field(default=None, max_length=MAX_STOP_SEQUENCES)
    temperature: Optional[Union[StrictFloat, StrictInt]] = Field(default=None, ge=0, le=1)
    top_p: Optional[Union[StrictFloat, StrictInt]] = Field(default=None, gt=0, le=1)
    top_k: Optional[StrictInt] = Field(default=None, ge=0, le=MAX_TOKENS_LIMIT)
    stream: StrictBool = False
    # vLLM's name: scopes cached prefixes within a key
    cache_salt: Optional[StrictStr] = Field(default=None, min_length=1, max_length=256)

    # the sampling fields every generation API shares (routes_generation.submit)
    min_p: ClassVar[None] = None
    seed: ClassVar[None] = None
    wanted_top_logprobs: ClassVar[None] = None
    # an agent asks for its largest answer (Claude Code: 32,000): a cap, cut to the context
    max_tokens_is_a_cap: ClassVar[bool] = True

    @property
    def requested_max_tokens(self) -> int:
        return self.max_tokens

    @property
    def stop_list(self) -> list[str]:
        stops = self.stop_sequences or []
        if any(len(s) > MAX_STOP_LENGTH for s in stops):
            raise APIError(
                400,
                f"stop_sequences: a stop sequence may be at most {MAX_STOP_LENGTH} characters",
                "stop_sequences",
                "invalid_value",
            )
        return [s for s in stops if s]


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[StrictStr] = None
    messages: list[Any]
    system: Optional[Union[StrictStr, list[Any]]] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[dict] = None
    thinking: Optional[dict] = None


def anthropic_error_type(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status."""
    return {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "request_too_large",
        429: "rate_limit_error",
        503: "overloaded_error",
        529: "overloaded_error",
    }.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": anthropic_error_type(status), "message": message}}


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def _usage(ctx: ServerContext, state: RequestState) -> dict:
    """Anthropic's counts: ``input_tokens`` leaves out the reused prefix, which is
    ``cache_read_input_tokens`` (rounded as chat's ``cached_tokens``); kvsnap charges nothing
    for writing the cache, so ``cache_creation_input_tokens`` is 0 and the three add up to
    the prompt."""
    u = ctx.reported_usage(state)
    cached = u["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": u["prompt_tokens"] - cached,
        "output_tokens": u["completion_tokens"],
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _stop_reason(state: RequestState, answer: AnswerSplitter) -> tuple[str, Optional[str]]:
    if state.finish_reason == "length":
        return "max_tokens", None
    if state.stop_sequence is not None:
        return "stop_sequence", state.stop_sequence
    if answer.active and answer.finish_reason(state.finish_reason) == "tool_calls":
        return "tool_use", None
    return "end_turn", None


def _tool_use(call: dict) -> dict:
    call_id = call["id"]
    return {
        "type": "tool_use",
        "id": "toolu_" + call_id.removeprefix("call_"),
        "name": call["function"]["name"],
        "input": arguments_object(call["function"]["arguments"]),
    }


def _message(rid: str, model: str, content: list, usage: dict, stop=(None, None)) -> dict:
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": usage,
    }


def _whole_content(state: RequestState, answer: AnswerSplitter) -> list[dict]:
    if not answer.active:
        return [{"type": "text", "text": state.text}] if state.text else []
    answer.feed(state.text)
    answer.finish()
    content: list[dict] = []
    if answer.reasoning:
        content.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
    text = answer.content.strip() if answer.tool_calls else answer.content
    if text:
        content.append({"type": "text", "text": text})
    content += [_tool_use(call) for call in answer.tool_calls]
    return content


class _BlockStream:
    """Answer deltas as Anthropic's content-block events: a block opens when the kind of
    text changes (text, thinking) and each tool call is one ``tool_use`` block."""

    def __init__(self) -> None:
        self.index = -1
        self.open: Optional[str] = None

    def _close(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _start(self, block: dict) -> list[tuple[str, dict]]:
        events = self._close()
        self.index += 1
        self.open = block["type"]
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        return events + [("content_block_start", start)]

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return (
            "content_block_delta",
            {"type": "content_block_delta", "index": self.index, "delta": delta},
        )

    def feed(self, delta: dict) -> list[tuple[str, dict]]:
        events: list[tuple[str, dict]] = []
        if delta.get("content"):
            if self.open != "text":
                events += self._start({"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        if delta.get("reasoning_content"):
            if self.open != "thinking":
                events += self._start({"type": "thinking", "thinking": "", "signature": ""})
            events.append(
                self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]})
            )
        for call in delta.get("tool_calls") or ():
            block = _tool_use(call)
            arguments = json.dumps(block["input"], ensure_ascii=False)
            events += self._start({**block, "input": {}})
            events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
            events += self._close()
        return events

    def finish(self) -> list[tuple[str, dict]]:
        return self._close()


def _sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


async def _stream(
    ctx: ServerContext, state: RequestState, bridge: Any, rid: str, answer: AnswerSplitter
) -> AsyncIterator[bytes]:
    model = ctx.config.served_model_name
    blocks = _BlockStream()
    started = False
    finished = False

    def start() -> list[bytes]:
        # after the engine's first event: the reused prefix is known by then
        usage = {**_usage(ctx, state), "output_tokens": 0}
        message = _message(rid, model, [], usage)
        return [
            _sse("message_start", {"type": "message_start", "message": message}),
            _sse("ping", {"type": "ping"}),
        ]

    try:
        while True:
            event, payload = await bridge.get()
            if not started:
                started = True
                for chunk in start():
                    yield chunk
            if event == "token":
                deltas = answer.feed(payload) if answer.active else [{"content": payload}]
                for delta in deltas:
                    for name, data in blocks.feed(delta):
                        yield _sse(name, data)
            elif event == "error":
                finished = True
                message = failure_message(state, payload)
                yield _sse("error", anthropic_error_body(500, message))
                break
            else:
                finished = True
                for delta in answer.finish() if answer.active else ():
                    for name, data in blocks.feed(delta):
                        yield _sse(name, data)
                for name, data in blocks.finish():
                    yield _sse(name, data)
                reason, sequence = _stop_reason(state, answer)
                delta = {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": _usage(ctx, state),
                }
                yield _sse("message_delta", delta)
                yield _sse("message_stop", {"type": "message_stop"})
                break
    finally:
        if not finished:
            ctx.engine.cancel(state)  # the client went away: free its batch slot now


def messages_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()

    def converted(req: Any) -> AgentChat:
        return agent_chat(ctx, req, anthropic_chat, BODY_FIELDS, ANTHROPIC_PATH)

    def tokens_of(chat: AgentChat) -> list[int]:
        return chat_prompt_tokens(
            ctx, chat.messages, chat.tools, chat.template_kwargs, chat.tool_choice, "messages"
        )

    @router.post(ANTHROPIC_PATH)
    async def messages(req: MessagesRequest, request: Request):
        ctx.check_model(req.model)
        ctx.check_ready()
        ctx.check_sizes(req)
        ctx.check_text(req, ("stop_sequences",))

        def prepare() -> tuple[AgentChat, list[int]]:
            chat = converted(req)
            tokens = tokens_of(chat)
            if ctx.recorder is not None:
                body = req.model_dump(include={"system", "tools", "thinking"})
                ctx.recorder.record("anthropic", body, ctx.caller(request)[0])
            return chat, tokens

        chat, tokens = await prepared(ctx, prepare)
        answer = answer_splitter(ctx, chat.tools, chat.tool_choice, tokens)
        state, bridge = await submit(ctx, req, tokens, request, "messages")
        rid = new_id("msg").replace("-", "_")
        if req.stream:
            return StreamingResponse(
                _stream(ctx, state, bridge, rid, answer),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        if not await wait_for_answer(ctx, state, bridge, request):
            return JSONResponse(anthropic_error_body(499, "the client disconnected"), 499)
        content = _whole_content(state, answer)
        model = ctx.config.served_model_name
        return _message(rid, model, content, _usage(ctx, state), _stop_reason(state, answer))

    @router.post(ANTHROPIC_PATH + "/count_tokens")
    async def count_tokens(req: CountTokensRequest, request: Request):
        ctx.check_model(req.model)
        ctx.check_ready()
        ctx.check_sizes(req)
        tokens = await prepared(ctx, lambda: tokens_of(converted(req)))
        ctx.release()  # nothing is generated: the slot was held only while rendering
        return {"input_tokens": len(tokens)}

    return router


class AnthropicErrorShape:
    """Every error on the Messages paths in Anthropic's shape, whoever raised it (the key
    guard, the body cap, validation, the routes): a pure ASGI middleware that rewrites an
    OpenAI-shaped JSON error body on its way out. Streams and other paths pass untouched."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not is_anthropic_path(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        start: dict = {}
        body = bytearray()

        async def shaped(message):
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start.update(message)
                return
            if start and message["type"] == "http.response.body":
                body.extend(message.get("body", b""))
                if message.get("more_body"):
                    return
                await _send_shaped(send, start, bytes(body))
                return
            await send(message)

        await self.app(scope, receive, shaped)


async def _send_shaped(send, start: dict, body: bytes) -> None:
    status = start["status"]
    try:
        found = json.loads(body)
        message = found["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace")[:500] or f"HTTP {status}"
    new = json.dumps(anthropic_error_body(status, str(message)), ensure_ascii=False).encode()
    headers = [
        (k, v)
        for k, v in start.get("headers", [])
        if k.lower() not in (b"content-length", b"content-type")
    ]
    headers += [(b"content-type", b"application/json"), (b"content-length", str(len(new)).encode())]
    await send({**start, "headers": headers})
    await send({"type": "http.response.body", "body": new})
