"""What conversations cost on disk, and freeing it: the budget's LRU eviction, ``gc``'s
unused-for-a-while drop, ``DELETE /v1/cache/prefix``'s purge. No mlx.

Every removal runs under the store lock and reads the chains of every record first: a block
or checkpoint goes only once no record it can read reaches it, an agent's or a conversation's.
An agent's record that cannot be read serves nothing and might reach anything (or be a newer
kvsnap's, on a shared store): the purge, gc's unused-for drop and the sweep keep every block
while one exists, but the budget cannot wait for it (that once left the budget off for good),
so the budget goes by what can be read, with a warning naming it and the fix. A conversation
record that cannot be read serves no request (the lookup skips it): the budget, the purge and
gc's unused-for drop remove it first and read the chains again.

Over the budget, records go from the tenant (API key, all its cache_salts together) holding the
most bytes, least recently used first within it (``budget_victims``): one tenant's flood evicts
its own records, never those of a tenant holding less. Nothing here follows a symbolic link
(``fileio.store_folder``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path

from kvsnap.errors import SnapshotError
from kvsnap.store.conversations import conversation_files
from kvsnap.store.fileio import check_store_folders, file_or_link, fsync_dir, remove_store_file
from kvsnap.store.local import Store
from kvsnap.store.paths import chain_relpaths

log = logging.getLogger("kvsnap.persist")


@dataclass
class ConversationRecord:
    path: Path
    last_use: float  # the record's mtime: written, or touched on a hit
    size: int
    parts: list[str]  # store-relative block and checkpoint paths it reaches
    namespace: str = ""  # its prompt digest: one per namespace (the tenant tag's), no name
    tenant: str = ""  # its kvsnap.tenant: one per API key, whatever the cache_salt; "": none

    @property
    def owner(self) -> str:
        """Who holds it for the budget: its key (every cache_salt of it), else (a keyless
        request's record, or one written before kvsnap.tenant) its namespace. The two are
        digests of different texts, so they never collide."""
        return self.tenant or self.namespace


@dataclass
class Reach:
    """Which parts the records reach: agents' as a set, conversations' counted."""

    agent_parts: set[str] = field(default_factory=set)
    records: list[ConversationRecord] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    unreadable: list[Path] = field(default_factory=list)  # conversation records not read
    unreadable_agents: list[SnapshotError] = field(default_factory=list)  # naming each one

    @property
    def complete(self) -> bool:
        """Every record was read."""
        return not self.unreadable and not self.unreadable_agents

    def part_bytes(self, store: Store) -> int:
        """Bytes of the parts only conversations reach."""
        return sum(_size(store.root / rel) for rel in self.counts if rel not in self.agent_parts)

    def nbytes(self, store: Store) -> int:
        """What the conversations cost: their records and the parts only they reach."""
        return sum(r.size for r in self.records) + self.part_bytes(store)


def read_reach(store: Store) -> Reach:
    """Every record's chain (headers only; the caller holds the lock). StoreError when a store
    folder is a symbolic link: every removal reads this first, so none starts then."""
    check_store_folders(store.root)
    reach = Reach()
    for path in store.snapshot_files():
        if not file_or_link(path):
            continue
        try:
            reach.agent_parts.update(chain_relpaths(store.inspect(path)))
        except SnapshotError as exc:
            reach.unreadable_agents.append(exc)
    for path in conversation_files(store.root):
        if not file_or_link(path):
            continue
        try:
            st = path.stat()
            info = store.inspect(path)
        except (SnapshotError, OSError):
            reach.unreadable.append(path)
            continue
        parts = chain_relpaths(info)
        record = ConversationRecord(
            path, st.st_mtime, st.st_size, parts, info.prompt_digest, info.tenant
        )
        reach.records.append(record)
        reach.counts.update(parts)
    return reach


def remove_records(
    store: Store, reach: Reach, doomed: list[ConversationRecord], budget: bool = False
) -> int:
    """Remove ``doomed`` records, then every part no record reaches any more (while every
    conversation record was read: one that was not might reach any; and, but for the
    ``budget``, every agent record); returns the bytes freed (the caller holds the lock)."""
    freed, folders = 0, set()
    for record in doomed:
        if remove_store_file(record.path, store.root) is None:
            continue  # another writer removed it already
        freed += record.size
        folders.add(record.path.parent)
        reach.records.remove(record)
        reach.counts.subtract(record.parts)
    if reach.unreadable_agents and not budget:
        warn_unreadable_agents(reach, kept=True)
    elif not reach.unreadable:
        unreached = [rel for rel, count in reach.counts.items() if count <= 0]
        for rel in unreached:
            del reach.counts[rel]
        gone = [rel for rel in unreached if rel not in reach.agent_parts]
        if gone:
            warn_unreadable_agents(reach)
        freed += sum(_unlink(store.root / rel, folders, store.root) for rel in gone)
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
            # a folder, a device: not a record a writer made; verify names it, it stays
            size = remove_store_file(path, store.root)
        except OSError:  # not ours to remove: it stays, and stays unread
            continue
        if size is None:
            continue
        n, freed = n + 1, freed + size
        folders.add(path.parent)
    for folder in folders:
        fsync_dir(folder, store.fsync)
    return read_reach(store), n, freed


def evict_to_budget(store: Store, max_bytes: int, low_water: float = 0.9) -> tuple[int, int]:
    """Over ``max_bytes``, unreadable conversation records go first (they serve nothing and stop
    every block removal), then conversations by ``budget_victims`` until the rest fit in
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
        doomed = budget_victims(store, reach, max_bytes * low_water)
        freed = remove_records(store, reach, doomed, budget=True)
        return n_bad + len(doomed), total - freed


def budget_victims(store: Store, reach: Reach, target: float) -> list[ConversationRecord]:
    """The records to remove for the rest to fit in ``target`` bytes: each time, the least
    recently used record of the tenant holding the most (its records, and an even share of
    every part it reaches with other tenants; agents' parts cost nothing). A tenant is a
    record's ``owner``: its API key, whatever the cache_salt (else its namespace), so a key
    sending many salts holds one share, not one a salt.

    The tenant holding the most holds at least the average, so while the total is over
    ``target`` a tenant holding less than an even share of it (``target`` / tenants) is
    never evicted: one tenant's flood removes its own records first, and every tenant
    ends up holding about the same, or less if it needs less."""
    sizes = {rel: _size(store.root / rel) for rel in reach.counts if rel not in reach.agent_parts}
    holders: dict[str, Counter] = defaultdict(Counter)  # part -> owner -> its records there
    queues: dict[str, deque[ConversationRecord]] = defaultdict(deque)  # least recent first
    held: dict[str, float] = defaultdict(float)  # owner -> bytes it holds
    for record in sorted(reach.records, key=lambda r: r.last_use):
        queues[record.owner].append(record)
        held[record.owner] += record.size
        for rel in _own(record, sizes):
            holders[rel][record.owner] += 1
    for rel, namespaces in holders.items():
        for namespace in namespaces:
            held[namespace] += sizes[rel] / len(namespaces)
    left = sum(r.size for r in reach.records) + sum(sizes[rel] for rel in holders)
    doomed = []
    while left > target:
        busy = [ns for ns, queue in queues.items() if queue]
        if not busy:
            break
        namespace = max(busy, key=lambda ns: (held[ns], -queues[ns][0].last_use))
        record = queues[namespace].popleft()
        doomed.append(record)
        held[namespace] -= record.size
        left -= record.size
        for rel in _own(record, sizes):
            namespaces = holders[rel]
            namespaces[namespace] -= 1
            if namespaces[namespace] > 0:
                continue
            k = len(namespaces)  # its share of the part moves to the others reaching it
            del namespaces[namespace]
            held[namespace] -= sizes[rel] / k
            for other in namespaces:
                held[other] += sizes[rel] / (k - 1) - sizes[rel] / k
            if not namespaces:
                left -= sizes[rel]
    return doomed


def _own(record: ConversationRecord, sizes: dict[str, int]) -> list[str]:
    """The parts ``record`` reaches that only conversations reach (each once)."""
    return [rel for rel in dict.fromkeys(record.parts) if rel in sizes]


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
            return 0  # it might reach any of them; the budget removes them when it must
        folders: set[Path] = set()
        agents = reach.agent_parts
        gone = [rel for rel in candidates if reach.counts[rel] <= 0 and rel not in agents]
        freed = sum(_unlink(store.root / rel, folders, store.root) for rel in gone)
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


def warn_unreadable_agents(reach: Reach, kept: bool = False) -> None:
    """Name each agent record that cannot be read: parts it reaches may be removed now by the
    budget, or (``kept``) conversations' parts stay until it can be read."""
    what = (
        "conversations' blocks are kept while agent record %s cannot be read (%s): it might "
        "reach any of them"
        if kept
        else "conversations' blocks are removed without agent record %s: it cannot be read "
        "(%s), so blocks only it reaches may go"
    )
    for exc in reach.unreadable_agents:
        log.warning(
            "[kvsnap] " + what + "; run `kvsnap verify`, then rebuild it with `kvsnap build` or "
            "delete it",
            exc.path,
            exc.reason,
        )


def _size(path: Path) -> int:
    """Bytes a store file holds: a symbolic link's own, never what it points to."""
    try:
        return path.lstat().st_size
    except OSError:
        return 0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return float("inf")  # cannot tell its last use: never "unused"


def _unlink(path: Path, folders: set[Path], root: Path) -> int:
    size = remove_store_file(path, root)
    if size is None:
        return 0
    folders.add(path.parent)
    return size
