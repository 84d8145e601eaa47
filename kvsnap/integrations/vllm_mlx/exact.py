"""A prefix-cache hit that covers the whole prompt, reused instead of dropped.

vllm-mlx 0.6's ``MemoryAwarePrefixCache.fetch`` answers a prompt it holds whole (an
``exact`` entry, or a longer ``supersequence`` entry trimmed to it) with nothing left to
prefill, and its scheduler then drops that cache and prefills the whole prompt (it cannot
tell an entry that stops one token short of its key from one that covers it). So an agent's
second session with the same prompt as the first (same folder, same day) reused nothing,
while the warm snapshot it could have used sat in the cache.

``ExactHits`` wraps that one cache instance's ``fetch``: such a hit comes back as a prefix
hit of all but the prompt's last token, which the scheduler then prefills (kvsnap serve's
rule). Where every layer can be trimmed, the state is trimmed by one token (a copy, by
vllm-mlx's own ``_trim_cache_offset``; the entry is untouched), or taken as it is when it
already stops one short. Where a layer cannot be trimmed (SSM / linear-attention state,
hybrid models), the lookup runs again for the prompt without its last token: the longest
entry that is a strict prefix of the prompt (an agent's warm snapshot, captured exactly at
its prefix) is reused and the rest prefilled; with none, the prompt is prefilled in full,
as vllm-mlx does.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from kvsnap.integrations.vllm_mlx.persist import LOOKUP_STATS, held_tokens

log = logging.getLogger("kvsnap.vllm_mlx")

MARK = "_kvsnap_exact_hits"
FULL_MATCHES = ("exact", "supersequence")  # vllm-mlx's match types that leave nothing to prefill
REUSED_AS = "prefix"  # the match type the scheduler then sees: it takes the remaining token


class ExactHits:
    """The wrapped ``fetch`` of one vllm-mlx prefix cache."""

    def __init__(
        self,
        cache: Any,
        trimmable: Callable[[Any], bool],
        trim: Callable[[list, int], list],
    ):
        self.cache = cache
        self._fetch = cache.fetch
        self._trimmable = trimmable
        self._trim = trim
        self.trimmed = 0  # full hits reused by trimming one token
        self.stepped_back = 0  # full hits on untrimmable state, served from a strict prefix

    def _counts(self) -> dict:
        return {name: getattr(self.cache._stats, name, 0) for name in LOOKUP_STATS}

    def fetch(self, tokens: list) -> tuple:
        before = self._counts()
        state, remaining = self._fetch(tokens)
        kind = getattr(self.cache, "_last_match_type", None)
        if state is None or remaining or kind not in FULL_MATCHES or len(tokens) < 2:
            return state, remaining
        n = len(tokens)
        if all(self._trimmable(layer) for layer in state):
            held = held_tokens(state)
            if held == n:
                state = self._trim(state, 1)
            elif held != n - 1:
                return state, remaining  # vllm-mlx's own handling: a full prefill
            self.cache._last_match_type = REUSED_AS
            self.cache._stats.tokens_saved = before["tokens_saved"] + n - 1
            self.trimmed += 1
            return state, list(tokens[-1:])
        # Untrimmable: the longest strict prefix instead, counted as one lookup.
        vars(self.cache._stats).update(before)
        state, remaining = self._fetch(list(tokens[:-1]))
        if state is None:
            return None, list(tokens)
        self.cache._last_match_type = REUSED_AS
        self.stepped_back += 1
        return state, [*remaining, tokens[-1]]


def reuse_exact_hits(cache: Any) -> ExactHits | None:
    """Install ``ExactHits`` on this vllm-mlx prefix cache (once); None, with a warning, where
    this vllm-mlx lacks what it needs."""
    existing = getattr(cache, MARK, None)
    if existing is not None:
        return existing
    try:
        from vllm_mlx.memory_cache import _is_cache_layer_trimmable, _trim_cache_offset
    except ImportError as exc:
        log.warning("[kvsnap] %s: a request equal to a cached prompt is prefilled in full", exc)
        return None
    missing = [name for name in ("fetch", "_stats") if not hasattr(cache, name)]
    if missing:
        log.warning(
            "[kvsnap] this vllm-mlx prefix cache lacks %s: a request equal to a cached prompt is "
            "prefilled in full",
            ", ".join(missing),
        )
        return None
    hits = ExactHits(cache, _is_cache_layer_trimmable, _trim_cache_offset)
    cache.fetch = hits.fetch
    setattr(cache, MARK, hits)
    return hits
