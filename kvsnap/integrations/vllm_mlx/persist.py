"""``kvsnap vllm-mlx serve --kv-snapshots DIR --persist-requests``: the prefix entries vllm-mlx
keeps, written behind into the kvsnap store and read back on a hit after a restart or a crash
(docs/conversations.md#the-vllm-mlx-route). Runs on the thread that owns the model.

``PersistHooks`` wraps, over ``vllm_mlx.pin``'s, three methods of vllm-mlx's one
``MemoryAwarePrefixCache`` instance:

* ``commit_prepared`` (``store`` publishes through it): a published entry (vllm-mlx's detached,
  evaluated copy) goes to kvsnap's ``Persister`` as far as its state holds, and for a
  trimmable cache also as its prompt-only cut (the request's prompt minus its last token, a
  strict prefix of the next turn even where the reply does not re-tokenize the same). Both
  supersede the records of the turn the request continues.
* ``remove``: vllm-mlx removes its previous mid-prefill entry just before it stores the longer
  one, whose record supersedes the removed one's (written after it: a kill leaves either).
* ``fetch``: when the longest persisted record for the prompt holds more than memory matched,
  it is read, shape-checked, stored into vllm-mlx's cache and the lookup runs again.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvsnap.errors import KvsnapError

if TYPE_CHECKING:
    from kvsnap.key import ModelIdentity
    from kvsnap.runtime.cache.shapes import ModelShapes
    from kvsnap.runtime.model.loading import LoadedModel
    from kvsnap.runtime.persist.options import PersistOptions
    from kvsnap.store.local import Store

log = logging.getLogger("kvsnap.vllm_mlx")

NAMESPACE = ""  # vllm-mlx has no tenants: one namespace
LOOKUP_STATS = ("hits", "misses", "tokens_saved")  # what vllm-mlx's fetch counts
RECENT_PROMPTS = 64  # the prompts of requests in flight, for their entries' prompt-only cut


@dataclass
class Captured:
    """An entry as ``Persister.captured`` takes it."""

    tokens: tuple
    state: list
    trimmable: bool
    namespace: str = NAMESPACE


def _starts(tokens: tuple, prefix: tuple) -> bool:
    n = len(prefix)
    return n <= len(tokens) and (n == 0 or tokens[n - 1] == prefix[-1]) and tokens[:n] == prefix


def held_tokens(state: list) -> int | None:
    """How many tokens a cache holds: its first layer with an offset (containers descended
    into), or None for state without one (SSM only)."""

    layers = list(state)
    while layers:
        layer = layers.pop(0)
        if isinstance(getattr(layer, "offset", None), int):
            return layer.offset
        layers[:0] = list(getattr(layer, "caches", None) or ())  # a container's, in order
    return None


class PersistHooks:
    """The wrapped cache methods of one vllm-mlx engine and what they remember."""

    NEEDS = ("fetch", "remove", "commit_prepared", "store", "_entries", "_stats")

    # ``persister`` is the runtime's Persister; it takes ``Captured`` entries in place of the
    # runtime's own prefix-cache entries (the same fields), hence not typed as one here.
    def __init__(self, cache: Any, persister: Any, identity: ModelIdentity, shapes: ModelShapes):
        missing = [name for name in self.NEEDS if not hasattr(cache, name)]
        if missing:
            raise KvsnapError(
                f"this vllm-mlx prefix cache ({type(cache).__name__}) lacks {', '.join(missing)}; "
                f"kvsnap cannot persist its entries (tested with vllm-mlx 0.6.0)"
            )
        self.cache, self.persister = cache, persister
        self.identity, self.shapes = identity, shapes
        self._fetch, self._remove, self._commit = cache.fetch, cache.remove, cache.commit_prepared
        # > 0 while kvsnap itself inserts (snapshots, restored records).
        self.paused = 0
        # The prompts vllm-mlx looked up.
        self.recent: deque[tuple] = deque(maxlen=RECENT_PROMPTS)
        # vllm-mlx key -> (prompt-only record length or 0, entry record's).
        self.cuts: dict[tuple, tuple[int, int]] = {}
        # (key, cuts) of entries vllm-mlx just removed.
        self.removed: deque[tuple[tuple, tuple[int, int]]] = deque(maxlen=4)
        self.restored = 0
        self.capture_errors = 0

    def install(self) -> None:
        self.cache.fetch, self.cache.remove = self.fetch, self.remove
        self.cache.commit_prepared = self.commit_prepared

    def uninstall(self) -> None:
        self.cache.fetch, self.cache.remove = self._fetch, self._remove
        self.cache.commit_prepared = self._commit

    # --- the wrapped methods ---------------------------------------------------------------

    def commit_prepared(self, entry: Any, evict_prefixes: bool = True, **kwargs: Any) -> bool:
        fresh = entry.tokens not in self.cache._entries
        ok = self._commit(entry, evict_prefixes=evict_prefixes, **kwargs)
        if ok and fresh and not self.paused and entry.tokens not in self._pinned():
            try:
                self._capture(entry.tokens, entry.cache)
            except (KvsnapError, AssertionError, ValueError, TypeError, RuntimeError) as exc:
                self.capture_errors += 1  # e.g. a cache class kvsnap cannot write: serving goes on
                log.warning("[kvsnap] a vllm-mlx prefix entry is not persisted: %s", exc)
        return ok

    def remove(self, tokens: Any, **kwargs: Any) -> bool:
        key = tuple(tokens)
        cut = self.cuts.pop(key, None)
        removed = self._remove(tokens, **kwargs)
        if cut is not None:
            if removed:
                self.removed.append((key, cut))
            else:
                self.cuts[key] = cut  # pinned, or absent: nothing changed
        return removed

    def fetch(self, tokens: list) -> tuple:
        stats = {name: getattr(self.cache._stats, name, 0) for name in LOOKUP_STATS}
        cache, remaining = self._fetch(tokens)
        if self.paused:
            return cache, remaining
        prompt = tuple(tokens)
        matched = len(tokens) - len(remaining) if cache is not None else 0
        self.recent.append(prompt)
        try:
            info = self.persister.persisted_for(prompt, NAMESPACE, matched)
        except (KvsnapError, OSError) as exc:  # an unreadable conversations/: memory serves on
            log.warning("[kvsnap] persisted conversations not looked up: %s", exc)
            info = None
        if info is None or not self._restore(info):
            return cache, remaining
        vars(self.cache._stats).update(stats)  # one lookup, counted once by the second fetch
        cache, remaining = self._fetch(tokens)
        key = getattr(self.cache, "_last_matched_key", None)
        if key is not None and len(key) == info.n_tokens:
            self.cuts[key] = (info.n_tokens, info.n_tokens)  # the next turn supersedes it
        return cache, remaining

    # --- persisting ------------------------------------------------------------------------

    def _pinned(self) -> set:
        from kvsnap.integrations.vllm_mlx.pin import MARK

        pins = getattr(self.cache, MARK, None)
        return pins.keys if pins is not None else set()

    def _prompt_of(self, tokens: tuple) -> tuple | None:
        """The longest recent prompt that ``tokens`` starts with."""
        best = None
        for prompt in self.recent:
            n = len(prompt)
            if n <= len(tokens) and (best is None or n > len(best)) and _starts(tokens, prompt):
                best = prompt
        return best

    def _previous_turn(self, tokens: tuple, below: int) -> tuple | None:
        """The entry of the turn this one continues: the longest whose prompt-only cut (or
        whole record) is a prefix of ``tokens`` shorter than ``below``; its cuts with it."""
        best, best_n = None, 0
        for key, (a, b) in self.cuts.items():
            n = a or b
            if best_n < n < below and tokens[n - 1] == key[n - 1] and tokens[:n] == key[:n]:
                best, best_n = key, n
        return best

    def _capture(self, tokens: tuple, state: list) -> None:
        from kvsnap.snapshot.codec import copy_cache, is_trimmable, trim_cache

        held = held_tokens(state)
        n = len(tokens) if held is None else held
        if not 0 < n <= len(tokens):
            log.debug("[kvsnap] entry of %d tokens holds %s: not persisted", len(tokens), held)
            return
        trimmable = is_trimmable(state)
        prompt = self._prompt_of(tokens) if trimmable else None
        n_prompt = min(len(prompt) - 1, n) if prompt is not None else 0
        extends_a = extends_b = None
        previous = self._previous_turn(tokens, n_prompt or n) if trimmable else None
        if previous is not None:  # its records are superseded: this turn serves all they did
            a, b = self.cuts[previous]
            extends_a, extends_b = previous[: a or b], previous[:b]
        for i, (key, (_, rb)) in enumerate(self.removed):  # vllm-mlx's mid-prefill chain
            if len(key) < len(tokens) and _starts(tokens, key):
                extends_b = key[:rb]
                del self.removed[i]
                break
        if 0 < n_prompt < n:
            cut = trim_cache(copy_cache(state), n - n_prompt)
            self.persister.captured(Captured(tokens[:n_prompt], cut, True), _listed(extends_a))
        elif extends_b is None:
            extends_b = extends_a
        self.persister.captured(Captured(tokens[:n], state, trimmable), _listed(extends_b))
        self.persister.pump()  # the arrays are vllm-mlx's detached, evaluated copies
        self.cuts[tokens] = (n_prompt, n)
        if len(self.cuts) > len(self.cache._entries) + RECENT_PROMPTS:
            self.cuts = {k: v for k, v in self.cuts.items() if k in self.cache._entries}

    def _restore(self, info: Any) -> bool:
        """Put a persisted record into vllm-mlx's cache (checked against the model's shapes)."""
        from kvsnap.integrations.common.warm_plan import checked_state

        try:  # ValueError/RuntimeError: mlx on blocks that do not fit together (forged)
            state = checked_state(self.persister.store, info, self.identity, self.shapes)
        except (KvsnapError, OSError, ValueError, RuntimeError) as exc:
            self.persister.load_error(str(info.path), exc)  # the request prefills instead
            return False
        self.paused += 1
        try:  # evict_prefixes=False: what else memory holds stays
            stored = self.cache.store(list(info.tokens), state, evict_prefixes=False)
        finally:
            self.paused -= 1
        if not stored:  # vllm-mlx's own log line says why
            log.info(
                "[kvsnap] vllm-mlx refused a persisted conversation of %d tokens", info.n_tokens
            )
        self.restored += bool(stored)
        return stored

    def purge(self) -> int | None:
        """Remove every persisted conversation (model thread: no capture runs meanwhile)."""
        self.recent.clear()
        self.cuts.clear()
        self.removed.clear()
        return self.persister.purge()

    def as_dict(self) -> dict:
        return {
            **self.persister.as_dict(),
            "restored": self.restored,
            "capture_errors": self.capture_errors,
        }


def start_hooks(
    prefix_cache: Any,
    lm: LoadedModel,
    identity: ModelIdentity,
    store: Store,
    options: PersistOptions,
) -> tuple[PersistHooks | None, str]:
    """Open the persister on ``store`` and install the hooks, or None and why not (vllm-mlx
    serves on, persisting nothing)."""
    from kvsnap.runtime.cache.shapes import ModelShapes
    from kvsnap.runtime.persist.persister import start_persister

    persister, note = start_persister(options, store, lm, identity)
    if persister is None:
        return None, note
    try:
        hooks = PersistHooks(prefix_cache, persister, identity, ModelShapes(lm))
    except KvsnapError as exc:
        persister.close()
        log.warning("[kvsnap] %s", exc)
        return None, str(exc)
    hooks.install()
    return hooks, ""


def _listed(extends: tuple | None) -> tuple[tuple, ...]:
    """The records a capture supersedes, as the persister takes them (none, or that one)."""
    return (extends,) if extends else ()
