"""Agent clients' request bodies as kvsnap's chat: an Anthropic Messages body (Claude Code) or
an OpenAI Responses body (Codex CLI) becomes messages + tools + template settings here, and
only here. The server's ``/v1/messages`` and ``/v1/responses`` and the warm-prompt entries
``{"anthropic": {...}}`` / ``{"responses": {...}}`` all go through these functions, so a warm
entry and a real request of the same agent render the same tokens.

No mlx and no HTTP here: a bad field is a ``MessageError`` naming it, what was given and what
is allowed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from kvsnap.chat import normalize_messages
from kvsnap.errors import MessageError

# A line of a client's system text that changes on every request and says nothing to the
# model: Claude Code's first system block can carry a per-request hash. Dropped, as vllm-mlx
# does, so it cannot break the match of the stable prefix.
VOLATILE_SYSTEM_LINE = re.compile(r"^x-anthropic-billing-header:.*(?:\n|$)", re.MULTILINE)
# Tools a hosted API runs itself: a local model cannot, so they are left out (logged once per
# request), never refused: an agent that lists one must still get its answer.
HOSTED_TOOL_TYPES = frozenset(
    {
        "web_search",
        "web_search_preview",
        "file_search",
        "code_interpreter",
        "computer_use_preview",
        "image_generation",
        "local_shell",
        "mcp",
        "custom",
    }
)
# Responses' reasoning efforts that mean "do not think" (the rest turn thinking on)
NO_REASONING_EFFORTS = ("none", "minimal")
BLOCK_JOIN = "\n\n"  # between text blocks of one system prompt or one user turn
TOOL_ERROR_PREFIX = "Error: "  # an Anthropic tool_result with is_error: true


@dataclass(frozen=True)
class AgentChat:
    """A request of either agent API in kvsnap's terms."""

    messages: tuple[dict, ...]  # normalised (chat.normalize_message's shape)
    tools: tuple[dict, ...] | None  # OpenAI function tools, as chat templates read them
    template_kwargs: dict = field(default_factory=dict)
    tool_choice: Any = None  # OpenAI chat's shape: "auto", "none", "required" or one function
    dropped_tools: tuple[str, ...] = ()  # hosted tools left out, by type or name
    # Responses namespace tools: a function's name -> its namespace (for the call's item)
    namespaces: dict = field(default_factory=dict)


def _fail(where: str, problem: str, fix: str) -> MessageError:
    return MessageError(where, problem, fix)


def _kind(value: Any) -> str:
    return type(value).__name__


def _object(value: Any, where: str, fix: str) -> dict:
    if not isinstance(value, dict):
        raise _fail(where, f"expected an object, got {_kind(value)}", fix)
    return value


def _string(value: Any, where: str, fix: str) -> str:
    if not isinstance(value, str):
        raise _fail(where, f"expected a string, got {_kind(value)}", fix)
    return value


def _list(value: Any, where: str, fix: str) -> list:
    if not isinstance(value, list):
        raise _fail(where, f"expected a list, got {_kind(value)}", fix)
    return value


def stable_system_text(text: str) -> str:
    """A system text without the lines that change per request."""
    return VOLATILE_SYSTEM_LINE.sub("", text)


def _image_error(where: str, kind: str) -> MessageError:
    return _fail(
        where + ".type",
        f"{kind!r} content is not supported: this server runs a text-only model",
        "send text blocks only",
    )


# --- Anthropic Messages ---------------------------------------------------------------

ANTHROPIC_TEXT_FIX = 'use {"type": "text", "text": "..."} blocks'


def _anthropic_texts(content: Any, where: str) -> str:
    """A string, or a list of text blocks, as one text (``cache_control`` and citations
    ignored)."""
    if isinstance(content, str):
        return content
    blocks = _list(content, where, "give a string or a list of text blocks")
    texts = []
    for i, block in enumerate(blocks):
        here = f"{where}[{i}]"
        block = _object(block, here, ANTHROPIC_TEXT_FIX)
        kind = block.get("type")
        if kind in ("image", "document"):
            raise _image_error(here, kind)
        if kind != "text":
            raise _fail(
                here + ".type", f"block type {kind!r} is not allowed here", ANTHROPIC_TEXT_FIX
            )
        texts.append(_string(block.get("text"), here + ".text", "give the block's text"))
    return BLOCK_JOIN.join(texts)


