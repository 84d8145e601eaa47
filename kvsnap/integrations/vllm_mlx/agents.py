"""Agents' own APIs on vllm-mlx, adapted in a ``--kv-snapshots`` run so that an agent's warm
prefix is a prefix of its requests: ``/v1/messages`` (Claude Code) and ``/v1/responses``
(Codex CLI).

vllm-mlx 0.6 collapses every system message of such a request into the first one
(``anthropic_adapter._merge_system_messages``, and the same merge inline in
``server._responses_request_to_chat_request``). Claude Code sends its environment block
(the folder, the date, git status) as a ``role: "system"`` message after the first user
turn; merged into the system prompt it lands ahead of the tools in templates that list the
tools after the system text (Qwen's), so each new folder or day prefills the tools again.
Here the leading system messages are merged as vllm-mlx merges them and later ones stay
where the client put them; the engine's template render then places them as kvsnap serve
does (``chat.system_placements``): in place where the template takes them, else appended to
the user turn before.

``agent_tokenization`` renders a warm entry's probe conversations as the entry's agent body
through the same adapted functions, so the warm prefix is computed exactly as the request
path will tokenize that agent's requests.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Callable

from kvsnap.chat import system_placements

if TYPE_CHECKING:
    from kvsnap.profiles import EngineTokenization
    from kvsnap.prompts import WarmPrompt

log = logging.getLogger("kvsnap.vllm_mlx")

MARK = "_kvsnap_agents"
# What vllm-mlx needs to be adapted (module, attribute).
ADAPTED = (
    ("vllm_mlx.api.anthropic_adapter", "_merge_system_messages"),
    ("vllm_mlx.server", "_responses_request_to_chat_request"),
    ("vllm_mlx.server", "_responses_input_to_chat_messages"),
)
PROBE_MODEL = "kvsnap-warm"  # a body's model when it names none (never validated here)
PROBE_MAX_TOKENS = 1


def _role(message: Any) -> str | None:
    return message.get("role") if isinstance(message, dict) else getattr(message, "role", None)


def _leading_system(messages: list) -> int:
    n = 0
    while n < len(messages) and _role(messages[n]) == "system":
        n += 1
    return n


def _later_system(messages: list) -> bool:
    return any(_role(m) == "system" for m in messages[_leading_system(messages) :])


# --- /v1/messages -----------------------------------------------------------------------


def leading_merge(merge: Callable[[list], list]) -> Callable[[list], list]:
    """vllm-mlx's ``_merge_system_messages`` over the leading system messages only; later ones
    stay in place."""

    def merge_leading(messages: list) -> list:
        if not _later_system(messages):
            return merge(messages)
        lead = _leading_system(messages)
        return [*merge(list(messages[:lead])), *messages[lead:]]

    return merge_leading


# --- /v1/responses ----------------------------------------------------------------------


def _leading_input_items(items: Any) -> int:
    """How many of a Responses ``input``'s first items are developer/system messages."""
    if not isinstance(items, list):
        return 0
    n = 0
    for item in items:
        if isinstance(item, dict):
            kind, role = item.get("type", "message"), item.get("role")
        else:
            kind, role = getattr(item, "type", "message"), getattr(item, "role", None)
        if kind != "message" or role not in ("developer", "system"):
            break
        n += 1
    return n


