"""What conversations cost on disk, and freeing it: the budget's LRU eviction, ``gc``'s
unused-for-a-while drop, ``DELETE /v1/cache/prefix``'s purge. No mlx.

Every removal runs under the store lock and reads the chains of every record first: a block
or checkpoint goes only once no record reaches it, an agent's or a conversation's. An agent's
record that cannot be read might reach anything, so no block goes then, only records. A
conversation record that cannot be read serves no request (the lookup skips it): the budget,
the purge and gc's unused-for drop remove it first and read the chains again.
"""

from __future__ import annotations

import stat
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from kvsnap.errors import SnapshotError
from kvsnap.store.conversations import conversation_files
from kvsnap.store.fileio import fsync_dir
from kvsnap.store.local import Store
from kvsnap.store.parts import chain_relpaths


@dataclass
class ConversationRecord:
    path: Path
    last_use: float  # the record's mtime: written, or touched on a hit
    size: int
    parts: list[str]  # store-relative block and checkpoint paths it reaches


@dataclass
class Reach:
    """Which parts the records reach: agents' as a set, conversations' counted."""

    agent_parts: set[str] = field(default_factory=set)
    records: list[ConversationRecord] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    complete: bool = True  # False: a record could not be read; no part may be removed
    unreadable: list[Path] = field(default_factory=list)  # conversation records not read

    def part_bytes(self, store: Store) -> int:
        """Bytes of the parts only conversations reach."""
        return sum(_size(store.root / rel) for rel in self.counts if rel not in self.agent_parts)

    def nbytes(self, store: Store) -> int:
        """What the conversations cost: their records and the parts only they reach."""
        return sum(r.size for r in self.records) + self.part_bytes(store)


def read_reach(store: Store) -> Reach:
    """Every record's chain (headers only; the caller holds the lock)."""
    reach = Reach()
    for path in store.snapshot_files():
        try:
            reach.agent_parts.update(chain_relpaths(store.inspect(path)))
        except SnapshotError:
            reach.complete = False
    for path in conversation_files(store.root):
        try:
            st = path.stat()
            info = store.inspect(path)
        except (SnapshotError, OSError):
            reach.complete = False
            reach.unreadable.append(path)
            continue
        parts = chain_relpaths(info)
        reach.records.append(ConversationRecord(path, st.st_mtime, st.st_size, parts))
        reach.counts.update(parts)
    return reach


def remove_records(store: Store, reach: Reach, doomed: list[ConversationRecord]) -> int:
    """Remove ``doomed`` records, then every part no record reaches any more; returns the bytes
    freed (the caller holds the lock)."""
    freed, folders = 0, set()
    for record in doomed:
        try:
            record.path.unlink()
        except FileNotFoundError:
            continue  # another writer removed it already
        freed += record.size
        folders.add(record.path.parent)
        reach.records.remove(record)
        reach.counts.subtract(record.parts)
    if reach.complete:
        for rel, count in list(reach.counts.items()):
            if count <= 0:
                del reach.counts[rel]
                if rel not in reach.agent_parts:
                    freed += _unlink(store.root / rel, folders)
    for folder in folders:
        fsync_dir(folder, store.fsync)
    return freed


def drop_unreadable(store: Store, reach: Reach, paths: list[Path]) -> tuple[Reach, int, int]:
    """Remove the unreadable conversation records ``paths`` and read the chains again (complete
    once no other record is unreadable); returns (that reach, records removed, bytes freed).
    What they alone reached stays, unreached, for ``kvsnap gc``. The caller holds the lock."""
    if not paths:
        return reach, 0, 0
    folders: set[Path] = set()
    n = freed = 0
    for path in paths:
        try:
            st = path.lstat()
            if stat.S_ISDIR(st.st_mode):
                continue  # not a record a writer made: verify names it, nothing here removes it
            path.unlink()
        except OSError:  # gone meanwhile, or not ours to remove: it stays, and stays unread
            continue
        n, freed = n + 1, freed + st.st_size
        folders.add(path.parent)
    for folder in folders:
        fsync_dir(folder, store.fsync)
    return read_reach(store), n, freed


