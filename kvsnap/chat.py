"""A chat request as tokens: messages normalised, rendered with the tokenizer's own chat
template, encoded; and ``Tokenization``, how a server does the last two (part of a key).

The one normaliser (``normalize_messages``) serves warm-prompt files and the server's
request path alike, and ``request_tokens`` is the one way both turn messages into tokens.
No mlx here: the tokenizer is anything with ``apply_chat_template`` and ``encode``
(a Hugging Face tokenizer or mlx-lm's ``TokenizerWrapper``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from kvsnap.errors import MessageError, TemplateError

ROLES = ("system", "developer", "user", "assistant", "tool")
MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content")


class ChatTokenizer(Protocol):
    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...


# --- messages -----------------------------------------------------------------


def _content_to_text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            here = f"{where}[{i}]"
            if isinstance(part, str):
                texts.append(part)
                continue
            if not isinstance(part, dict):
                raise MessageError(
                    here,
                    f"content part is a {type(part).__name__}",
                    'use {"type": "text", "text": "..."}',
                )
            kind = part.get("type", "text")
            if kind not in ("text", "input_text"):
                raise MessageError(
                    here + ".type",
                    f"content part type {kind!r} is not supported",
                    'only "text" parts can be served by a text model',
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise MessageError(
                    here + ".text",
                    f"expected a string, got {type(text).__name__}",
                    "give the part's text as a string",
                )
            texts.append(text)
        return "".join(texts)
    raise MessageError(
        where, f"content is a {type(content).__name__}", "give a string or a list of text parts"
    )


def normalize_message(message: Any, where: str) -> dict:
    """One message → a plain dict: text content, ``developer`` folded into ``system``."""
    if not isinstance(message, dict):
        raise MessageError(
            where,
            f"a message must be an object, got {type(message).__name__}",
            'write {"role": ..., "content": ...}',
        )
    role = message.get("role")
    if role not in ROLES:
        raise MessageError(
            where + ".role", f"unknown role {role!r}", f"use one of {', '.join(ROLES)}"
        )
    unknown = sorted(set(message) - set(MESSAGE_KEYS))
    if unknown:
        raise MessageError(
            where,
            f"unknown field(s) {', '.join(map(repr, unknown))}",
            f"a message may only have {', '.join(MESSAGE_KEYS)}",
        )
    content = _content_to_text(message.get("content"), where + ".content")
    if content is None and not (role == "assistant" and message.get("tool_calls")):
        raise MessageError(
            where + ".content", "content is missing", "give the message's text as a string"
        )
    out: dict = {
        "role": "system" if role == "developer" else role,
        "content": content if content is not None else "",
    }
    for key in ("name", "tool_call_id", "reasoning_content"):
        if key in message and message[key] is not None:
            if not isinstance(message[key], str):
                raise MessageError(
                    f"{where}.{key}",
                    f"expected a string, got {type(message[key]).__name__}",
                    f"give {key} as a string",
                )
            out[key] = message[key]
    if message.get("tool_calls") is not None:
        calls = message["tool_calls"]
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise MessageError(
                where + ".tool_calls", "expected a list of objects", "use OpenAI's tool_calls shape"
            )
        out["tool_calls"] = [_template_call(c) for c in calls]
    return out


def _template_call(call: dict) -> dict:
    """A call as templates read it: OpenAI sends ``function.arguments`` as a JSON string, and
    templates write it with ``tojson`` (so a string would be quoted twice); mlx_lm.server and
    vLLM hand templates the object too. Text that is not a JSON object stays as it is."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def normalize_messages(messages: Any, where: str = "messages") -> list[dict]:
    """The one normaliser used by warm-prompt files and by the server's request path."""
    if not isinstance(messages, list):
        raise MessageError(
            where,
            f"expected a list of messages, got {type(messages).__name__}",
            "give a JSON list of chat messages",
        )
    if not messages:
        raise MessageError(where, "the message list is empty", "give at least one message")
    return [normalize_message(m, f"{where}[{i}]") for i, m in enumerate(messages)]


# --- rendering ------------------------------------------------------------------


