"""mlx_lm.server's prompt cache with kvsnap's warm entries protected from eviction.

mlx-lm 0.32's ``LRUPromptCache`` evicts ``system`` entries last, but it does evict them:
its ``CacheOrder.pop`` takes from the ``system`` queue as soon as it is the longest one,
``--prompt-cache-bytes`` trims by bytes whatever the type, and inserting a trimmable entry
drops every entry that is its prefix. So the warm entries live beside the LRU, in a trie
of their own that no eviction path reaches: they are *protected*, never re-inserted.

A lookup asks both and takes the entry that leaves the fewest tokens to compute (the LRU
on a tie: it may hold the same prefix with the conversation's later turns). Either way the
request gets a deep copy, as mlx-lm's own lookup gives, so no request writes into a warm
entry. The warm entries count toward neither ``--prompt-cache-size`` nor
``--prompt-cache-bytes``: their memory is the store's matching snapshots (``pinned_nbytes``),
on top of those limits; ``len`` and ``nbytes`` (mlx-lm's log line) include them, as
``system`` entries.
"""

from __future__ import annotations

from typing import Any, List

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache

from kvsnap.integrations.common.warm_plan import WarmReport


def match_length(cache: LRUPromptCache, model: Any, tokens: List[int]) -> int:
    """How many of ``tokens`` ``cache.fetch_nearest_cache`` would serve from memory (no copy
    made)."""
    found = cache._trie.search(model, tokens)
    if found.exact is not None:
        return len(tokens)
    short = len(found.shorter) if found.shorter is not None else 0
    if found.longer is not None and found.common_prefix > short:
        entry = cache._trie.get(found.model, found.longer)
        if can_trim_prompt_cache(entry.prompt_cache):
            return min(len(tokens) - 1, found.common_prefix)
    return short


class PinnedPromptCache(LRUPromptCache):
    """``LRUPromptCache`` plus warm entries that no size, byte or prefix eviction removes."""

    def __init__(self, max_size: int = 10, max_bytes: int = 1 << 63):
        super().__init__(max_size, max_bytes)
        # Never trimmed: the server calls trim_to and insert_cache on this object, not on it.
        self.pinned = LRUPromptCache(max_size=1 << 62)
        self.pinned_keys: set[tuple] = set()
        # What the warm-up that filled it did (``warm_prompt_cache``).
        self.report: WarmReport | None = None

    def pin(self, model: Any, tokens: List[int], prompt_cache: List[Any]) -> None:
        """Hold ``prompt_cache`` (the state after exactly ``tokens``) for the life of the server."""
        # A plain dict trie insert: the pinned set never drops a warm prefix of another.
        entry = LRUPromptCache.CacheEntry(
            prompt_cache, sum(c.nbytes for c in prompt_cache), "system"
        )
        prev = self.pinned._trie.add(model, list(tokens), entry)
        if prev is not None:
            self.pinned._n_bytes -= prev.nbytes
        self.pinned._n_bytes += entry.nbytes
        self.pinned_keys.add((model, tuple(tokens)))

    @property
    def pinned_count(self) -> int:
        return len(self.pinned_keys)

    @property
    def pinned_nbytes(self) -> int:
        return self.pinned._n_bytes

    def fetch_nearest_cache(self, model: Any, tokens: List[int]):
        if not self.pinned_keys:
            return super().fetch_nearest_cache(model, tokens)
        lru = match_length(self, model, tokens)
        warm = match_length(self.pinned, model, tokens) if model in self.pinned._trie._trie else 0
        if warm > lru:
            return self.pinned.fetch_nearest_cache(model, tokens)
        return super().fetch_nearest_cache(model, tokens)

    def __len__(self) -> int:
        return super().__len__() + self.pinned_count

    @property
    def nbytes(self) -> int:
        return self._n_bytes + self.pinned_nbytes

    def stats_by_type(self) -> dict:
        stats = super().stats_by_type()
        system = stats.setdefault("system", {"n_sequences": 0, "n_bytes": 0})
        system["n_sequences"] += self.pinned_count
        system["n_bytes"] += self.pinned_nbytes
        return stats
