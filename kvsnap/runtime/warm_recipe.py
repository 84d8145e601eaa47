"""A digest of everything that decides a warm prompt's prefix tokens, recorded in its snapshot.

At start, a warm prompt whose recipe matches a snapshot's reuses the snapshot's tokens
(read with the header) instead of rendering and tokenizing 11 probe conversations again.
The snapshot key, recomputed from those tokens, must still match: a reused recipe can never
serve a foreign snapshot. Recorded, not keyed, so existing keys stay what they are.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from kvsnap.key import canonical_json, hexdigest, package_version
from kvsnap.prompts import PROBE_CONTENTS, WarmPrompt

RECIPE_VERSION = 1  # bump when warm_prefix's algorithm changes in a way the probes do not show


@cache
def _library_versions() -> dict:
    # Installed versions cannot change under a running process; reading them costs ~1 ms each.
    return {name: package_version(name) for name in ("tokenizers", "transformers", "jinja2", "mlx-lm")}


def warm_recipe(prompt: WarmPrompt, prompt_digest: str, tokenizer_digest: str, template: Any) -> str | None:
    """None when the template can render the date: its tokens may differ tomorrow."""
    text = template if isinstance(template, str) else canonical_json(template)
    if "strftime_now" in text and "date_string" not in (prompt.chat_template_kwargs or {}):
        return None
    fields = {
        "version": RECIPE_VERSION,
        "probes": list(PROBE_CONTENTS),
        "messages": [dict(m) for m in prompt.messages],
        "prompt_digest": prompt_digest,  # template, kwargs, tools, tokenization profile
        "tokenizer": tokenizer_digest,  # the tokenizer files
        "libraries": _library_versions(),
    }
    return hexdigest(canonical_json(fields).encode())
