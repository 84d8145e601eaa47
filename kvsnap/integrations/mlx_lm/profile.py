"""How mlx-lm 0.32's own server (``mlx_lm.server``) turns a chat request into token ids.

Read from ``ResponseGenerator._tokenize``: it calls its ``TokenizerWrapper``'s
``apply_chat_template(messages, add_generation_prompt=True, tools=tools, tokenize=True,
**{**cli_args.chat_template_args, **request.chat_template_kwargs})``. The wrapper fills
in the template's thinking switch (``enable_thinking`` or the template's own name for it)
with ``has_thinking`` when neither sets it, renders, and encodes with
``add_special_tokens=False``: the template's BOS only, so Llama-3 prompts start with one
``<|begin_of_text|>`` (vllm-mlx adds a second). kvsnap renders through the same wrapper
and encodes the same way, so the only difference from ``kvsnap serve`` is the server-wide
``--chat-template-args``, which come before a request's own.

For its cache mlx_lm.server cuts a request with leading system messages at ``sys_end``:
the first token where the render of the system messages followed by an *empty* user turn
(without the generation prompt) differs from the request. That cut is not always a
strict prefix of other requests of the same agent (an empty user turn can merge with the
text before it); kvsnap's warm prefix, the longest common prefix over probe user turns,
is, and mlx-lm's lookup takes any stored prefix of a request, so the warm entry hits
whichever of the two cuts is longer.

No mlx-lm import here: ``kvsnap build --for mlx-lm`` needs none.
"""

from __future__ import annotations

import json

from kvsnap.chat import Tokenization
from kvsnap.errors import UsageError

SERVER = "mlx-lm"


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
    return Tokenization(server=SERVER, add_special_tokens=False, template_defaults=defaults)


def built_for(recorded: dict | None) -> str:
    """The server a snapshot's recorded tokenization names (``kvsnap`` when none is recorded)."""
    return str((recorded or {}).get("server") or "kvsnap")
