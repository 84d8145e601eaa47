"""How vllm-mlx 0.6 turns a chat request into token ids, as a kvsnap tokenization profile.

vllm-mlx renders with ``apply_chat_template(messages, tokenize=False,
add_generation_prompt=True, enable_thinking=E, **chat_template_kwargs)`` and then calls
``tokenizer.encode(text)`` with the tokenizer's defaults, so a tokenizer that adds BOS on
encode (Llama 3) puts a second BOS in front of the template's own. ``E`` is vllm-mlx's
choice: ``"coder" not in model_name.lower()``, where ``model_name`` is the MODEL argument
of ``vllm-mlx serve`` (its engine's name, not ``--served-model-name``). Server-wide
``--default-chat-template-kwargs`` come before a request's own.

No vllm-mlx import here: ``kvsnap build --for vllm-mlx`` runs without it. At serve time
``EngineTokenization`` renders through vllm-mlx's own functions instead, with the same
descriptor, so a build and a server that agree produce the same keys, and any
disagreement shows as a miss (then a prefill and a write-back), never a wrong hit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from kvsnap.chat import ChatTokenizer, Tokenization

SERVER = "vllm-mlx"


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
        server=SERVER, add_special_tokens=True, template_defaults=tuple(sorted(defaults.items()))
    )


def recorded_tokenization(recorded: Any) -> dict | None:
    """The tokenization profile a snapshot header records (canonical JSON text), or None: kvsnap
    serve's."""
    import json

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

    render_chat: Any = None
    encode_text: Any = None

    def render(
        self,
        tokenizer: ChatTokenizer,
        messages: Sequence[dict],
        tools: Sequence[dict] | None,
        chat_template_kwargs: dict | None,
        add_generation_prompt: bool = True,
    ) -> str:
        if (
            not add_generation_prompt or self.render_chat is None
        ):  # only the coverage figure renders without it
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
