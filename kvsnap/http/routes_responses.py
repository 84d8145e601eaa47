"""``POST /v1/responses``: OpenAI's Responses API, stateless, as Codex CLI speaks it. The body
becomes kvsnap's chat in ``agent_requests`` (the same conversion warm-prompt entries use),
renders and generates as chat does, and the answer goes back as Responses output items
(``reasoning``, ``message``, ``function_call`` through the same splitter as chat's
``tool_calls``), whole or as the Responses event stream.

Nothing is stored: ``store`` is accepted and answered ``false``; a ``previous_response_id``
is refused with a 400 that says to send the whole conversation (Codex does, with
``store: false``)."""

from __future__ import annotations

import json
import logging
import time
from typing import Any, AsyncIterator, ClassVar, Optional, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from kvsnap.agent_requests import AgentChat, responses_chat
from kvsnap.http.api_errors import APIError
from kvsnap.http.chat_prompt import agent_chat, answer_splitter, chat_prompt_tokens
from kvsnap.http.context import ServerContext
from kvsnap.http.error_body import error_body
from kvsnap.http.routes_generation import failure_message, prepared, submit, wait_for_answer
from kvsnap.http.schemas import MAX_TOKENS_LIMIT, new_id
from kvsnap.http.tool_calls import AnswerSplitter
from kvsnap.runtime.engine.engine import RequestState

RESPONSES_PATH = "/v1/responses"
BODY_FIELDS = ("input", "instructions", "tools", "tool_choice", "reasoning")

log = logging.getLogger("kvsnap.http.server")


class ResponsesRequest(BaseModel):
    """The fields kvsnap acts on; the rest (``include``, ``metadata``, ``text``,
    ``truncation``, ``user``, …) are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[StrictStr] = None
    input: Union[StrictStr, list[Any]]
    instructions: Optional[StrictStr] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Union[StrictStr, dict]] = None
    parallel_tool_calls: Optional[StrictBool] = None
    max_output_tokens: Optional[StrictInt] = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: Optional[Union[StrictFloat, StrictInt]] = Field(default=None, ge=0, le=2)
    top_p: Optional[Union[StrictFloat, StrictInt]] = Field(default=None, gt=0, le=1)
    stream: StrictBool = False
    reasoning: Optional[dict] = None
    store: Optional[StrictBool] = None
    previous_response_id: Optional[StrictStr] = None
    # Codex's session id; accepted, never widens what a request may reuse (the key's scope)
    prompt_cache_key: Optional[StrictStr] = Field(default=None, max_length=1024)
    # vLLM's name: scopes cached prefixes within a key
    cache_salt: Optional[StrictStr] = Field(default=None, min_length=1, max_length=256)

    # the sampling fields every generation API shares (routes_generation.submit)
    top_k: ClassVar[None] = None
    min_p: ClassVar[None] = None
    seed: ClassVar[None] = None
    wanted_top_logprobs: ClassVar[None] = None
    stop_list: ClassVar[tuple] = ()
    # an agent asks for its largest answer: a cap, cut to the context
    max_tokens_is_a_cap: ClassVar[bool] = True

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_output_tokens

    @property
    def messages(self) -> list:
        """For the server's count limit (``ServerContext.check_sizes``)."""
        return self.input if isinstance(self.input, list) else [self.input]


def _item_id(prefix: str) -> str:
    return new_id(prefix).replace("-", "_")


def _usage(ctx: ServerContext, state: RequestState) -> dict:
    u = ctx.reported_usage(state)
    return {
        "input_tokens": u["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": u["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u["total_tokens"],
    }


def _response(
    rid: str,
    ctx: ServerContext,
    req: ResponsesRequest,
    output: list,
    status: str,
    usage: Optional[dict] = None,
    error: Optional[dict] = None,
) -> dict:
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": ctx.config.served_model_name,
        "output": output,
        "usage": usage,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": None,
        "reasoning": req.reasoning,
        "store": False,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "text": {"format": {"type": "text"}},
        "tool_choice": req.tool_choice or "auto",
        "tools": [],  # not echoed: an agent's tools run to tens of kilobytes per event
        "truncation": "disabled",
        "metadata": {},
    }


def _status(state: RequestState) -> str:
    return "incomplete" if state.finish_reason == "length" else "completed"


def _message_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": content if status == "completed" else [],
    }


def _reasoning_item(item_id: str, text: str) -> dict:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}] if text else [],
    }


def _call_item(call: dict, chat: AgentChat, status: str = "completed") -> dict:
    name = call["function"]["name"]
    item = {
        "id": "fc_" + call["id"].removeprefix("call_"),
        "type": "function_call",
        "status": status,
        "call_id": call["id"],
        "name": name,
        "arguments": call["function"]["arguments"] if status == "completed" else "",
    }
    if name in chat.namespaces:
        item["namespace"] = chat.namespaces[name]
    return item


def _whole_output(state: RequestState, answer: AnswerSplitter, chat: AgentChat) -> list[dict]:
    if not answer.active:
        return [_message_item(_item_id("msg"), state.text)] if state.text else []
    answer.feed(state.text)
    answer.finish()
    output: list[dict] = []
    if answer.reasoning:
        output.append(_reasoning_item(_item_id("rs"), answer.reasoning))
    text = answer.content.strip() if answer.tool_calls else answer.content
    if text:
        output.append(_message_item(_item_id("msg"), text))
    output += [_call_item(call, chat) for call in answer.tool_calls]
    return output


