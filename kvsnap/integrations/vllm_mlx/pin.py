"""Keep kvsnap's snapshots in vllm-mlx's prefix cache while request traffic comes and goes.

vllm-mlx 0.6's ``MemoryAwarePrefixCache`` drops entries three ways: LRU eviction when a
new entry does not fit ``--cache-memory-mb`` (``_evict_lru``), prefix eviction when an
entry is stored with ``evict_prefixes=True`` (a request's prompt entry, or a hybrid
request's refreshed snapshot more than 4,096 tokens past it, evicts every entry that is
its prefix: the agent's snapshot), and ``remove`` of a chunked prefill's previous
intermediate entry (which can be the snapshot's own key). ``pin`` wraps those three on
the one cache instance so they pass over pinned token keys; everything else is vllm-mlx's.

Pinned entries count against ``--cache-memory-mb`` like any other: request entries get
what they leave. When only pinned entries are left and a request entry still does not
fit, vllm-mlx's own ``commit_prepared`` refuses that entry (it logs ``rejecting commit:
PinnedCacheFull``); the snapshots stay. ``clear`` (``DELETE /v1/cache/prefix``) still
clears everything, pinned or not: the re-warm puts the snapshots back.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

log = logging.getLogger("kvsnap.vllm_mlx")

MARK = "_kvsnap_pinned"


class PinnedCacheFull(RuntimeError):
    """Every entry left in vllm-mlx's prefix cache is a pinned snapshot; nothing can be evicted."""


def _is_strict_prefix(short: tuple, long: tuple) -> bool:
    return len(short) < len(long) and long[: len(short)] == short


class Pins:
    """The token keys pinned in one ``MemoryAwarePrefixCache`` and the wrappers that honour them."""

    def __init__(self, cache: Any):
        self.cache = cache
        self.keys: set[tuple[int, ...]] = set()
        self._evict_lru = cache._evict_lru
        self._commit_prepared = cache.commit_prepared
        self._remove = cache.remove
        self._clear = cache.clear

    # The pins change on the model's thread and are read from the event loop (status): under the
    # cache's lock.

    def add(self, tokens: Iterable[int]) -> None:
        with self.cache._memory_lock:
            self.keys.add(tuple(tokens))

    def present(self) -> int:
        """How many pinned keys the cache holds right now."""
        with self.cache._memory_lock:
            return sum(1 for k in self.keys if k in self.cache._entries)

    def nbytes(self) -> int:
        with self.cache._memory_lock:
            return sum(
                self.cache._entries[k].memory_bytes for k in self.keys if k in self.cache._entries
            )

    # --- the wrapped methods ---------------------------------------------------------

    def evict_lru(self) -> None:
        """vllm-mlx's ``_evict_lru``, over unpinned entries only (oldest first)."""
        cache = self.cache
        with cache._memory_lock:
            victim = next((k for k in cache._entries if k not in self.keys), None)
            if victim is None:
                if not cache._entries:
                    return
                raise PinnedCacheFull(
                    f"vllm-mlx's prefix cache holds only kvsnap's {len(cache._entries)} pinned "
                    f"snapshot(s) "
                    f"({cache.memory_usage_mb:.1f} of {cache.memory_limit_mb:.1f} MiB); this entry "
                    f"is not kept (raise --cache-memory-mb)"
                )
            entry = cache._entries.pop(victim)
            cache._current_memory -= entry.memory_bytes
            cache._remove_from_sorted(victim)
            cache._stats.evictions += 1
            cache._stats.entry_count = len(cache._entries)
            cache._stats.current_memory_bytes = cache._current_memory
        if getattr(cache, "_ssd_tier", None) is not None:
            cache._ssd_tier.enqueue_spill(victim, entry.cache, entry.memory_bytes)

    def commit_prepared(self, entry: Any, evict_prefixes: bool = True, **kwargs: Any) -> bool:
        """vllm-mlx's ``commit_prepared``; prefix eviction passes over pinned prefixes."""
        key = tuple(entry.tokens)
        if (
            evict_prefixes
            and key not in self.cache._entries
            and any(_is_strict_prefix(p, key) for p in self.keys)
        ):
            cache = self.cache
            with cache._memory_lock:
                for old in [
                    k
                    for k in list(cache._entries)
                    if k not in self.keys and _is_strict_prefix(k, key)
                ]:
                    dropped = cache._entries.pop(old)
                    cache._current_memory -= dropped.memory_bytes
                    cache._remove_from_sorted(old)
                    cache._stats.evictions += 1
                cache._stats.entry_count = len(cache._entries)
                cache._stats.current_memory_bytes = cache._current_memory
            evict_prefixes = False  # done above, pinned ones kept
        return self._commit_prepared(entry, evict_prefixes=evict_prefixes, **kwargs)

    def remove(self, tokens: Any, **kwargs: Any) -> bool:
        """vllm-mlx's ``remove``; a pinned key stays."""
        if tuple(tokens) in self.keys:
            log.debug(
                "[kvsnap] kept pinned snapshot of %d tokens that vllm-mlx asked to remove",
                len(tokens),
            )
            return False
        return self._remove(tokens, **kwargs)

    def clear(self) -> None:
        """vllm-mlx's ``clear``; the pins go with the entries (a re-warm pins again)."""
        with self.cache._memory_lock:
            self._clear()
            self.keys.clear()


def pin(cache: Any) -> Pins:
    """Install the pin-aware methods on this cache instance (once); returns its ``Pins``."""
    existing = getattr(cache, MARK, None)
    if existing is not None:
        return existing
    missing = [
        name
        for name in (
            "_evict_lru",
            "commit_prepared",
            "remove",
            "clear",
            "_entries",
            "_memory_lock",
            "_remove_from_sorted",
        )
        if not hasattr(cache, name)
    ]
    if missing:
        raise AttributeError(
            f"this vllm-mlx prefix cache ({type(cache).__name__}) lacks {', '.join(missing)}; "
            f"kvsnap cannot keep its snapshots from eviction"
        )
    pins = Pins(cache)
    cache._evict_lru = pins.evict_lru
    cache.commit_prepared = pins.commit_prepared
    cache.remove = pins.remove
    cache.clear = pins.clear
    setattr(cache, MARK, pins)
    return pins
