"""Token accounting and the cache figures of ``/v1/status``. No mlx here.

Per request, computed = prompt - cached. Engine-wide, ``computed`` is measured, not derived:
mlx-lm's BatchGenerator prompt counter (padding excluded), plus what the engine ran itself
(sequential prefill chunks, shared prefixes) and each request's last prompt token, which
mlx-lm runs in its first decode step. Tests check the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvsnap.runtime.cache.prefix import PrefixCache
from kvsnap.runtime.engine.types import RequestState

MEASURED = (
    "measured: mlx-lm BatchGenerator prompt counter + sequential prefill + 1 per started decode"
)
COUNTED = "engine count (this mlx-lm's BatchGenerator has no prompt token counter)"


def prompt_counter(gen: Any) -> int | None:
    """mlx-lm's own count of prompt tokens its BatchGenerator has run (padding excluded).

    0.32: ``_counters.prompt_tokens``, added per prefill chunk as the real lengths of the
    sequences in it (the last prompt token runs in the first decode step and is not in it).
    """
    counters = getattr(gen, "_counters", None)
    if counters is not None and hasattr(counters, "prompt_tokens"):
        return int(counters.prompt_tokens)
    legacy = getattr(gen, "_prompt_tokens_counter", None)  # an older layout, if present
    return int(legacy) if legacy is not None else None


@dataclass
class TokenAccounts:
    prompt: int = 0  # prompt tokens of every started request
    cached: int = 0  # of those, served from the prefix cache
    started_requests: int = 0
    # run by the engine itself: sequential chunks, shared prefixes, last prompt tokens
    measured: int = 0
    # what batched prefills should count: the source when mlx-lm has no counter
    batched_expected: int = 0
    counter_missing: bool = False
    _gen_base: int = 0  # the current generator's counter when it was attached
    _gen_counted: int = 0  # prompt tokens counted by generators already detached

    def start_request(self, state: RequestState, cached_tokens: int) -> None:
        """A request starts with ``cached_tokens`` of its prompt already in its cache."""
        state.cached_tokens = cached_tokens
        state.computed_tokens = state.prompt_tokens - cached_tokens
        self.started_requests += 1
        self.prompt += state.prompt_tokens
        self.cached += cached_tokens

    def ran(self, tokens: int) -> None:
        """The engine ran ``tokens`` prompt tokens itself (not through the BatchGenerator)."""
        self.measured += tokens

    def first_decode(self, state: RequestState) -> None:
        """A request's first decode step ran its last prompt token; counted once."""
        if not state.last_token_counted:
            state.last_token_counted = True
            self.measured += 1

    def expect_batched(self, suffix_tokens: int) -> None:
        """A suffix went into the BatchGenerator: it prefills all but the last token."""
        self.batched_expected += suffix_tokens - 1

    def attach(self, gen: Any) -> None:
        base = prompt_counter(gen)
        self.counter_missing = base is None
        self._gen_base = base or 0

    def detach(self, gen: Any) -> None:
        """The generator is dropped: keep what it counted."""
        counted = prompt_counter(gen)
        if counted is not None:
            self._gen_counted += counted - self._gen_base

    def computed(self, gen: Any | None) -> int:
        """Prompt tokens the model really ran, ``gen`` being the live generator (or None)."""
        if self.counter_missing:
            return self.measured + self.batched_expected
        batched = self._gen_counted
        if gen is not None:
            batched += (prompt_counter(gen) or 0) - self._gen_base
        return self.measured + batched

    def as_dict(self, gen: Any | None) -> dict:
        return {
            "prompt": self.prompt,
            "cached": self.cached,
            "computed": self.computed(gen),
            "computed_source": COUNTED if self.counter_missing else MEASURED,
        }


def reported_cached_tokens(state: RequestState, granularity: int) -> int:
    """The ``cached_tokens`` a client is told: exact, except that a partial match on a shared
    entry counts in steps of ``granularity``, and never below the request's own best match
    nor below a whole warm prompt it contains. ``granularity`` 1: exact (a server without
    keys has one trust level, and its status shows the exact counts to everyone anyway).

    max(own, whole warm, rounded shared) depends on the shared match only through its
    rounded value: a tenant comparing it with entries of its own learns nothing finer.
    Never more than the engine really reused.
    """
    cached = state.cached_tokens
    if not state.cache_shared_partial or granularity <= 1:
        return cached
    told_exactly = max(state.own_cached_tokens, state.whole_shared_tokens)
    return max(min(told_exactly, cached), cached - cached % granularity)


def cache_stats(prefix: PrefixCache | None, max_memory_mb: float) -> dict:
    """The ``cache`` object of ``/v1/status`` (zeros before the prefix cache exists)."""
    # an empty PrefixCache is falsy: test for None
    if prefix is None:
        return {
            "entry_count": 0,
            "hits": 0,
            "misses": 0,
            "hit_rate": 0.0,
            "tokens_saved": 0,
            "current_memory_mb": 0.0,
            "max_memory_mb": max_memory_mb,
            "evictions": 0,
            "lazy_loads": 0,
            "unloads": 0,
            "load_errors": 0,
        }
    st = prefix.stats
    lookups = st.hits + st.misses
    return {
        "entry_count": len(prefix),
        "hits": st.hits,
        "misses": st.misses,
        "hit_rate": round(st.hits / lookups, 4) if lookups else 0.0,
        "tokens_saved": st.tokens_saved,
        "current_memory_mb": round(prefix.current_bytes / 2**20, 3),
        "max_memory_mb": max_memory_mb,
        "evictions": st.evictions,
        "lazy_loads": st.loads,
        "unloads": st.unloads,
        "load_errors": st.load_errors,
    }
