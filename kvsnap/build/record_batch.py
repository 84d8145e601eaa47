"""The build's manifest record, written once per batch of entries.

Writing it once per entry read, checked and rewrote the whole manifest each time: N agents
cost O(N²) (23 % of a 400-agent build). Here an entry committed under the store lock is
listed in the build's pending file (``store/pending.py``, which ``gc`` honours) and kept in
memory; the record is written (one read-modify-write under the lock) when the batch is due
and at the end of the build. A batch is due once ``FLUSH_SECONDS`` have passed since the last
write and at least ``COST_SHARE`` times as long as that write took, so the writes cost a
bounded share of the build whatever the manifest's size, and a crash loses at most the
entries of the last few seconds (their files stay, and the next build reuses them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from kvsnap.store.local import Store
from kvsnap.store.pending import PendingRecords

FLUSH_SECONDS = 10.0
COST_SHARE = 20.0

# (the record as it is, the entries to put in it) -> the record with them (``record_upsert``)
Upsert = Callable[[dict, dict], dict]


def _without_time(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "updated"}


@dataclass
class RecordBatch:
    store: Store
    record_id: str
    upsert: Upsert  # puts one entry into a record, as the server's write-back does
    clock: Callable[[], float] = time.monotonic
    flush_seconds: float = FLUSH_SECONDS
    pending: dict[str, dict] = field(default_factory=dict)  # entry name -> its entry
    writes: int = 0  # manifest writes this batch made (an unchanged record is not written)
    _last: float = field(default=0.0, repr=False)
    _cost: float = field(default=0.0, repr=False)
    _file: PendingRecords | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._last = self.clock()
        self._file = PendingRecords(self.store.root)

    def add(self, entry: dict) -> None:
        """Put ``entry`` in the next write; the caller holds the store lock, under which its
        record was committed, so gc sees the record listed from the moment it exists."""
        assert self._file is not None
        self._file.add(entry["file"])
        self.pending[entry["name"]] = entry

    def due(self) -> bool:
        waited = self.clock() - self._last
        return bool(self.pending) and waited >= max(self.flush_seconds, COST_SHARE * self._cost)

    def flush(self, keep: set[str] | None = None) -> None:
        """Write the pending entries into the record (and, with ``keep``, drop every entry whose
        name is not in it); an unchanged record is not rewritten. StoreError when the manifest
        cannot be written: the pending entries are dropped all the same (their files stay
        unlisted, as a failed entry's)."""
        if not self.pending and keep is None:
            return
        started = self.clock()
        try:
            with self.store.lock():
                current = self.store.read_manifest()["records"].get(self.record_id, {})
                updated = self._apply(current, keep)
                if _without_time(updated) != _without_time(current):
                    self.store.update_record(self.record_id, lambda now: self._apply(now, keep))
                    self.writes += 1
                assert self._file is not None
                self._file.clear()
        finally:
            self.pending.clear()
            self._last = self.clock()
            self._cost = self._last - started

    def close(self) -> None:
        """Remove the pending file (after the last ``flush``): what it still lists is no longer
        protected from gc."""
        if self._file is not None:
            self._file.close()

    def _apply(self, record: dict, keep: set[str] | None) -> dict:
        """``record`` with the pending entries put in (each replacing the entries of its name),
        then, with ``keep``, only the entries named in it."""
        entries = record.get("entries", [])
        if self.pending:
            last = next(reversed(self.pending.values()))
            record = self.upsert(record, last)  # the record's own fields, as one upsert sets them
            kept = [e for e in entries if e.get("name") not in self.pending]
            entries = sorted(kept + list(self.pending.values()), key=lambda e: e["name"])
        if keep is not None:
            entries = [e for e in entries if e.get("name") in keep]
        if entries == record.get("entries", []) and not self.pending:
            return record
        return {**record, "entries": entries}
