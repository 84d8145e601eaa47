"""Tokenization profiles: how each upstream server turns a chat request into token ids.

A profile (``kvsnap.chat.Tokenization``) is recorded in every snapshot built for a server
other than ``kvsnap serve`` and takes part in its key, so a build and a server that agree
produce the same keys and any disagreement shows as a miss (then a prefill and a
write-back), never a wrong hit. Both the build (``kvsnap build --for …``) and the
integrations read them here; no upstream import (a build runs without vllm-mlx or mlx-lm).

**vllm-mlx 0.6** renders with ``apply_chat_template(messages, tokenize=False,
add_generation_prompt=True, enable_thinking=E, **chat_template_kwargs)`` and then calls
``tokenizer.encode(text)`` with the tokenizer's defaults, so a tokenizer that adds BOS on
encode (Llama 3) puts a second BOS in front of the template's own. ``E`` is vllm-mlx's
choice: ``"coder" not in model_name.lower()``, where ``model_name`` is the MODEL argument
of ``vllm-mlx serve`` (its engine's name, not ``--served-model-name``). Server-wide
``--default-chat-template-kwargs`` come before a request's own. At serve time
``EngineTokenization`` renders through vllm-mlx's own functions instead, with the same
descriptor.

**mlx-lm 0.32's own server** (``mlx_lm.server``), read from ``ResponseGenerator._tokenize``:
it calls its ``TokenizerWrapper``'s ``apply_chat_template(messages, add_generation_prompt=True,
tools=tools, tokenize=True, **{**cli_args.chat_template_args, **request.chat_template_kwargs})``.
The wrapper fills in the template's thinking switch (``enable_thinking`` or the template's own
name for it) with ``has_thinking`` when neither sets it, renders, and encodes with
``add_special_tokens=False``: the template's BOS only, so Llama-3 prompts start with one
``<|begin_of_text|>`` (vllm-mlx adds a second). kvsnap renders through the same wrapper and
encodes the same way, so the only difference from ``kvsnap serve`` is the server-wide
``--chat-template-args``, which come before a request's own.

For its cache mlx_lm.server cuts a request with leading system messages at ``sys_end``:
the first token where the render of the system messages followed by an *empty* user turn
(without the generation prompt) differs from the request. That cut is not always a
strict prefix of other requests of the same agent (an empty user turn can merge with the
text before it); kvsnap's warm prefix, the longest common prefix over probe user turns,
is, and mlx-lm's lookup takes any stored prefix of a request, so the warm entry hits
whichever of the two cuts is longer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kvsnap.chat import ChatTokenizer, Tokenization
from kvsnap.errors import UsageError

VLLM_MLX = "vllm-mlx"
MLX_LM = "mlx-lm"


def vllm_mlx_enable_thinking(model_name: str) -> bool:
    """vllm-mlx 0.6's default: thinking on unless the model's name says it is a coder model."""
    return "coder" not in str(model_name).lower()


def vllm_mlx_tokenization(
    model_name: str, default_chat_template_kwargs: dict | None = None
) -> Tokenization:
    """The profile of ``vllm-mlx serve MODEL_NAME [--default-chat-template-kwargs ...]``."""
    defaults = {
        "enable_thinking": vllm_mlx_enable_thinking(model_name),
        **(default_chat_template_kwargs or {}),
    }
    return Tokenization(
        server=VLLM_MLX, add_special_tokens=True, template_defaults=tuple(sorted(defaults.items()))
    )


def parse_chat_template_args(text: str | None, flag: str = "--chat-template-args") -> dict:
    """mlx_lm.server's ``--chat-template-args`` JSON object (empty when not given)."""
    if text is None or text == "":
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise UsageError(
            f"{flag} {text!r} is not JSON ({exc}); give an object, e.g. "
            "'{\"enable_thinking\": false}'"
        ) from None
    if not isinstance(value, dict):
        raise UsageError(
            f"{flag} {text!r} is a {type(value).__name__}, not a JSON object; "
            "give an object, e.g. '{\"enable_thinking\": false}'"
        )
    return value


def mlx_lm_tokenization(chat_template_args: dict | None = None) -> Tokenization:
    """The profile of ``mlx_lm.server [--chat-template-args JSON]``."""
    defaults = tuple(sorted((chat_template_args or {}).items()))
    return Tokenization(server=MLX_LM, add_special_tokens=False, template_defaults=defaults)


def recorded_tokenization(recorded: Any) -> dict | None:
    """The tokenization profile a snapshot header records (canonical JSON text), or None: kvsnap
    serve's."""
    raw = recorded.get("tokenization") if isinstance(recorded, dict) else None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return {"server": "unknown", "text": raw[:80]}
    return raw if isinstance(raw, dict) else None


def describe(descriptor: dict | None) -> str:
    """A tokenization descriptor in words, for warnings."""
    if descriptor is None:
        return "kvsnap serve's (template tokens only, the entry's own chat_template_kwargs)"
    defaults = ", ".join(
        f"{k}={v!r}" for k, v in sorted((descriptor.get("template_defaults") or {}).items())
    )
    specials = "with" if descriptor.get("add_special_tokens") else "without"
    return (
        f"{descriptor.get('server', '?')}'s (encoded {specials} the tokenizer's special "
        f"tokens{', ' + defaults if defaults else ''})"
    )


@dataclass(frozen=True)
class EngineTokenization(Tokenization):
    """vllm-mlx's profile, rendered by the running vllm-mlx itself.

    ``render_chat(messages, tools, chat_template_kwargs) -> str`` is vllm-mlx's own request
    path up to the prompt string, ``encode_text(text) -> ids`` its scheduler's encode.
    """

    render_chat: Callable[[list[dict], list[dict] | None, dict], str] | None = None
    encode_text: Callable[[str], Sequence[int]] | None = None

    def render(
        self,
        tokenizer: ChatTokenizer,
        messages: Sequence[dict],
        tools: Sequence[dict] | None,
        chat_template_kwargs: dict | None,
        add_generation_prompt: bool = True,
    ) -> str:
        # Only the coverage figure renders without the generation prompt.
        if not add_generation_prompt or self.render_chat is None:
            return super().render(
                tokenizer, messages, tools, chat_template_kwargs, add_generation_prompt
            )
        return self.render_chat(
            list(messages), list(tools) if tools else None, dict(chat_template_kwargs or {})
        )

    def encode(self, tokenizer: ChatTokenizer, text: str) -> list[int]:
        if self.encode_text is None:
            return super().encode(tokenizer, text)
        return list(self.encode_text(text))