class _ItemStream:
    """Answer deltas as Responses events: an output item opens when the kind of text
    changes (message text, reasoning) and each function call is one item."""

    def __init__(self, chat: AgentChat) -> None:
        self.chat = chat
        self.output: list[dict] = []  # finished items, for response.completed
        self.open: Optional[dict] = None
        self.text = ""
        self.seq = 0

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()

    @property
    def index(self) -> int:
        return len(self.output)

    def _close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": self.index}
        if item["type"] == "message":
            done = _message_item(item["id"], self.text)
            part = done["content"][0]
            events = [
                self.event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=self.text,
                    logprobs=[],
                ),
                self.event("response.content_part.done", **where, content_index=0, part=part),
            ]
        else:
            done = _reasoning_item(item["id"], self.text)
            events = [
                self.event("response.reasoning_text.done", **where, content_index=0, text=self.text)
            ]
        events.append(self.event("response.output_item.done", output_index=self.index, item=done))
        self.output.append(done)
        self.text = ""
        return events

    def _open(self, item: dict) -> list[bytes]:
        events = self._close()
        self.open = item
        events.append(self.event("response.output_item.added", output_index=self.index, item=item))
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(
                self.event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=self.index,
                    content_index=0,
                    part=part,
                )
            )
        return events

    def feed(self, delta: dict) -> list[bytes]:
        events: list[bytes] = []
        for kind, key in (("message", "content"), ("reasoning", "reasoning_content")):
            text = delta.get(key)
            if not text:
                continue
            if self.open is None or self.open["type"] != kind:
                item = (
                    _message_item(_item_id("msg"), "", "in_progress")
                    if kind == "message"
                    else _reasoning_item(_item_id("rs"), "")
                )
                events += self._open(item)
            self.text += text
            assert self.open is not None
            name = (
                "response.output_text.delta"
                if kind == "message"
                else "response.reasoning_text.delta"
            )
            extra: dict = {"logprobs": []} if kind == "message" else {}
            events.append(
                self.event(
                    name,
                    item_id=self.open["id"],
                    output_index=self.index,
                    content_index=0,
                    delta=text,
                    **extra,
                )
            )
        for call in delta.get("tool_calls") or ():
            events += self._close()
            added = _call_item(call, self.chat, "in_progress")
            done = _call_item(call, self.chat)
            where = {"item_id": done["id"], "output_index": self.index}
            events += [
                self.event("response.output_item.added", output_index=self.index, item=added),
                self.event(
                    "response.function_call_arguments.delta", **where, delta=done["arguments"]
                ),
                self.event(
                    "response.function_call_arguments.done",
                    **where,
                    name=done["name"],
                    arguments=done["arguments"],
                ),
                self.event("response.output_item.done", output_index=self.index, item=done),
            ]
            self.output.append(done)
        return events

    def finish(self) -> list[bytes]:
        return self._close()


async def _stream(
    ctx: ServerContext,
    req: ResponsesRequest,
    chat: AgentChat,
    state: RequestState,
    bridge: Any,
    rid: str,
    answer: AnswerSplitter,
) -> AsyncIterator[bytes]:
    items = _ItemStream(chat)
    finished = False
    try:
        opening = _response(rid, ctx, req, [], "in_progress")
        yield items.event("response.created", response=opening)
        yield items.event("response.in_progress", response=opening)
        while True:
            event, payload = await bridge.get()
            if event == "token":
                deltas = answer.feed(payload) if answer.active else [{"content": payload}]
                for delta in deltas:
                    for chunk in items.feed(delta):
                        yield chunk
            elif event == "error":
                finished = True
                error = {"code": "server_error", "message": failure_message(state, payload)}
                failed = _response(rid, ctx, req, items.output, "failed", error=error)
                yield items.event("response.failed", response=failed)
                break
            else:
                finished = True
                for delta in answer.finish() if answer.active else ():
                    for chunk in items.feed(delta):
                        yield chunk
                for chunk in items.finish():
                    yield chunk
                status = _status(state)
                done = _response(rid, ctx, req, items.output, status, _usage(ctx, state))
                name = "response.completed" if status == "completed" else "response.incomplete"
                yield items.event(name, response=done)
                break
    finally:
        if not finished:
            ctx.engine.cancel(state)  # the client went away: free its batch slot now


def responses_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()

    def converted(req: ResponsesRequest) -> AgentChat:
        return agent_chat(ctx, req, responses_chat, BODY_FIELDS, RESPONSES_PATH)

    @router.post(RESPONSES_PATH)
    async def responses(req: ResponsesRequest, request: Request):
        ctx.check_model(req.model)
        ctx.check_ready()
        if req.previous_response_id is not None:
            raise APIError(
                400,
                "previous_response_id: this server keeps no responses (stateless); send the "
                "whole conversation in input, with store: false",
                "previous_response_id",
                "invalid_value",
            )
        ctx.check_sizes(req)

        def prepare() -> tuple[AgentChat, list[int]]:
            chat = converted(req)
            tokens = chat_prompt_tokens(
                ctx, chat.messages, chat.tools, chat.template_kwargs, chat.tool_choice, "input"
            )
            if ctx.recorder is not None:
                body = req.model_dump(include={"input", "instructions", "tools", "reasoning"})
                ctx.recorder.record("responses", body, ctx.caller(request)[0])
            return chat, tokens

        chat, tokens = await prepared(ctx, prepare)
        answer = answer_splitter(ctx, chat.tools, chat.tool_choice, tokens)
        state, bridge = await submit(ctx, req, tokens, request, "input")
        rid = new_id("resp").replace("-", "_")
        if req.stream:
            return StreamingResponse(
                _stream(ctx, req, chat, state, bridge, rid, answer),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        if not await wait_for_answer(ctx, state, bridge, request):
            body = error_body(
                "the client disconnected", "invalid_request_error", None, "client_disconnected"
            )
            return JSONResponse(body, 499)
        output = _whole_output(state, answer, chat)
        return _response(rid, ctx, req, output, _status(state), _usage(ctx, state))

    return router
