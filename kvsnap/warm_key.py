"""The one owner of "warm prompt -> prefix tokens, prompt digest, snapshot key", and the warm
recipe: a digest of everything that decides a warm prompt's prefix tokens, recorded in its
snapshot.

Build, kvsnap serve's warm-up and the vllm-mlx / mlx-lm warm plans all call ``warm_key``, so a
key built for one server is the key the same server looks up at start.

At start, a warm prompt whose recipe matches a snapshot's reuses the snapshot's tokens
(read with the header) instead of rendering and tokenizing 11 probe conversations again.
The snapshot key, recomputed from those tokens, must still match: a reused recipe can never
serve a foreign snapshot. Recorded, not keyed, so existing keys stay what they are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from kvsnap.chat import ChatTokenizer, Tokenization, resolve_chat_template
from kvsnap.key import (
    ModelIdentity,
    canonical_json,
    hexdigest,
    package_version,
    prompt_identity,
    snapshot_key,
)
from kvsnap.prompts import PROBE_CONTENTS, WarmPrefix, WarmPrompt, warm_prefix

RECIPE_VERSION = 1  # bump when warm_prefix's algorithm changes in a way the probes do not show


@dataclass(frozen=True)
class WarmKey:
    """A warm prompt as one server tokenizes it."""

    tokens: tuple[int, ...]
    prompt_digest: str  # template, kwargs, tools and the server's tokenization profile
    key: str  # the snapshot key: model identity, prompt digest, tokens
    template: Any  # the resolved chat template the digest covers
    prefix: WarmPrefix | None = None  # coverage and warnings; None when a recipe was reused

    @property
    def recipe_reused(self) -> bool:
        return self.prefix is None


def warm_key(
    tokenizer: ChatTokenizer,
    identity: ModelIdentity,
    prompt: WarmPrompt,
    tokenization: Tokenization | None = None,
    by_recipe: Mapping[str, Any] | None = None,
) -> WarmKey:
    """``prompt``'s warm-prefix tokens, prompt digest and key as ``tokenization``'s server
    (None: kvsnap's own) would see them. ``by_recipe``: snapshots by their recorded recipe,
    whose tokens are reused instead of probing the template when the recipe matches."""
    template, digest = _prompt_digest(tokenizer, prompt, tokenization)
    tokens = recorded_prefix(by_recipe, prompt, digest, identity, template) if by_recipe else None
    prefix = None
    if tokens is None:
        prefix = warm_prefix(tokenizer, prompt, tokenization)
        tokens = prefix.tokens
    return WarmKey(tuple(tokens), digest, snapshot_key(identity, digest, tokens), template, prefix)


def given_tokens_key(
    tokenizer: ChatTokenizer,
    identity: ModelIdentity,
    prompt: WarmPrompt,
    tokens: Sequence[int],
    tokenization: Tokenization | None = None,
) -> WarmKey:
    """``prompt``'s digest and key for tokens made elsewhere (a prompt cache mlx-lm wrote), keyed
    as ``warm_key`` keys a warm prompt's; the tokens are taken as given, not probed."""
    template, digest = _prompt_digest(tokenizer, prompt, tokenization)
    return WarmKey(tuple(tokens), digest, snapshot_key(identity, digest, tokens), template)


def _prompt_digest(
    tokenizer: ChatTokenizer, prompt: WarmPrompt, tokenization: Tokenization | None
) -> tuple[Any, str]:
    """The template that renders ``prompt`` and the digest of everything that decides its tokens."""
    template = resolve_chat_template(tokenizer, prompt.tools)
    profile = tokenization.descriptor() if tokenization is not None else None
    return template, prompt_identity(template, prompt.chat_template_kwargs, prompt.tools, profile)


def recorded_prefix(
    by_recipe: Mapping[str, Any],
    prompt: WarmPrompt,
    prompt_digest: str,
    identity: ModelIdentity,
    template: Any,
) -> tuple[int, ...] | None:
    """The warm-prefix tokens a snapshot recorded for exactly this recipe, if its key still
    follows from them (so the model matches too); None means: compute them."""
    recipe = warm_recipe(prompt, prompt_digest, identity.tokenizer, template)
    info = by_recipe.get(recipe) if recipe else None
    if info is None or not info.tokens:
        return None
    if snapshot_key(identity, prompt_digest, info.tokens) != info.key:
        return None
    return tuple(info.tokens)


@cache
def _library_versions() -> dict:
    # Installed versions cannot change under a running process; reading them costs ~1 ms each.
    names = ("tokenizers", "transformers", "jinja2", "mlx-lm")
    return {name: package_version(name) for name in names}


def warm_recipe(
    prompt: WarmPrompt, prompt_digest: str, tokenizer_digest: str, template: Any
) -> str | None:
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
