"""What a request may ask of the model: template variables, token ids, text. No mlx at import.

A request's ``chat_template_kwargs`` may only fill variables the model's own template
reads; anything else (``chat_template`` above all: a client-supplied template is code,
CVE-2025-61620) is refused before rendering.
"""

from __future__ import annotations

import json
import math
from typing import Any, Iterable, Optional

RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "chat_template",
        "tokenize",
        "add_generation_prompt",
        "continue_final_message",
        "tools",
        "documents",
        "messages",
    }
    # Also what the tokenizer itself fills in: special tokens and the template's helper functions.
    | {
        "bos_token",
        "eos_token",
        "unk_token",
        "pad_token",
        "sep_token",
        "cls_token",
        "mask_token",
        "additional_special_tokens",
        "raise_exception",
        "strftime_now",
        "tool_calls",
    }
)
MAX_KWARG_STRING = 4096
# Messages and tools a request may render with: the template's work grows with them.
MAX_MESSAGES = 2048
MAX_TOOLS = 256
CONTEXT_KEYS = (
    "max_position_embeddings",
    "max_sequence_length",
    "seq_length",
    "n_positions",
    "max_seq_len",
    "model_max_length",
)
NESTED_CONFIGS = ("text_config", "language_config", "llm_config")


class RequestRejected(ValueError):
    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


def template_variables(chat_template: Any) -> frozenset[str]:
    """Variables the template reads without defining them (all named templates together)."""
    from jinja2 import Environment, meta
    from jinja2.exceptions import TemplateError

    sources = chat_template.values() if isinstance(chat_template, dict) else [chat_template]
    names: set[str] = set()
    env = Environment()
    for src in sources:
        if not isinstance(src, str):
            continue
        try:
            names |= meta.find_undeclared_variables(env.parse(src))
        except TemplateError:
            continue  # the tokenizer will fail on it too, with its own message
    return frozenset(names)


def allowed_template_kwargs(chat_template: Any) -> frozenset[str]:
    return template_variables(chat_template) - RESERVED_TEMPLATE_KWARGS


def check_template_kwargs(kwargs: Optional[dict], allowed: frozenset[str]) -> dict:
    """The kwargs if every key is a variable of the model's template and every value is plain
    data."""
    if not kwargs:
        return {}
    for key, value in kwargs.items():
        where = f"chat_template_kwargs.{key}"
        if key in RESERVED_TEMPLATE_KWARGS or key not in allowed:
            offered = ", ".join(sorted(allowed)) or "none"
            raise RequestRejected(
                f"{where}: {key!r} is not a variable of this model's chat template and cannot be "
                f"set by a request (settable here: {offered})",
                where,
            )
        if not _plain(value):
            raise RequestRejected(
                f"{where}: give a string (at most {MAX_KWARG_STRING} characters), number, boolean "
                f"or null, or a short list of them",
                where,
            )
    return dict(kwargs)


def check_counts(
    messages: Any, tools: Any, max_messages: int = MAX_MESSAGES, max_tools: int = MAX_TOOLS
) -> None:
    """Refuse more messages or tools than a render may take, before any of it runs."""
    for name, items, most in (("messages", messages, max_messages), ("tools", tools, max_tools)):
        if isinstance(items, list) and len(items) > most:
            raise RequestRejected(
                f"{name}: {len(items)} {name} is more than this server takes ({most}); send fewer",
                name,
            )


def _plain(value: Any, depth: int = 0) -> bool:
    if value is None or isinstance(value, (bool, int, float)):
        return True
    if isinstance(value, str):
        return len(value) <= MAX_KWARG_STRING
    if isinstance(value, list) and depth == 0:
        return len(value) <= 64 and all(_plain(v, 1) for v in value)
    return False


def _configs(config: dict) -> Iterable[dict]:
    yield config
    for name in NESTED_CONFIGS:
        nested = config.get(name)
        if isinstance(nested, dict):
            yield nested


def context_length(config: dict) -> Optional[int]:
    """The context limit, from the top-level config or a nested text config."""
    for cfg in _configs(config):
        for key in CONTEXT_KEYS:
            value = cfg.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def embedding_rows(model: Any) -> Optional[int]:
    """Rows of the model's input embedding: the real bound on a token id."""
    import mlx.nn as nn

    for _, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.QuantizedEmbedding)):
            return int(module.weight.shape[0])
    return None


def vocab_bound(model: Any, config: dict) -> int:
    """Token ids must be below this: the embedding rows, and the configured vocabulary if
    smaller."""
    bounds = [
        b
        for b in (embedding_rows(model), *(c.get("vocab_size") for c in _configs(config)))
        if isinstance(b, int) and not isinstance(b, bool) and b > 0
    ]
    if not bounds:
        raise RequestRejected(
            "cannot tell this model's vocabulary size; token-id prompts are refused"
        )
    return min(bounds)


def check_token_ids(tokens: list[int], bound: int, param: str = "prompt") -> None:
    if not tokens or (min(tokens) >= 0 and max(tokens) < bound):
        return  # every request passes here: builtin min/max, not a Python loop
    bad = next(t for t in tokens if t < 0 or t >= bound)
    raise RequestRejected(
        f"{param}: token id {bad} is outside this model's vocabulary [0, {bound}); send ids below "
        f"{bound}",
        param,
    )


def find_lone_surrogate(value: Any, where: str) -> Optional[str]:
    """The path of the first string holding a lone surrogate (JSON allows it, UTF-8 does not)."""
    stack = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(item, dict):
            stack.extend((v, f"{path}.{k}") for k, v in item.items())
            stack.extend((k, f"{path} (a key)") for k in item)
        elif isinstance(item, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(item))
    return None


# The sampling numbers a request may send (every route kvsnap fronts reads these names).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p")


def sampling_refusal(body: dict) -> Optional[tuple[str, str, str]]:
    """(field, message, code) for a NaN or infinite sampling number (Python's JSON reads
    ``NaN`` and ``Infinity``): upstream range checks let NaN through, and mlx-lm's
    ``apply_min_p`` then raises in the batch. None when every one given is finite."""
    for name in SAMPLING_FIELDS:
        value = body.get(name)
        if isinstance(value, float) and not math.isfinite(value):
            return (
                name,
                f"{name}: {json.dumps(value)} is not a finite number; send a number",
                "invalid_value",
            )
    return None
