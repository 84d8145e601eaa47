"""The write-behind thread: persisted request prefixes go to disk off the request path.

The engine hands over a finished ``ConversationWrite`` (tensors already on the host) and goes
on; a bounded queue drops its oldest write when full, never blocking a request. Each write
runs under the store lock in the order that keeps every crash sound: the new blocks and
checkpoint (atomic each), then the record (atomic), then the record it supersedes is
removed. A kill loses at most the queued writes; it never leaves a record naming a
missing part. A stored part a record would name is checked once per process first (a bad one
is rewritten by the next write that copies it, and named by none before); a record already
there is rewritten when damaged, and only a sound one's last use is refreshed. Disk full stops
persisting with one warning. No mlx.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from kvsnap.errors import SnapshotError, StoreError
from kvsnap.snapshot.file import OutTensor, write_snapshot
from kvsnap.snapshot.format import BLOCK_KIND
from kvsnap.store.checking import PartHealth
from kvsnap.store.conversation_space import evict_to_budget, purge, sweep_orphans
from kvsnap.store.conversations import record_path, touch
from kvsnap.store.fileio import atomic_write, check_store_folders, remove_store_file
from kvsnap.store.local import Store
from kvsnap.store.paths import chain_relpaths, has_part, part_relpath
from kvsnap.store.writing import put_part

log = logging.getLogger("kvsnap.persist")
KEEPER_WAIT_S = 120.0  # a fetched record's keeper, at most (its parts are then checked)

ORPHAN_SWEEP_BYTES = 64 << 20  # superseded tails are swept once they add up to this much


@dataclass
class PartWrite:
    kind: str  # block | checkpoint
    key: str
    tensors: list[OutTensor]
    metadata: dict[str, str]
    replace: bool = False  # written over the stored one (found bad)


@dataclass
class ConversationWrite:
    key: str  # the record's
    tensors: list[OutTensor]  # its tokens
    metadata: dict[str, str]
    parts: list[PartWrite]  # those the store lacked when the engine looked
    reaches: list[tuple[str, str]]  # (kind, key) of every part the record names
    # the records this one extends (each removed once it is written)
    supersedes: tuple[str, ...] = ()
    nbytes: int = 0  # host bytes held while queued
    # records of shorter prefixes found unreadable, or whose load failed: this one serves all
    # they did (removed once it is written, if they still fail their checks, parts included)
    damaged: list[str] = field(default_factory=list)
    # with --shared-tier: the request's namespace; the record is written behind to the tier
    # once it is on disk here
    namespace: str | None = None
    # set once the tier's keeper has stored the fetched parts this record names and the
    # engine did not copy (``parts`` leaves them out): the record is written after that
    after: threading.Event | None = None

    @property
    def relpaths(self) -> set[str]:
        return {part_relpath(kind, key) for kind, key in self.reaches}


@dataclass
class WriterStats:
    queued: int = 0
    written: int = 0
    dropped: int = 0  # oldest queued writes dropped for a full queue
    skipped: int = 0  # a part vanished before the write (a gc, an eviction): not written
    failed: int = 0
    superseded: int = 0
    evicted: int = 0  # conversations removed for the disk budget
    repaired: int = 0  # bad parts and damaged records rewritten (or removed, once covered)
    disabled: str = ""  # why persisting stopped ("" while it runs)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class ConversationWriter:
    store: Store  # its own instance: the lock's depth is per object, one per thread
    max_bytes: int  # the disk budget for conversations
    max_queued: int = 32
    max_queued_bytes: int = 1 << 30
    stats: WriterStats = field(default_factory=WriterStats)
    health: PartHealth = field(default_factory=PartHealth)  # shared with the engine's persister
    _queue: deque = field(default_factory=deque)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _closing: bool = False
    _busy: bool = False
    _busy_write: bool = False  # the item under way is a write (not a touch or a purge)
    _thread: threading.Thread | None = None
    _estimate: int = 0  # conversation bytes on disk, at most (corrected by each eviction pass)
    _estimated: bool = False
    _orphans: dict = field(default_factory=dict)  # relpath -> bytes, of superseded records
    # called on this thread with each record written (--shared-tier writes it behind)
    on_written: Callable[[ConversationWrite], None] | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvsnap-persist", daemon=True)
        self._thread.start()

    # --- any thread -------------------------------------------------------------------------

    def submit(self, item: ConversationWrite) -> None:
        """Queue a write; never blocks. A full queue drops its oldest write."""
        with self._cond:
            if self._closing or self.stats.disabled:
                return
            self._queue.append(item)
            while len(self._queue) > self.max_queued or (
                len(self._queue) > 1 and self._queued_bytes() > self.max_queued_bytes
            ):
                self._queue.popleft()
                self.stats.dropped += 1
            self._cond.notify()

    def touch(self, key: str) -> None:
        """Record a hit on a persisted record (its last use, for the budget)."""
        with self._cond:
            if not self._closing:
                self._queue.append(("touch", key))
                self._cond.notify()

    def purge(self, timeout: float) -> int | None:
        """Drop queued writes and remove every conversation record (and parts only they reach);
        the number removed, or None if the writer did not get to it within ``timeout``."""
        done, box = threading.Event(), dict[str, int]()
        with self._cond:
            self._queue.clear()
            self._queue.append(("purge", done, box))
            self._cond.notify()
        if not done.wait(timeout):
            return None
        return box.get("removed", 0)

    def close(self, timeout: float) -> int:
        """Finish the queued writes within ``timeout``; returns how many were left unwritten:
        those still queued and the one under way (stuck on a slow disk or another writer's
        lock, it is not waited for past the bound)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._closing = True
            self._cond.notify()
            while (self._queue or self._busy) and self._thread is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            queued = sum(1 for item in self._queue if isinstance(item, ConversationWrite))
            under_way = int(self._busy and self._busy_write)
            left_over = queued + under_way
            self._queue.clear()
            self._cond.notify()
        if self._thread is not None:  # its last sweep of superseded tails, within the bound
            self._thread.join(max(0.0, deadline - time.monotonic()))
        if left_over:
            log.warning(
                "[kvsnap] shutdown: %d conversation write(s) not written within %.1fs "
                "(--persist-flush-timeout; %d queued, %d under way); the next turn of those "
                "conversations prefills",
                left_over,
                timeout,
                queued,
                under_way,
            )
        return left_over

    def as_dict(self) -> dict:
        with self._cond:
            self.stats.queued = sum(1 for i in self._queue if isinstance(i, ConversationWrite))
            return self.stats.as_dict()

    def _queued_bytes(self) -> int:
        return sum(i.nbytes for i in self._queue if isinstance(i, ConversationWrite))

    # --- the writer thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    break
                item = self._queue.popleft()
                self._busy, self._busy_write = True, isinstance(item, ConversationWrite)
            try:
                self._handle(item)
            except (OSError, StoreError, SnapshotError) as exc:  # the thread must outlive one
                log.warning("[kvsnap] conversation writer: %s", exc)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
        if self._orphans and not self.stats.disabled:  # closing: superseded tails go now
            self._sweep_guarded()

    def _handle(self, item) -> None:
        if isinstance(item, ConversationWrite):
            if not self._estimated:  # at the first write, not at start: start stays fast
                self._estimated = True
                self._estimate = _stored_bytes(self.store)
                self._keep_budget_guarded()  # a smaller budget than the last run's applies now
            if not self.stats.disabled:
                self._write_guarded(item)
        elif item[0] == "touch":
            touch(record_path(self.store.root, item[1]))
        elif item[0] == "purge":
            _, done, box = item
            try:
                box["removed"], _ = purge(self.store)
                self._orphans.clear()
                self._estimate = _stored_bytes(self.store)
            except (OSError, StoreError) as exc:
                log.warning("[kvsnap] removing persisted conversations failed: %s", exc)
            finally:
                done.set()

    def _write_guarded(self, item: ConversationWrite) -> None:
        try:
            self._write(item)
        except (StoreError, SnapshotError, OSError) as exc:
            cause = exc if isinstance(exc, OSError) else exc.__cause__
            if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
                self.stats.disabled = f"disk full: {exc}"
                log.warning(
                    "[kvsnap] the store's disk is full: persisting conversations stops until "
                    "restart; serving goes on (%s)",
                    exc,
                )
                with self._cond:
                    self._queue.clear()
                return
            self.stats.failed += 1
            log.warning("[kvsnap] a conversation was not persisted: %s", exc)
            return
        self._keep_budget_guarded()

    def _keep_budget_guarded(self) -> None:
        try:
            self._keep_budget()
        except (OSError, StoreError) as exc:  # the next write tries again
            log.warning("[kvsnap] keeping conversations within the disk budget failed: %s", exc)

    def _write(self, item: ConversationWrite) -> None:
        store = self.store
        if item.after is not None:  # the keeper stores parts it names (bounded, then checked)
            item.after.wait(KEEPER_WAIT_S)
        given = {(p.kind, p.key) for p in item.parts}
        stored = [(k, key) for k, key in item.reaches if (k, key) not in given]
        # Checked before the lock (a streamed read, once per process): a bad part is never
        # named; the engine copies it for the next write reaching it, which rewrites it.
        bad = [
            part
            for part in stored
            if has_part(store, *part) and not self.health.sound(store, *part)
        ]
        if bad:
            self.stats.skipped += 1
            log.warning(
                "[kvsnap] %s failed its checks: the conversation record naming it is not written; "
                "the next one reaching it rewrites it",
                store.root / part_relpath(*bad[0]),
            )
            return
        with store.lock():
            # Checked at start too, but a folder can be swapped for a link while serving.
            check_store_folders(store.root)
            # What the engine saw stored may be gone (a gc, an eviction): write nothing then.
            if any(not has_part(store, k, key) for k, key in stored):
                self.stats.skipped += 1
                return
            for n, part in enumerate(item.parts):
                there = has_part(store, part.kind, part.key)
                if part.replace or not there or not self.health.sound(store, part.kind, part.key):
                    self._estimate += put_part(
                        store, part.kind, part.key, part.tensors, part.metadata
                    )
                    self.health.mark_good([(part.kind, part.key)])
                    if there:
                        self.stats.repaired += 1
                        log.info(
                            "[kvsnap] rewrote %s, found bad",
                            store.root / part_relpath(part.kind, part.key),
                        )
                if n == 0:
                    store.fault("conversation-mid-parts")
            target = record_path(store.root, item.key)
            if self._holds(target, item):  # persisted already, and sound: a use
                touch(target)
                self._remove_damaged(item)
                return
            damaged = os.path.lexists(target)
            store.fault("conversation-before-record")
            atomic_write(
                target,
                lambda f: write_snapshot(f, item.tensors, item.metadata),
                store.fault,
                store.fsync,
            )
            self._estimate += target.stat().st_size
            self.stats.written += 1
            if damaged:
                self.stats.repaired += 1
                log.info("[kvsnap] rewrote the conversation record %s", target)
            store.fault("conversation-after-record")
            self._remove_damaged(item)
            for old in item.supersedes:
                if old != item.key:
                    self._supersede(item, old)
        if self.on_written is not None and item.namespace is not None:
            self.on_written(item)

    def _holds(self, target, item: ConversationWrite) -> bool:
        """``target`` is there, passes its checks and holds ``item``'s tokens and namespace (a
        damaged or forged one is written over, and its last use never refreshed)."""
        from kvsnap.key import pack_tokens

        if not target.exists():
            return False
        try:
            info = self.store.verify_file(target, parts=False)
        except SnapshotError as exc:
            log.warning(
                "[kvsnap] conversation record %s is damaged (%s): rewriting it", target, exc.reason
            )
            return False
        meta = item.metadata
        return (
            info.prompt_digest == meta.get("kvsnap.prompt_digest")
            and info.model_digest == meta.get("kvsnap.model_digest")
            and pack_tokens(info.tokens) == b"".join(bytes(t.data) for t in item.tensors)
        )

    def _remove_damaged(self, item: ConversationWrite) -> None:
        """Remove the records found bad that ``item``'s record serves whole, unless they pass
        every check now (rewritten meanwhile, or their bad block was just rewritten)."""
        for key in item.damaged:
            path = record_path(self.store.root, key)
            if key == item.key or not path.exists():
                continue
            try:
                self.store.verify_file(path)
                continue
            except SnapshotError:
                size = _size(path)
            try:  # its parts no other record reaches go with the next sweep (a bad one too)
                reached = set(chain_relpaths(self.store.inspect(path)))
            except SnapshotError:
                reached = set()
            if remove_store_file(path, self.store.root) is None:
                continue  # another writer removed it already
            self._estimate -= size
            self.stats.repaired += 1
            log.info(
                "[kvsnap] removed the damaged conversation record %s (a longer one serves it)",
                path,
            )
            for rel in reached - item.relpaths:
                self._orphans[rel] = _size(self.store.root / rel)

    def _supersede(self, item: ConversationWrite, key: str) -> None:
        """Replace the record ``key``, one ``item`` extends, with its whole blocks only: the
        new record serves everything it did, but another branch may continue from it (a
        regenerated or edited turn), and after a restart the disk lookup finds strict prefixes
        only. So the record up to its last full block stays (those blocks are the new record's
        too: it costs a header) and keeps that turn's last use; only the partial tail goes,
        swept later (another record may reach it). The shorter record lands before the old
        goes."""
        old = record_path(self.store.root, key)
        try:
            info = self.store.inspect(old)
        except SnapshotError:
            return  # gone already, or not readable: gc's to judge
        chain = info.chain
        if chain is None or chain.checkpoints or info.n_tokens % chain.block_tokens == 0:
            return  # a hybrid's (never superseded), or whole blocks already: it stays
        kept = self._write_whole_blocks_record(info)
        if remove_store_file(old, self.store.root) is None:
            return
        self.stats.superseded += 1
        self.store.fault("conversation-after-supersede")
        for rel in set(chain_relpaths(info)) - item.relpaths - kept:
            self._orphans[rel] = _size(self.store.root / rel)
        if sum(self._orphans.values()) >= ORPHAN_SWEEP_BYTES:
            self._sweep()

    def _write_whole_blocks_record(self, info) -> set[str]:
        """The record of ``info``'s tokens up to its last full block (none when that is 0),
        with ``info``'s last use; returns the parts it reaches."""
        from kvsnap.key import pack_tokens, tokens_digest
        from kvsnap.snapshot.cache_classes import layers_at
        from kvsnap.snapshot.format import TOKENS, header_metadata
        from kvsnap.store.conversations import record_key

        chain = info.chain
        n = info.n_tokens // chain.block_tokens * chain.block_tokens
        blocks = [b for b in chain.blocks if b[2] <= n]
        if n == 0 or not blocks or blocks[-1][2] != n:
            return set()
        tokens = list(info.tokens[:n])
        tdigest = tokens_digest(tokens)
        key = record_key(info.model_digest, info.prompt_digest, tdigest, n)
        target = record_path(self.store.root, key)
        if not target.exists():
            metadata = header_metadata(
                key=key,
                name="",
                model=info.model,
                model_digest=info.model_digest,
                prompt_digest=info.prompt_digest,
                n_tokens=n,
                tokens_digest=tdigest,
                layers=layers_at(info.layers, n),
                recorded=info.recorded,
                chain={
                    "block_tokens": chain.block_tokens,
                    "checkpoint_every": chain.checkpoint_every,
                    "blocks": [list(b) for b in blocks],
                    "checkpoints": [],
                },
                tenant=info.tenant,  # the same key's: it stays in its tenant's share
            )
            raw = pack_tokens(tokens)
            tensors = [OutTensor(TOKENS, "I32", (n,), memoryview(raw))]
            atomic_write(
                target,
                lambda f: write_snapshot(f, tensors, metadata),
                self.store.fault,
                self.store.fsync,
            )
            used = info.path.stat()
            os.utime(target, ns=(used.st_atime_ns, used.st_mtime_ns))  # that turn's last use
            self._estimate += target.stat().st_size
        return {part_relpath(BLOCK_KIND, b[0]) for b in blocks}

    def _sweep_guarded(self) -> None:
        try:
            self._sweep()
        except (OSError, StoreError) as exc:
            log.warning("[kvsnap] sweeping superseded conversation parts failed: %s", exc)

    def _sweep(self) -> None:
        freed = sweep_orphans(self.store, set(self._orphans))
        self._estimate -= freed
        self._orphans.clear()

    def _keep_budget(self) -> None:
        if self._estimate <= self.max_bytes:
            return
        if self._orphans:
            self._sweep()
        removed, self._estimate = evict_to_budget(self.store, self.max_bytes)
        self.stats.evicted += removed
        if removed:
            log.info(
                "[kvsnap] disk budget: %d least recently used conversation(s) removed", removed
            )


def _size(path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _stored_bytes(store: Store) -> int:
    """An upper bound of what conversations hold: every part and conversation record."""
    from kvsnap.store.conversations import conversation_files
    from kvsnap.store.paths import part_files

    return sum(_size(p) for p in part_files(store) + conversation_files(store.root))
