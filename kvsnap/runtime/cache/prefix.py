"""The in-memory prefix cache policy: pinned warm entries, an LRU of request prefixes, a byte
budget.

No mlx here: cache states are opaque values, copied and trimmed through the two functions
the engine passes in, so the policy is testable without a model. Every fetch returns a
private copy; the stored state is never handed out.

Entries:
- pinned: a warm prompt's prefix; never removed from the index (``clear`` aside).
- resident: kept in memory for good (warm entries loaded within the budget at start).
- loader: a snapshot file backs the entry; it loads on first hit and, when not resident,
  may be unloaded again under budget pressure (it stays indexed).
Under pressure the least recently used non-resident loaded entries go first: request
prefixes are dropped, snapshot-backed ones only unloaded.

Namespaces: warm entries (``namespace=None``) are the operator's and every request may use
them; a request prefix belongs to the namespace of the request that made it (its API key
and ``cache_salt``) and only requests of that namespace ever match it.

Lookups walk one token trie per namespace (``cache.trie``), so their cost does not grow with
the number of entries; ``_entries`` and the tries change together, only in ``_index`` and
``_unindex``, and an indexed entry's state changes only in ``_set_state``.

No file I/O under the lock: a lazy snapshot load runs with the lock released, so status
and admin calls (taken on the server's event loop) never wait on a disk read.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from kvsnap.runtime.cache.trie import TokenTrie

CopyFn = Callable[[Any], Any]
SizedCopyFn = Callable[[Any, int], Any]  # (state, tokens the request adds) -> private copy
TrimFn = Callable[[Any, int], Any]
HeadCopyFn = Callable[[Any, int, int], Any]  # (state, tokens kept, tokens added) -> copy
LoadFn = Callable[[], tuple[Any, int]]
LoadErrorFn = Callable[["Entry", BaseException], None]
CheckFn = Callable[[Any], "str | None"]


class UnusableState(ValueError):
    """A cached state that cannot serve this model (its shapes, or its copy failed)."""

    def __init__(self, where: str, reason: str):
        super().__init__(f"{where}: {reason}")
        self.path, self.reason = where, reason


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
    resident: bool = False
    namespace: str | None = None  # None: shared (warm); else the owning request namespace
    # a checkpoint inside a warm prompt: a hit on it is a partial match of that prompt
    inner: bool = False
    # where its record's blocks end (a stored snapshot's): a conversation cut there shares them
    block_ends: tuple[int, ...] = ()
    # a prompt + reply entry: where the prompt's entry (persisted beside it) ends; 0: none
    prompt_end: int = 0

    @property
    def slot(self) -> tuple:
        return (self.namespace, self.tokens)

    @property
    def loaded(self) -> bool:
        return self.state is not None

    def read(self) -> tuple[Any, int]:
        """The state and size its ``loader`` reads (an entry only indexed always has one)."""
        if self.loader is None:
            raise ValueError(f"prefix entry {self.name or self.key!r} has no file to load from")
        return self.loader()


@dataclass(frozen=True)
class Match:
    entry: Entry
    n_cached: int  # tokens reused; < len(request)


@dataclass
class PrefixStats:
    hits: int = 0
    misses: int = 0
    tokens_saved: int = 0
    evictions: int = 0  # request prefixes dropped for the budget
    unloads: int = 0  # snapshot-backed entries unloaded for the budget (still indexed)
    loads: int = 0  # snapshot-backed entries loaded on first hit
    load_errors: int = 0


@dataclass
class PrefixCache:
    max_bytes: int
    copy_state: CopyFn
    trim_state: TrimFn
    # Exceptions a loader may raise for a bad file: the entry is dropped and the
    # lookup falls back to the next best entry (or a cold prefill).
    load_errors: tuple[type[BaseException], ...] = ()
    on_load_error: LoadErrorFn | None = None
    # Why a state cannot serve this model (None: it can): checked on every copy handed out, so
    # a bad entry is dropped and the request served from the next best one, never failing a batch.
    check_state: CheckFn | None = None
    # The engine's copy, told how many tokens the request adds so the copy has room for them
    # and they are written in place (None: ``copy_state``).
    copy_with_room: SizedCopyFn | None = None
    # The engine's copy of a trimmable entry's first n tokens with room for the request's: a
    # partial match copies only what it uses (None: the whole entry copied, then trimmed).
    copy_head: HeadCopyFn | None = None
    stats: PrefixStats = field(default_factory=PrefixStats)
    _entries: dict[tuple, Entry] = field(default_factory=dict)  # (namespace, tokens) -> entry
    # namespace -> its entries' trie
    _tries: dict[str | None, TokenTrie] = field(default_factory=dict)
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
        with self._lock:
            return len(self._entries)

    def add(self, entry: Entry) -> bool:
        """Insert or replace; returns whether the entry is in the cache afterwards.

        A request prefix that cannot fit in the budget (after evicting older ones) is
        refused; a pinned entry is never replaced by an unpinned one.
        """
        with self._lock:
            old = self._entries.get(entry.slot)
            if old is not None and old.pinned and not entry.pinned:
                return False  # never demote a warm entry to an evictable one
            shared = self._entries.get((None, entry.tokens))
            if entry.namespace is not None and shared is not None:
                return False  # a warm entry already holds exactly these tokens for everyone
            entry.last_used = next(self._clock)
            self._index(entry)
            if entry.loaded and not entry.resident:
                self._evict_to_budget(keep=entry)
                if self.current_bytes > self.max_bytes and entry.loaded and self._evictable(entry):
                    self._drop(entry)  # it alone does not fit
            return entry.slot in self._entries

    @staticmethod
    def _evictable(e: Entry) -> bool:
        return e.loaded and not e.resident and (e.loader is not None or not e.pinned)

    def _drop(self, e: Entry) -> None:
        """Free an entry's memory: unload a snapshot-backed one, forget a request prefix."""
        if e.loader is not None:
            self._set_state(e, None)
            self.stats.unloads += 1
        else:
            self._unindex(e)
            self.stats.evictions += 1

    def _index(self, entry: Entry) -> None:
        old = self._entries.get(entry.slot)
        if old is not None:
            self._unindex(old)
        self._entries[entry.slot] = entry
        self._tries.setdefault(entry.namespace, TokenTrie()).insert(entry)

    def _unindex(self, entry: Entry) -> None:
        del self._entries[entry.slot]
        trie = self._tries[entry.namespace]
        trie.remove(entry)
        if not len(trie) and entry.namespace is not None:
            del self._tries[entry.namespace]  # a namespace's trie lives as long as its entries

    def _set_state(self, entry: Entry, state: Any) -> None:
        trie = self._tries.get(entry.namespace)
        if trie is not None:
            trie.set_loaded(entry, state is not None)
        entry.state = state

    def _evict_to_budget(self, keep: Entry | None = None) -> None:
        over = self.current_bytes - self.max_bytes
        if over <= 0:
            return
        victims = sorted(
            (e for e in self._entries.values() if self._evictable(e) and e is not keep),
            key=lambda e: e.last_used,
        )
        for victim in victims:
            if over <= 0:
                break
            over -= victim.nbytes
            self._drop(victim)

    def clear(self) -> int:
        with self._lock:
            n = len(self._entries)
            self._entries.clear()
            self._tries.clear()
            return n

    def discard(self, entry: Entry) -> None:
        with self._lock:
            if self._entries.get(entry.slot) is entry:
                self._unindex(entry)

    def supersede(self, entry: Entry, older: tuple[int, ...]) -> bool:
        """Forget the request prefix of ``entry``'s namespace holding ``older``, a strict prefix
        of ``entry``'s tokens, when ``entry`` is trimmable and in the cache: it serves every
        request the older one did (a partial match is trimmed). Returns whether one went."""
        with self._lock:
            old = self._entries.get((entry.namespace, older))
            if (
                old is None
                or old is entry
                or not entry.trimmable
                or self._entries.get(entry.slot) is not entry
                or old.source != "request"
                or old.pinned
                or old.loader is not None
                or not 0 < len(older) < len(entry.tokens)
                or entry.tokens[: len(older)] != older
            ):
                return False
            self._unindex(old)
            return True

    def drop_request_prefixes(self) -> int:
        """Forget every request prefix: those no warm prompt or snapshot file backs, and
        persisted ones (a conversation record backs them); returns how many."""
        with self._lock:
            doomed = [
                e
                for e in self._entries.values()
                if not e.pinned and (e.loader is None or e.source == "persisted")
            ]
            for e in doomed:
                self._unindex(e)
            return len(doomed)

    # --- lookup ----------------------------------------------------------------

    def lookup(
        self, tokens: Sequence[int], namespace: str = "", shared: bool = True
    ) -> Match | None:
        """The entry that saves the most tokens; strict prefix only, trimming where allowed.

        At least one request token is always left to compute, so a prompt equal to an
        untrimmable entry falls back to a shorter entry (or a cold prefill). There is no
        minimum length: one shared token is a hit. Only shared entries and those of
        ``namespace`` are candidates (only the latter with ``shared=False``).
        """
        tokens = tuple(tokens)
        with self._lock:
            tries = (self._tries.get(None) if shared else None, self._tries.get(namespace))
            found = [t.best(tokens) for t in tries if t is not None]
        best = max(
            (c for c in found if c is not None), key=lambda c: (c.usable, c.rank), default=None
        )
        if best is None:
            return None
        return Match(best.entry, best.usable)

    def shared_ends(self, tokens: Sequence[int]) -> list[int]:
        """The lengths of the shared (warm) entries that are whole prefixes of ``tokens``, and
        where their records' blocks end: cut there, a conversation starting with one of them
        names that record's blocks instead of copying their tokens into blocks of its own."""
        tokens = tuple(tokens)
        with self._lock:
            trie = self._tries.get(None)
            ends = trie.entry_ends(tokens) if trie is not None else []
            return sorted(
                {e for n in ends for e in (n, *self._entries[(None, tokens[:n])].block_ends)}
            )

    def whole_shared_prefix(self, tokens: Sequence[int]) -> int:
        """The length of the longest warm prompt ``tokens`` contain whole (a checkpoint inside
        one does not count: a hit on it is a partial match); 0 when none."""
        tokens = tuple(tokens)
        with self._lock:
            trie = self._tries.get(None)
            ends = trie.entry_ends(tokens) if trie is not None else []
            return max((n for n in ends if not self._entries[(None, tokens[:n])].inner), default=0)

    def fetch(
        self, tokens: Sequence[int], namespace: str = "", count: bool = True
    ) -> tuple[Any, int, Match | None]:
        """A private cache state for ``tokens`` and how many tokens it already holds.

        ``count``: a request's lookup, counted in ``stats`` (hits, misses, tokens saved); the
        engine's own lookups (a shared prefix computed for a batch) are not requests.

        A snapshot that fails to load is dropped from the index (reported through
        ``on_load_error``) and the next best entry is tried.
        """
        while True:
            with self._lock:
                match = self.lookup(tokens, namespace)
                if match is None:
                    self.stats.misses += 1 if count else 0
                    return None, 0, None
                if match.entry.loaded:
                    served = self._serve_checked(match, count, len(tokens))
                    if served is not None:
                        return served
                    continue
            if self.load(match.entry):
                with self._lock:
                    if match.entry.loaded and self._entries.get(match.entry.slot) is match.entry:
                        served = self._serve_checked(match, count, len(tokens))
                        if served is not None:
                            return served
            # Failed, unusable, or cleared while it loaded: look again.

    def load(self, entry: Entry, resident: bool = False) -> bool:
        """Load an indexed entry from its file, outside the lock; False if the file is bad
        (the entry is then dropped from the index and reported). ``resident``: a warm
        entry loaded for good (a re-warm), not a first-hit load."""
        if entry.loaded:
            return True
        try:
            state, nbytes = entry.read()
        except self.load_errors as exc:
            with self._lock:
                if self._entries.get(entry.slot) is entry:
                    self._unindex(entry)
                self.stats.load_errors += 1
            if self.on_load_error is not None:
                self.on_load_error(entry, exc)
            return False
        with self._lock:
            if self._entries.get(entry.slot) is not entry:
                return False  # cleared or replaced meanwhile: its state is not wanted
            self._set_state(entry, state)
            entry.nbytes = nbytes
            entry.resident = entry.resident or resident
            self.stats.loads += 0 if resident else 1
            self._evict_to_budget(keep=entry)
        return True

    def _serve_checked(
        self, match: Match, count: bool, n_request: int
    ) -> tuple[Any, int, Match] | None:
        """A private copy of the match for a request of ``n_request`` tokens, or None when the
        entry's state cannot be used: it is then dropped from the index and reported like a bad
        file, and only this lookup moves on."""
        entry = match.entry
        try:
            state = self._copy(match, n_request - match.n_cached)
            why = self.check_state(state) if self.check_state is not None else None
        except (
            ValueError,
            RuntimeError,
            TypeError,
            IndexError,
        ) as exc:  # how mlx refuses bad shapes
            why = f"its copy failed ({type(exc).__name__}: {exc})"
        if why is None:
            entry.last_used = next(self._clock)
            if count:
                self.stats.hits += 1
                self.stats.tokens_saved += match.n_cached
            return state, match.n_cached, match
        if self._entries.get(entry.slot) is entry:
            self._unindex(entry)
        self.stats.load_errors += 1
        if self.on_load_error is not None:
            self.on_load_error(
                entry, UnusableState(entry.name or entry.key or "cached prefix", why)
            )
        return None

    def _copy(self, match: Match, adds: int) -> Any:
        entry = match.entry
        if self.copy_head is not None and match.n_cached < len(entry.tokens):
            return self.copy_head(entry.state, match.n_cached, adds)
        if self.copy_with_room is not None:
            state = self.copy_with_room(entry.state, adds)
        else:
            state = self.copy_state(entry.state)
        if match.n_cached < len(entry.tokens):
            state = self.trim_state(state, len(entry.tokens) - match.n_cached)
        return state
