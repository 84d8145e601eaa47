"""The background re-warm after ``DELETE /v1/cache/prefix``, in steps small enough to serve between.

Clearing drops every request prefix at once and puts the warm set straight back as an
index (no I/O). Then, one step per engine loop turn: load one snapshot that was resident,
or run one prefill chunk of a warm prompt that has no file. A request arriving meanwhile
still hits: an indexed snapshot loads on first hit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvsnap.runtime.prefill import PrefillCursor
from kvsnap.runtime.prefix import Entry, PrefixCache


@dataclass
class RewarmJob:
    loads: deque = field(default_factory=deque)  # indexed warm entries to make resident again
    prefills: deque = field(default_factory=deque)  # (old entry, PrefillCursor)

    @property
    def finished(self) -> bool:
        return not self.loads and not self.prefills


def start_rewarm(prefix: PrefixCache, lm: Any) -> RewarmJob:
    """Clear ``prefix`` and re-index its warm set; returns the steps left to make it resident."""
    old = prefix.entries
    prefix.clear()
    job = RewarmJob()
    for e in old:
        if e.loader is not None:
            fresh = Entry(tokens=e.tokens, state=None, nbytes=e.nbytes, trimmable=e.trimmable, pinned=e.pinned, source="snapshot", name=e.name, key=e.key, loader=e.loader)
            prefix.add(fresh)
            if e.resident:
                job.loads.append(fresh)
        elif e.pinned:
            job.prefills.append((e, PrefillCursor(lm, e.tokens)))
    return job


def rewarm_step(job: RewarmJob, prefix: PrefixCache, counts: Any) -> None:
    """One snapshot read or one prefill chunk."""
    from kvsnap.snapshot.codec import cache_nbytes_of

    if job.loads:
        entry = job.loads.popleft()
        if prefix.load(entry, resident=True):
            counts.loaded += 1
        return
    if job.prefills:
        old, cursor = job.prefills[0]
        cursor.step()
        if cursor.finished:
            job.prefills.popleft()
            cache = cursor.cache
            prefix.add(Entry(tokens=old.tokens, state=cache, nbytes=cache_nbytes_of(cache), trimmable=old.trimmable, pinned=True, source="prefill", name=old.name, resident=True))
            counts.prefilled += 1