def leading_responses_merge(server: Any, convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """vllm-mlx's ``_responses_request_to_chat_request``, its system merge kept to the
    instructions and the leading developer/system items; later ones stay in place. A request
    continuing a stored response (``previous_response_id``) is left to vllm-mlx."""
    to_messages = server._responses_input_to_chat_messages
    message_cls = server.Message

    def to_chat_request(request: Any) -> Any:
        chat = convert(request)
        if request.previous_response_id or not isinstance(request.input, list):
            return chat
        lead = _leading_input_items(request.input)
        rest = request.model_copy(
            update={"input": list(request.input[lead:]), "instructions": None}, deep=True
        )
        later = to_messages(rest)
        if not any(_role(m) == "system" for m in later):
            return chat
        head = convert(request.model_copy(update={"input": list(request.input[:lead])}))
        chat.messages = [*head.messages, *(message_cls(**m) for m in later)]
        return chat

    return to_chat_request


# --- the template render ----------------------------------------------------------------


def placing_render(render: Callable[..., str]) -> Callable[..., str]:
    """The engine's ``_apply_chat_template``, trying kvsnap serve's placements of later system
    messages in turn when the template refuses them as given."""

    def apply_chat_template(messages: list, *args: Any, **kwargs: Any) -> str:
        texts = all(
            isinstance(m, dict) and isinstance(m.get("content"), str)
            for m in messages
            if _role(m) in ("system", "user")
        )
        if not texts or not _later_system(messages):
            return render(messages, *args, **kwargs)
        first: Exception | None = None
        for placed in system_placements(list(messages)):
            try:
                return render(placed, *args, **kwargs)
            # jinja raises many types; all mean the template refused these messages
            except Exception as exc:
                first = first or exc
        assert first is not None
        raise first

    return apply_chat_template


def adapt_request_paths(server: Any) -> bool:
    """Keep later system messages in place on ``/v1/messages`` and ``/v1/responses`` (once per
    process); False, with a warning, where this vllm-mlx lacks the functions."""
    import importlib

    if getattr(server, MARK, False):
        return True
    modules: dict[str, Any] = {}
    missing = []
    for module_name, attribute in ADAPTED:
        module = modules.setdefault(module_name, importlib.import_module(module_name))
        if not callable(getattr(module, attribute, None)):
            missing.append(f"{module_name}.{attribute}")
    if missing or not hasattr(server, "Message"):
        log.warning(
            "[kvsnap] this vllm-mlx lacks %s: its /v1/messages and /v1/responses merge later "
            "system messages into the first (agents' warm prefixes may miss)",
            ", ".join(missing) or "vllm_mlx.server.Message",
        )
        return False
    adapter = modules["vllm_mlx.api.anthropic_adapter"]
    adapter._merge_system_messages = leading_merge(adapter._merge_system_messages)
    server._responses_request_to_chat_request = leading_responses_merge(
        server, server._responses_request_to_chat_request
    )
    setattr(server, MARK, True)
    return True


def place_system_messages(engine: Any) -> None:
    """Install ``placing_render`` on this engine (once)."""
    if getattr(engine, MARK, False) or not callable(getattr(engine, "_apply_chat_template", None)):
        return
    engine._apply_chat_template = placing_render(engine._apply_chat_template)
    setattr(engine, MARK, True)


# --- warm entries -----------------------------------------------------------------------


def probe_body(prompt: WarmPrompt, turns: list[dict]) -> dict:
    """The entry's agent body with its conversation replaced by ``turns`` (a probe's user and
    assistant turns), as its client would send it."""
    body = dict(prompt.body or {})
    body.setdefault("model", PROBE_MODEL)
    body["stream"] = False
    if prompt.api == "anthropic":
        body.setdefault("max_tokens", PROBE_MAX_TOKENS)
        body["messages"] = [{"role": t["role"], "content": t["content"]} for t in turns]
        return body
    items = body.get("input")
    lead = list(items[: _leading_input_items(items)]) if isinstance(items, list) else []
    body["input"] = lead + [
        {"type": "message", "role": t["role"], "content": t["content"]} for t in turns
    ]
    return body


def _engine_render(server: Any, engine: Any, messages: list, chat_kwargs: dict) -> str:
    """The prompt string ``engine.chat`` / ``stream_chat`` render for these prepared inputs."""
    tools = chat_kwargs.get("tools")
    template_tools = server.convert_tools_for_template(tools) if tools else None
    return engine._apply_chat_template(
        messages,
        template_tools,
        chat_template_kwargs=dict(chat_kwargs.get("chat_template_kwargs") or {}),
        enable_thinking=chat_kwargs.get("enable_thinking"),
    )


def render_anthropic(server: Any, engine: Any, body: dict) -> str:
    """``POST /v1/messages``'s prompt string, as vllm-mlx (adapted) makes it."""
    openai_request = server.anthropic_to_openai(server.AnthropicRequest(**body))
    prepared = server._prepare_anthropic_invocation(engine, openai_request, PROBE_MAX_TOKENS)
    return _engine_render(server, engine, prepared.messages, prepared.chat_kwargs)


def render_responses(server: Any, engine: Any, body: dict) -> str:
    """``POST /v1/responses``'s prompt string, as vllm-mlx (adapted) makes it: its
    ``_prepare_responses_request`` without the model-name check and the request log."""
    request = server.ResponsesRequest(**body)
    chat_request = server._responses_request_to_chat_request(request)
    messages = server.extract_multimodal_content(
        chat_request.messages,
        preserve_native_format=getattr(engine, "preserve_native_tool_format", False),
    )[0]
    messages = server.canonicalize_system_messages(messages)
    chat_kwargs: dict = {}
    kwargs = server._resolve_chat_template_kwargs(chat_request.chat_template_kwargs)
    if kwargs:
        chat_kwargs["chat_template_kwargs"] = kwargs
    if request.tools:
        chat_kwargs["tools"] = server.convert_tools_for_template(chat_request.tools)
    return _engine_render(server, engine, messages, chat_kwargs)


RENDERERS = {"anthropic": render_anthropic, "responses": render_responses}


def agent_tokenization(
    base: EngineTokenization, server: Any, engine: Any, prompt: WarmPrompt
) -> EngineTokenization:
    """``base`` (vllm-mlx's chat path), rendering through the agent API's own request path:
    each probe conversation becomes the entry's body with the probe's turns as its
    conversation. The profile (so the snapshot's key) is ``base``'s."""
    render = RENDERERS[str(prompt.api)]
    entry = len(prompt.messages)

    def render_chat(messages: list, tools: list | None, kwargs: dict) -> str:
        return render(server, engine, probe_body(prompt, list(messages[entry:])))

    return dataclasses.replace(base, render_chat=render_chat)
