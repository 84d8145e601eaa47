"""The prefix lookup kvsnap made before the token trie: a scan over every entry, the reference
the trie's tests and its benchmark compare with."""

from __future__ import annotations

from kvsnap.prompts import common_prefix_length
from kvsnap.runtime.cache.prefix import Entry


def scan_lookup(entries: list[Entry], tokens: tuple[int, ...], namespace: str):
    """(tokens saved, pinned, loaded, entry) of the best entry for ``tokens``, or None."""
    best = None
    for e in entries:
        if e.namespace is not None and e.namespace != namespace:
            continue
        n = len(e.tokens)
        if n < len(tokens) and tokens[:n] == e.tokens:
            usable = n
        elif e.trimmable:
            usable = min(common_prefix_length((e.tokens, tokens)), len(tokens) - 1)
        else:
            continue
        if usable > 0 and (best is None or (usable, e.pinned, e.loaded) > best[:3]):
            best = (usable, e.pinned, e.loaded, e)
    return best