def evict_to_budget(store: Store, max_bytes: int, low_water: float = 0.9) -> tuple[int, int]:
    """Over ``max_bytes``, unreadable conversation records go first (they serve nothing and stop
    every block removal), then the least recently used conversations until the rest fit in
    ``low_water`` of it (so the next pass is not one write away); returns (records removed,
    bytes the conversations hold after)."""
    with store.lock():
        reach = read_reach(store)
        total = reach.nbytes(store) + sum(_size(p) for p in reach.unreadable)
        if total <= max_bytes:
            return 0, total
        reach, n_bad, _ = drop_unreadable(store, reach, reach.unreadable)
        total = reach.nbytes(store)
        if total <= max_bytes:
            return n_bad, total
        doomed, left, counts = [], total, reach.counts.copy()
        for record in sorted(reach.records, key=lambda r: r.last_use):
            if left <= max_bytes * low_water:
                break
            doomed.append(record)
            only_here = [
                rel for rel in record.parts if counts[rel] == 1 and rel not in reach.agent_parts
            ]
            left -= record.size + sum(_size(store.root / rel) for rel in only_here)
            counts.subtract(record.parts)
        freed = remove_records(store, reach, doomed)
        return n_bad + len(doomed), total - freed


def drop_unused(store: Store, older_than_s: float, apply: bool) -> tuple[list[Path], int]:
    """Conversations unused for ``older_than_s`` seconds, unreadable ones included (and parts
    only they reach): what would go, or (``apply``) what went, and the bytes."""
    with store.lock():
        reach = read_reach(store)
        cutoff = time.time() - older_than_s
        bad = [p for p in reach.unreadable if _mtime(p) < cutoff]
        paths = bad + [r.path for r in reach.records if r.last_use < cutoff]
        if not apply:
            return paths, sum(_size(p) for p in paths)
        reach, _, freed = drop_unreadable(store, reach, bad)
        doomed = [r for r in reach.records if r.last_use < cutoff]
        return paths, freed + remove_records(store, reach, doomed)


def purge(store: Store) -> tuple[int, int]:
    """Every conversation record, unreadable ones too, and the parts only they reach;
    (records, bytes)."""
    with store.lock():
        reach = read_reach(store)
        reach, n_bad, freed = drop_unreadable(store, reach, reach.unreadable)
        n = len(reach.records)
        return n_bad + n, freed + remove_records(store, reach, list(reach.records))


def sweep_orphans(store: Store, candidates: set[str]) -> int:
    """Remove those of ``candidates`` (parts a superseded record reached) that no record
    reaches now; returns the bytes freed."""
    with store.lock():
        reach = read_reach(store)
        if not reach.complete:
            return 0
        folders: set[Path] = set()
        freed = sum(
            _unlink(store.root / rel, folders)
            for rel in candidates
            if reach.counts[rel] <= 0 and rel not in reach.agent_parts
        )
        for folder in folders:
            fsync_dir(folder, store.fsync)
        return freed


@dataclass
class ConversationStats:
    count: int
    nbytes: int
    oldest_use: float | None
    newest_use: float | None


def conversation_stats(store: Store) -> ConversationStats:
    """For ``kvsnap ls`` (no lock: a read)."""
    reach = read_reach(store)
    uses = [r.last_use for r in reach.records]
    return ConversationStats(
        len(reach.records),
        reach.nbytes(store),
        min(uses, default=None),
        max(uses, default=None),
    )


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return float("inf")  # cannot tell its last use: never "unused"


def _unlink(path: Path, folders: set[Path]) -> int:
    try:
        size = path.stat().st_size
        path.unlink()
    except FileNotFoundError:
        return 0
    folders.add(path.parent)
    return size