def anthropic_system(system: Any, where: str = "system") -> str | None:
    """The top-level ``system``: a string or text blocks, volatile lines dropped, empty blocks
    left out; None when nothing is left."""
    if system is None:
        return None
    if isinstance(system, str):
        text = stable_system_text(system)
        return text or None
    blocks = _list(system, where, "give a string or a list of text blocks")
    texts = []
    for i, block in enumerate(blocks):
        here = f"{where}[{i}]"
        text = _anthropic_texts([block], here)
        text = stable_system_text(text)
        if text.strip():
            texts.append(text)
    return BLOCK_JOIN.join(texts) or None


def _tool_result(block: dict, where: str) -> dict:
    call_id = _string(block.get("tool_use_id"), where + ".tool_use_id", "name the tool_use id")
    content = block.get("content", "")
    if isinstance(content, list):
        for i, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in ("image", "document"):
                raise _image_error(f"{where}.content[{i}]", part["type"])
    text = _anthropic_texts(content, where + ".content")
    if block.get("is_error") is True:
        text = TOOL_ERROR_PREFIX + text
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _anthropic_user(content: Any, where: str) -> list[dict]:
    """One user message: its tool results become tool messages, its text one user message,
    in the order they come."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    blocks = _list(content, where, "give a string or a list of content blocks")
    out: list[dict] = []
    texts: list[str] = []

    def flush() -> None:
        if texts:
            out.append({"role": "user", "content": BLOCK_JOIN.join(texts)})
            texts.clear()

    for i, block in enumerate(blocks):
        here = f"{where}[{i}]"
        block = _object(block, here, ANTHROPIC_TEXT_FIX)
        kind = block.get("type")
        if kind == "text":
            texts.append(_string(block.get("text"), here + ".text", "give the block's text"))
        elif kind == "tool_result":
            flush()
            out.append(_tool_result(block, here))
        elif kind in ("image", "document"):
            raise _image_error(here, kind)
        else:
            raise _fail(
                here + ".type",
                f"block type {kind!r} is not allowed in a user message",
                'use "text" or "tool_result" blocks',
            )
    flush()
    if not out:
        raise _fail(where, "the user message has no content", "give at least one text block")
    return out


def _anthropic_assistant(content: Any, where: str) -> dict:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    blocks = _list(content, where, "give a string or a list of content blocks")
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict] = []
    for i, block in enumerate(blocks):
        here = f"{where}[{i}]"
        block = _object(block, here, ANTHROPIC_TEXT_FIX)
        kind = block.get("type")
        if kind == "text":
            texts.append(_string(block.get("text"), here + ".text", "give the block's text"))
        elif kind == "thinking":
            thinking.append(_string(block.get("thinking"), here + ".thinking", "give the text"))
        elif kind == "redacted_thinking":
            continue  # encrypted for another model: nothing this one can read
        elif kind == "tool_use":
            name = _string(block.get("name"), here + ".name", "name the tool")
            call_id = _string(block.get("id"), here + ".id", "give the tool_use id")
            arguments = _object(block.get("input", {}), here + ".input", "give input as an object")
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            )
        else:
            raise _fail(
                here + ".type",
                f"block type {kind!r} is not allowed in an assistant message",
                'use "text", "thinking", "redacted_thinking" or "tool_use" blocks',
            )
    message: dict = {"role": "assistant", "content": "".join(texts)}
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def anthropic_messages(messages: Any, where: str = "messages") -> list[dict]:
    """Anthropic ``messages`` as chat messages; ``role: "system"`` messages stay in place."""
    items = _list(messages, where, "give a list of messages")
    out: list[dict] = []
    for i, raw in enumerate(items):
        here = f"{where}[{i}]"
        message = _object(raw, here, 'write {"role": "user", "content": "..."}')
        role = message.get("role")
        content = message.get("content")
        if role == "user":
            out += _anthropic_user(content, here + ".content")
        elif role == "assistant":
            out.append(_anthropic_assistant(content, here + ".content"))
        elif role == "system":
            text = stable_system_text(_anthropic_texts(content, here + ".content"))
            out.append({"role": "system", "content": text})
        else:
            raise _fail(here + ".role", f"unknown role {role!r}", 'use "user" or "assistant"')
    return out


def anthropic_tools(tools: Any, where: str = "tools") -> tuple[tuple[dict, ...] | None, tuple]:
    """(function tools, dropped): Anthropic's ``{name, description, input_schema}`` as the
    OpenAI function tools chat templates read; server tools (web search, …) left out."""
    if tools is None:
        return None, ()
    out: list[dict] = []
    dropped: list[str] = []
    for i, raw in enumerate(_list(tools, where, "give a list of tools")):
        here = f"{where}[{i}]"
        tool = _object(raw, here, 'write {"name": ..., "input_schema": {...}}')
        kind = tool.get("type")
        if kind not in (None, "custom"):
            dropped.append(str(kind))
            continue
        name = _string(tool.get("name"), here + ".name", "name the tool")
        schema = _object(
            tool.get("input_schema", {"type": "object"}),
            here + ".input_schema",
            "give a JSON schema object",
        )
        function: dict = {"name": name, "parameters": schema}
        if tool.get("description") is not None:
            function["description"] = _string(
                tool["description"], here + ".description", "describe the tool in a string"
            )
        out.append({"type": "function", "function": function})
    return tuple(out), tuple(dropped)


def anthropic_tool_choice(choice: Any, where: str = "tool_choice") -> Any:
    if choice is None:
        return None
    choice = _object(choice, where, 'use {"type": "auto"}, "any", "tool" or "none"')
    kind = choice.get("type")
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "none":
        return "none"
    if kind == "tool":
        name = _string(choice.get("name"), where + ".name", "name the tool to call")
        return {"type": "function", "function": {"name": name}}
    raise _fail(
        where + ".type", f"unknown tool_choice type {kind!r}", 'use "auto", "any", "tool" or "none"'
    )


def anthropic_thinking(thinking: Any, where: str = "thinking") -> bool | None:
    """``thinking`` as the template's thinking switch: None leaves the template's default."""
    if thinking is None:
        return None
    kind = _object(thinking, where, 'use {"type": "enabled"}, "adaptive" or "disabled"').get("type")
    if kind in ("enabled", "adaptive"):
        return True
    if kind == "disabled":
        return False
    raise _fail(
        where + ".type",
        f"unknown thinking type {kind!r}",
        'use "enabled", "adaptive" or "disabled"',
    )


def _thinking_kwargs(thinking: bool | None) -> dict:
    return {} if thinking is None else {"enable_thinking": thinking}


def _system_first(system: str | None, messages: list[dict]) -> list[dict]:
    return ([{"role": "system", "content": system}] if system is not None else []) + messages


def anthropic_chat(body: Any) -> AgentChat:
    """A whole Messages request body."""
    body = _object(body, "body", "send a JSON object")
    system = anthropic_system(body.get("system"))
    if "messages" not in body:
        raise _fail("messages", "missing", "give the conversation's messages")
    messages = anthropic_messages(body["messages"])
    if not messages:
        raise _fail("messages", "the message list is empty", "give at least one message")
    tools, dropped = anthropic_tools(body.get("tools"))
    return AgentChat(
        messages=tuple(normalize_messages(_system_first(system, messages), "messages")),
        tools=tools or None,
        template_kwargs=_thinking_kwargs(anthropic_thinking(body.get("thinking"))),
        tool_choice=anthropic_tool_choice(body.get("tool_choice")),
        dropped_tools=dropped,
    )


def anthropic_prefix(body: Any, where: str) -> tuple[AgentChat, str]:
    """What every request of an agent shares: ``system`` + ``tools`` (+ the thinking
    switch); the messages are left out. With a sentence saying where it cut."""
    body = _object(body, where, "give the agent's request body as its client sends it")
    system = anthropic_system(body.get("system"), where + ".system")
    tools, dropped = anthropic_tools(body.get("tools"), where + ".tools")
    if system is None and not tools:
        raise _fail(
            where,
            "the body has neither system nor tools, so its requests share nothing to warm",
            "give the body with its system prompt and tools",
        )
    thinking = anthropic_thinking(body.get("thinking"), where + ".thinking")
    left_out = len(body.get("messages") or [])
    cut = (
        f"anthropic body: system ({len(system or '')} chars) + {len(tools or ())} tools"
        + (f"; {len(dropped)} server tools dropped" if dropped else "")
        + (f"; {left_out} messages left out" if left_out else "")
    )
    chat = AgentChat(
        messages=tuple(_system_first(system, [])),
        tools=tools or None,
        template_kwargs=_thinking_kwargs(thinking),
        dropped_tools=dropped,
    )
    return chat, cut


# --- OpenAI Responses -----------------------------------------------------------------

RESPONSES_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
RESPONSES_MESSAGE_FIX = 'write {"role": "user", "content": "..."} or input_text parts'


def _responses_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    parts = _list(content, where, "give a string or a list of input_text parts")
    texts = []
    for i, raw in enumerate(parts):
        here = f"{where}[{i}]"
        part = _object(raw, here, RESPONSES_MESSAGE_FIX)
        kind = part.get("type")
        if kind in ("input_image", "input_file", "input_audio"):
            raise _image_error(here, kind)
        if kind == "refusal":
            texts.append(_string(part.get("refusal"), here + ".refusal", "give the text"))
            continue
        if kind not in RESPONSES_TEXT_PARTS:
            raise _fail(
                here + ".type",
                f"content part type {kind!r} is not supported",
                'use "input_text" or "output_text" parts',
            )
        texts.append(_string(part.get("text"), here + ".text", "give the part's text"))
    return "".join(texts)


def _last_assistant(out: list[dict]) -> dict:
    """The assistant message a call joins: the last message when it is one, else a new one."""
    if out and out[-1]["role"] == "assistant":
        return out[-1]
    out.append({"role": "assistant", "content": ""})
    return out[-1]


def responses_input(items: Any, where: str = "input") -> list[dict]:
    """Responses ``input`` (a string or items) as chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    reasoning: list[str] = []  # a reasoning item's text, for the assistant turn that follows
    for i, raw in enumerate(_list(items, where, "give a string or a list of input items")):
        here = f"{where}[{i}]"
        item = _object(raw, here, RESPONSES_MESSAGE_FIX)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _fail(
                    here + ".role",
                    f"unknown role {role!r}",
                    'use "user", "assistant", "system" or "developer"',
                )
            text = _responses_text(item.get("content"), here + ".content")
            message: dict = {"role": role, "content": text}
            if role == "assistant" and reasoning:
                message["reasoning_content"] = "".join(reasoning)
            reasoning.clear()
            out.append(message)
        elif kind == "function_call":
            name = _string(item.get("name"), here + ".name", "name the function")
            call_id = _string(item.get("call_id"), here + ".call_id", "give the call's call_id")
            arguments = _string(item.get("arguments", "{}"), here + ".arguments", "a JSON string")
            assistant = _last_assistant(out)
            if reasoning:
                assistant.setdefault("reasoning_content", "".join(reasoning))
                reasoning.clear()
            assistant.setdefault("tool_calls", []).append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            )
        elif kind == "function_call_output":
            call_id = _string(item.get("call_id"), here + ".call_id", "give the call's call_id")
            output = item.get("output", "")
            text = output if isinstance(output, str) else _responses_text(output, here + ".output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            for key in ("content", "summary"):
                parts = item.get(key)
                if parts:
                    reasoning.append(_responses_text(parts, f"{here}.{key}"))
                    break
        elif kind == "item_reference":
            raise _fail(
                here + ".type",
                "item_reference needs stored responses, which this server does not keep",
                "send the whole conversation in input (store: false)",
            )
        else:
            raise _fail(
                here + ".type",
                f"input item type {kind!r} is not supported",
                'use "message", "function_call", "function_call_output" or "reasoning" items',
            )
    return out


def _responses_function(tool: dict, where: str) -> dict:
    name = _string(tool.get("name"), where + ".name", "name the function")
    function: dict = {"name": name}
    if tool.get("description") is not None:
        function["description"] = _string(tool["description"], where + ".description", "a string")
    parameters = tool.get("parameters")
    function["parameters"] = (
        _object(parameters, where + ".parameters", "give a JSON schema object")
        if parameters is not None
        else {"type": "object", "properties": {}}
    )
    return {"type": "function", "function": function}


def responses_tools(
    tools: Any, where: str = "tools"
) -> tuple[tuple[dict, ...] | None, tuple, dict]:
    """(function tools, dropped, namespaces): ``function`` tools and the functions of
    ``namespace`` tools as OpenAI function tools; hosted tools left out."""
    if tools is None:
        return None, (), {}
    out: list[dict] = []
    dropped: list[str] = []
    namespaces: dict[str, str] = {}
    for i, raw in enumerate(_list(tools, where, "give a list of tools")):
        here = f"{where}[{i}]"
        tool = _object(raw, here, 'write {"type": "function", "name": ..., "parameters": {...}}')
        kind = tool.get("type")
        if kind == "function":
            out.append(_responses_function(tool, here))
        elif kind == "namespace":
            space = _string(tool.get("name"), here + ".name", "name the namespace")
            for j, inner in enumerate(_list(tool.get("tools"), here + ".tools", "list functions")):
                inner_where = f"{here}.tools[{j}]"
                inner = _object(inner, inner_where, "give a function tool")
                if inner.get("type", "function") != "function":
                    dropped.append(str(inner.get("type")))
                    continue
                function = _responses_function(inner, inner_where)
                namespaces[function["function"]["name"]] = space
                out.append(function)
        elif isinstance(kind, str) and (kind in HOSTED_TOOL_TYPES or kind.startswith("web_search")):
            dropped.append(kind)
        else:
            raise _fail(
                here + ".type",
                f"tool type {kind!r} is not supported",
                'use "function" or "namespace" tools (hosted tools are left out)',
            )
    return tuple(out), tuple(dropped), namespaces


def responses_tool_choice(choice: Any, where: str = "tool_choice") -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    choice = _object(choice, where, 'use "auto", "none", "required" or {"type": "function", ...}')
    if choice.get("type") == "function":
        name = _string(choice.get("name"), where + ".name", "name the function to call")
        return {"type": "function", "function": {"name": name}}
    return "auto"  # a hosted tool's choice: that tool is left out, the model may still answer


def responses_reasoning(reasoning: Any, where: str = "reasoning") -> bool | None:
    if reasoning is None:
        return None
    effort = _object(reasoning, where, 'e.g. {"effort": "low"}').get("effort")
    if effort is None:
        return None
    effort = _string(effort, where + ".effort", 'use "none", "minimal", "low", "medium" or "high"')
    return effort not in NO_REASONING_EFFORTS


def _leading_system(messages: list[dict]) -> int:
    n = 0
    while n < len(messages) and messages[n]["role"] in ("system", "developer"):
        n += 1
    return n


def responses_chat(body: Any) -> AgentChat:
    """A whole Responses request body."""
    body = _object(body, "body", "send a JSON object")
    instructions = body.get("instructions")
    if instructions is not None:
        instructions = _string(instructions, "instructions", "give the instructions as a string")
    if "input" not in body:
        raise _fail("input", "missing", "give the conversation as input")
    messages = responses_input(body["input"])
    if instructions:
        messages = [{"role": "system", "content": instructions}] + messages
    if not messages:
        raise _fail("input", "the input list is empty", "give at least one message")
    tools, dropped, namespaces = responses_tools(body.get("tools"))
    return AgentChat(
        messages=tuple(normalize_messages(messages, "input")),
        tools=tools or None,
        template_kwargs=_thinking_kwargs(responses_reasoning(body.get("reasoning"))),
        tool_choice=responses_tool_choice(body.get("tool_choice")),
        dropped_tools=dropped,
        namespaces=namespaces,
    )


def responses_prefix(body: Any, where: str) -> tuple[AgentChat, str]:
    """What every request of an agent shares: ``instructions`` + ``tools`` + the leading
    ``developer`` / ``system`` items of ``input``. With a sentence saying where it cut."""
    body = _object(body, where, "give the agent's request body as its client sends it")
    instructions = body.get("instructions")
    messages = []
    if instructions is not None:
        text = _string(instructions, where + ".instructions", "give a string")
        messages.append({"role": "system", "content": text})
    raw_input = body.get("input", [])
    converted = responses_input(raw_input if isinstance(raw_input, list) else [], where + ".input")
    lead = _leading_system(converted)
    messages += converted[:lead]
    tools, dropped, namespaces = responses_tools(body.get("tools"), where + ".tools")
    if not messages and not tools:
        raise _fail(
            where,
            "the body has no instructions, leading developer/system items or tools, so its "
            "requests share nothing to warm",
            "give the body with its instructions or developer messages and tools",
        )
    cut = (
        f"responses body: {'instructions + ' if instructions else ''}{lead} leading "
        f"developer/system items + {len(tools or ())} tools"
        + (f"; {len(dropped)} hosted tools dropped" if dropped else "")
        + (f"; {len(converted) - lead} later items left out" if len(converted) > lead else "")
    )
    chat = AgentChat(
        messages=tuple(normalize_messages(messages, where) if messages else ()),
        tools=tools or None,
        template_kwargs=_thinking_kwargs(
            responses_reasoning(body.get("reasoning"), where + ".reasoning")
        ),
        dropped_tools=dropped,
        namespaces=namespaces,
    )
    return chat, cut


def arguments_object(arguments: str) -> Any:
    """A call's arguments (a JSON string) as the object Anthropic's ``input`` holds; text
    that is not JSON stays a string under ``"input"``, never lost."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"input": arguments}
    return value if isinstance(value, dict) else {"input": value}
