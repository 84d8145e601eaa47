"""The in-memory prefix cache policy: pinned warm entries, an LRU of request prefixes, a byte budget.

No mlx here: cache states are opaque values, copied and trimmed through the two functions
the engine passes in, so the policy is testable without a model. Every fetch returns a
private copy; the stored state is never handed out.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

CopyFn = Callable[[Any], Any]
TrimFn = Callable[[Any, int], Any]
LoadFn = Callable[[], tuple[Any, int]]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class Entry:
    tokens: tuple[int, ...]
    state: Any  # None while only indexed (a snapshot not yet loaded)
    nbytes: int
    trimmable: bool
    pinned: bool
    source: str  # snapshot | prefill | request
    name: str = ""
    key: str = ""
    loader: LoadFn | None = None
    last_used: int = 0

    @property
    def loaded(self) -> bool:
        return self.state is not None


@dataclass(frozen=True)
class Match:
    entry: Entry
    n_cached: int  # tokens reused; < len(request)


@dataclass
class PrefixStats:
    hits: int = 0
    misses: int = 0
    tokens_saved: int = 0
    evictions: int = 0
    loads: int = 0


@dataclass
class PrefixCache:
    max_bytes: int
    copy_state: CopyFn
    trim_state: TrimFn
    stats: PrefixStats = field(default_factory=PrefixStats)
    _entries: dict[tuple[int, ...], Entry] = field(default_factory=dict)
    _clock: Any = field(default_factory=itertools.count)
    _lock: threading.RLock = field(default_factory=threading.RLock)

    # --- contents ------------------------------------------------------------

    @property
    def entries(self) -> list[Entry]:
        with self._lock:
            return list(self._entries.values())

    @property
    def current_bytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values() if e.loaded)

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, entry: Entry) -> bool:
        """Insert or replace; unpinned entries may be refused or evict older unpinned ones."""
        with self._lock:
            old = self._entries.get(entry.tokens)
            if old is not None and old.pinned and not entry.pinned:
                return False  # never demote a warm entry to an evictable one
            entry.last_used = next(self._clock)
            self._entries[entry.tokens] = entry
            if not entry.pinned:
                self._evict_to_budget(keep=entry.tokens)
                return entry.tokens in self._entries
            return True

    def _evict_to_budget(self, keep: tuple[int, ...] | None = None) -> None:
        over = self.current_bytes - self.max_bytes
        if over <= 0:
            return
        victims = sorted((e for e in self._entries.values() if not e.pinned and e.loaded), key=lambda e: e.last_used)
        for victim in victims:
            if over <= 0:
                break
            if victim.tokens == keep and len(victims) > 1:
                continue
            del self._entries[victim.tokens]
            over -= victim.nbytes
            self.stats.evictions += 1

    def clear(self) -> int:
        with self._lock:
            n = len(self._entries)
            self._entries.clear()
            return n

    # --- lookup ----------------------------------------------------------------

    def lookup(self, tokens: Sequence[int]) -> Match | None:
        """The entry that saves the most tokens; strict prefix only, trimming where allowed.

        At least one request token is always left to compute, so a prompt equal to an
        untrimmable entry falls back to a shorter entry (or a cold prefill).
        """
        tokens = tuple(tokens)
        best: Match | None = None
        with self._lock:
            for entry in self._entries.values():
                n = len(entry.tokens)
                if n < len(tokens) and tokens[:n] == entry.tokens:
                    usable = n
                elif entry.trimmable:
                    usable = min(common_prefix(entry.tokens, tokens), len(tokens) - 1)
                else:
                    continue
                if usable > 0 and (best is None or usable > best.n_cached or (usable == best.n_cached and entry.pinned and not best.entry.pinned)):
                    best = Match(entry, usable)
        return best

    def fetch(self, tokens: Sequence[int]) -> tuple[Any, int, Match | None]:
        """A private cache state for ``tokens`` and how many tokens it already holds."""
        match = self.lookup(tokens)
        with self._lock:
            if match is None:
                self.stats.misses += 1
                return None, 0, None
            entry = match.entry
            if not entry.loaded:
                entry.state, entry.nbytes = entry.loader()
                self.stats.loads += 1
            entry.last_used = next(self._clock)
            state = self.copy_state(entry.state)
            if match.n_cached < len(entry.tokens):
                state = self.trim_state(state, len(entry.tokens) - match.n_cached)
            self.stats.hits += 1
            self.stats.tokens_saved += match.n_cached
            if not entry.pinned:
                self._evict_to_budget(keep=entry.tokens)
            return state, match.n_cached, match
