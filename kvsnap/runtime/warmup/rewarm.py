"""The background re-warm after ``DELETE /v1/cache/prefix``, in steps small enough to serve between.

Clearing drops every request prefix at once and puts the warm set straight back as an
index (no I/O). Then, one step per engine loop turn: load one snapshot that was resident,
or run one prefill chunk of a warm prompt that has no file. A request arriving meanwhile
still hits: an indexed snapshot loads on first hit.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from kvsnap.runtime.cache.prefix import Entry, PrefixCache
from kvsnap.runtime.model.loading import LoadedModel
from kvsnap.runtime.prefill.chunked import PrefillCursor
from kvsnap.runtime.warmup.report import SnapshotCounts
from kvsnap.snapshot.codec import cache_nbytes_of

log = logging.getLogger("kvsnap.runtime.engine.engine")


@dataclass
class RewarmJob:
    # indexed warm entries to make resident again
    loads: deque[Entry] = field(default_factory=deque)
    # warm entries without a file: the old entry, and the prefill that makes it again
    prefills: deque[tuple[Entry, PrefillCursor]] = field(default_factory=deque)

    @property
    def finished(self) -> bool:
        return not self.loads and not self.prefills


def start_rewarm(prefix: PrefixCache, lm: LoadedModel) -> RewarmJob:
    """Clear ``prefix`` and re-index its warm set; returns the steps left to make it resident."""
    old = prefix.entries
    prefix.clear()
    job = RewarmJob()
    for e in old:
        if e.source == "persisted":
            continue  # a request prefix of one namespace, file-backed: cleared like the others
        if e.loader is not None:
            fresh = Entry(
                tokens=e.tokens,
                state=None,
                nbytes=e.nbytes,
                trimmable=e.trimmable,
                pinned=e.pinned,
                source="snapshot",
                name=e.name,
                key=e.key,
                loader=e.loader,
            )
            prefix.add(fresh)
            if e.resident:
                job.loads.append(fresh)
        elif e.pinned:
            job.prefills.append((e, PrefillCursor(lm, e.tokens)))
    return job


def rewarm_step(job: RewarmJob, prefix: PrefixCache, counts: SnapshotCounts) -> None:
    """One snapshot read or one prefill chunk."""
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
            prefix.add(
                Entry(
                    tokens=old.tokens,
                    state=cache,
                    nbytes=cache_nbytes_of(cache),
                    trimmable=old.trimmable,
                    pinned=True,
                    source="prefill",
                    name=old.name,
                    resident=True,
                )
            )
            counts.prefilled += 1


@dataclass
class Rewarmer:
    """The engine's re-warms: at most one runs; a clear during one only drops request
    prefixes again (coalesced, never queued). A failed step ends the re-warm, not the server."""

    rewarms: int = 0
    coalesced: int = 0
    error: str = ""  # why the last re-warm stopped early ("" if it did not)
    job: RewarmJob | None = None

    @property
    def running(self) -> bool:
        return self.job is not None

    def clear(self, prefix: PrefixCache, lm: LoadedModel, rewarm: bool) -> None:
        """Drop request prefixes; with ``rewarm``, start making the warm set resident again."""
        if self.job is not None:
            self.coalesced += 1
            prefix.drop_request_prefixes()
            return
        if not rewarm:
            prefix.clear()
            return
        self.rewarms += 1
        self.error = ""
        self.job = start_rewarm(prefix, lm)
        if self.job.finished:
            self.job = None

    def step(self, prefix: PrefixCache, counts: SnapshotCounts) -> None:
        job = self.job
        if job is None:
            return
        try:
            rewarm_step(job, prefix, counts)
        # serve on (cold for what is left) rather than die; status says why
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("[kvsnap] re-warm failed")
            self.job = None
            return
        if job.finished:
            self.job = None

    def as_dict(self) -> dict:
        return {
            "rewarms": self.rewarms,
            "rewarms_coalesced": self.coalesced,
            "rewarm_in_progress": self.running,
            "rewarm_error": self.error,
        }
