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
from kvsnap.runtime.sharding.ranks import RankGroup


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


class AgreedPromptCache(PinnedPromptCache):
    """The prompt cache of one rank of a sharded server: every eviction decided by rank 0.

    mlx_lm.server trims its cache to ``--prompt-cache-bytes`` by each rank's own bytes, and the
    ranks' bytes differ (unequal pipeline stages, or heads that do not divide evenly). Ranks
    that drop different entries then hit on one rank and miss on another: a collective that
    never completes, or a wrong answer. Here rank 0 trims by its bytes and the others drop
    exactly the entries it dropped. The generation loop calls ``trim_to`` at the same point on
    every rank (each request is shared before it runs), so the exchange is in step.
    """

    def __init__(self, ranks: RankGroup, max_size: int = 10, max_bytes: int = 1 << 63):
        super().__init__(max_size, max_bytes)
        self.ranks = ranks
        # what rank 0 evicted, as every rank applied it (tests read it)
        self.agreed_evictions = 0

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        evicted: list = []
        if self.ranks.rank == 0:
            pop = self._lru.pop

            def recording_pop():
                model, tokens = pop()
                evicted.append([list(model), list(tokens)])
                return model, tokens

            self._lru.pop = recording_pop  # type: ignore[method-assign]
            try:
                super().trim_to(n_sequences=n_sequences, n_bytes=n_bytes)
            finally:
                del self._lru.pop
        evicted = self.ranks.from_rank0(evicted)
        self.agreed_evictions += len(evicted)
        if self.ranks.rank != 0:
            for model, tokens in evicted:
                self._drop(tuple(model), tokens)

    def _drop(self, model: Any, tokens: List[int]) -> None:
        """Remove the entry rank 0 evicted (absent here too: nothing to do)."""
        try:
            entry = self._trie.pop(model, tokens)
        except (KeyError, IndexError):
            return
        if entry is None:
            return
        self._lru.remove(model, tokens)
        self._n_bytes -= entry.nbytes
        self._n_bytes_by_type[entry.cache_type] -= entry.nbytes
