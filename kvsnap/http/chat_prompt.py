"""A chat prompt as the server renders it, for every API that speaks chat (chat completions,
Anthropic Messages, OpenAI Responses): the server's ``--chat-template-args`` under the
request's own kwargs, ``tool_choice`` for the template, the one render and tokenization
(``chat.request_tokens``), and the splitter that reads tool calls and reasoning back out."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

from kvsnap.agent_requests import AgentChat
from kvsnap.chat import request_tokens
from kvsnap.errors import MessageError, TemplateError
from kvsnap.http.api_errors import APIError
from kvsnap.http.context import ServerContext
from kvsnap.http.tool_calls import (
    PROMPT_TAIL_TOKENS,
    AnswerSplitter,
    OutputRules,
    check_tool_choice,
)

log = logging.getLogger("kvsnap.http.server")


def chat_prompt_tokens(
    ctx: ServerContext,
    messages: Sequence[dict],
    tools: Optional[Sequence[dict]],
    kwargs: dict,
    tool_choice: Any,
    where: str,
) -> list[int]:
    """Render and tokenize normalised messages: a worker thread's job, never the loop's.
    ``kwargs`` are the request's checked template kwargs; ``where`` names the messages'
    field in errors."""
    kwargs = {**ctx.config.chat_template_args, **kwargs}
    if tool_choice is not None:
        kwargs["tool_choice"] = tool_choice
    try:
        tokens = request_tokens(ctx.engine.lm.tokenizer, messages, tools, kwargs)
    except TemplateError as exc:
        raise APIError(400, str(exc), where, "invalid_value") from None
    if not tokens:
        raise APIError(400, f"the {where} render to an empty prompt", where, "invalid_value")
    return tokens


def answer_rules(ctx: ServerContext) -> OutputRules:
    return ctx.model_limits()["answer_rules"]


def answer_splitter(
    ctx: ServerContext, tools: Optional[Sequence[dict]], tool_choice: Any, tokens: list[int]
) -> AnswerSplitter:
    """The splitter for one answer; the prompt's tail says whether it starts inside a think
    block."""
    rules = answer_rules(ctx)
    tail = ""
    if rules.splits_reasoning:
        tail = ctx.engine.lm.tokenizer.decode(tokens[-PROMPT_TAIL_TOKENS:])
    return AnswerSplitter(rules, list(tools) if tools else None, tool_choice, tail)


def agent_chat(
    ctx: ServerContext,
    req: Any,
    convert: Callable[[dict], AgentChat],
    fields: tuple[str, ...],
    path: str,
) -> AgentChat:
    """An agent API's request body (its ``fields``) as kvsnap's chat, checked as chat's is:
    lone surrogates, the conversion's own errors as 400s naming the field, ``tool_choice``;
    hosted tools left out get one log line."""
    ctx.check_text(req, fields)
    try:
        chat = convert(req.model_dump(include=set(fields)))
    except MessageError as exc:
        raise APIError(400, str(exc), exc.where, "invalid_value") from None
    check_tool_choice(chat.tool_choice, list(chat.tools or ()))
    if chat.dropped_tools:
        log.info(
            "[kvsnap] %s: tools a local model cannot run left out: %s",
            path,
            ", ".join(chat.dropped_tools),
        )
    return chat