def resolve_chat_template(tokenizer: Any, tools: Sequence[dict] | None = None) -> str:
    """The template text that will actually render: a named one when the tokenizer has several."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        if tools and "tool_use" in template:
            return template["tool_use"]
        return template.get("default") or next(iter(template.values()))
    if not template:
        raise TemplateError(
            "the tokenizer has no chat template; add one to tokenizer_config.json "
            '("chat_template") or chat_template.jinja'
        )
    return template


def render_messages(
    tokenizer: ChatTokenizer,
    messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
    chat_template_kwargs: dict | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """Render normalised messages to the prompt string with the tokenizer's own template.

    A template that refuses system messages after the first (or more than one) gets them
    placed where it takes them (``system_placements``): the same rule for every request
    and every warm prompt, so the leading system prompt and tools stay a shared prefix."""
    kwargs = dict(chat_template_kwargs or {})
    first: Exception | None = None
    for placed in system_placements(list(messages)):
        try:
            text = tokenizer.apply_chat_template(
                placed,
                tools=list(tools) if tools else None,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **kwargs,
            )
            break
        # jinja raises many types; all mean the template refused these messages
        except Exception as exc:
            first = first or exc
    else:
        assert first is not None
        raise TemplateError(
            f"the chat template failed to render the messages ({type(first).__name__}: "
            f"{first}); check the roles and order of the messages"
        ) from first
    if not isinstance(text, str):
        raise TemplateError(
            f"apply_chat_template returned {type(text).__name__}, not a string; this tokenizer is "
            f"not supported"
        )
    return text


def system_placements(messages: list[dict]) -> list[list[dict]]:
    """The messages as given, then (when they hold system messages a template may refuse)
    the later system messages appended to the user turn before them (the one after, when
    none comes before: kept after the leading system prompt, and unchanged by later turns),
    then also the leading run of system messages joined into one."""
    lead = 0
    while lead < len(messages) and messages[lead]["role"] == "system":
        lead += 1
    tries = [messages]
    later = [i for i in range(lead, len(messages)) if messages[i]["role"] == "system"]
    if later:
        tries.append(_later_system_in_user_turns(messages, lead))
    if lead > 1:
        joined = "\n\n".join(m["content"] for m in tries[-1][:lead])
        tries.append([{"role": "system", "content": joined}, *tries[-1][lead:]])
    return tries


def _later_system_in_user_turns(messages: list[dict], lead: int) -> list[dict]:
    out = [dict(m) for m in messages[:lead]]
    pending: list[str] = []  # system texts waiting for a user turn (none before them)
    for m in messages[lead:]:
        if m["role"] == "system":
            before = next((o for o in reversed(out[lead:]) if o["role"] == "user"), None)
            if before is not None:
                before["content"] = f"{before['content']}\n\n{m['content']}"
            else:
                pending.append(m["content"])
            continue
        m = dict(m)
        if m["role"] == "user" and pending:
            m["content"] = "\n\n".join([*pending, m["content"]])
            pending = []
        out.append(m)
    if pending:
        out.append({"role": "user", "content": "\n\n".join(pending)})
    return out


def encode_prompt(tokenizer: ChatTokenizer, text: str) -> list[int]:
    """Tokenize a rendered prompt. The template carries BOS itself, as in Hugging Face's
    tokenize=True."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def request_tokens(
    tokenizer: ChatTokenizer,
    messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
    chat_template_kwargs: dict | None = None,
) -> list[int]:
    """The tokens of a chat request: the one function both warm-up and the request path use."""
    return encode_prompt(
        tokenizer, render_messages(tokenizer, messages, tools, chat_template_kwargs)
    )


@dataclass(frozen=True)
class Tokenization:
    """How a server turns a chat request into token ids; part of a snapshot's key.

    kvsnap's own server (the default) renders with the request's kwargs and encodes
    without special tokens (the template carries BOS); its descriptor is None, so its
    keys are exactly what they were before profiles existed. Another server's profile
    names the kwargs it passes before the request's own and whether its ``encode``
    adds the tokenizer's special tokens (vllm-mlx: yes, so Llama-3 prompts start with
    two BOS).
    """

    server: str = "kvsnap"
    add_special_tokens: bool = False
    template_defaults: tuple[tuple[str, Any], ...] = ()

    def render(
        self,
        tokenizer: ChatTokenizer,
        messages: Sequence[dict],
        tools: Sequence[dict] | None,
        chat_template_kwargs: dict | None,
        add_generation_prompt: bool = True,
    ) -> str:
        kwargs = {**dict(self.template_defaults), **(chat_template_kwargs or {})}
        return render_messages(tokenizer, messages, tools, kwargs, add_generation_prompt)

    def encode(self, tokenizer: ChatTokenizer, text: str) -> list[int]:
        if not self.add_special_tokens:
            return encode_prompt(tokenizer, text)
        return list(tokenizer.encode(text))

    def descriptor(self) -> dict | None:
        """What enters the key (None for kvsnap's own server: keys unchanged)."""
        if self.server == "kvsnap" and not self.add_special_tokens and not self.template_defaults:
            return None
        return {
            "server": self.server,
            "add_special_tokens": self.add_special_tokens,
            "template_defaults": dict(self.template_defaults),
        }


KVSNAP_TOKENIZATION = Tokenization()
