"""The store a warm-up reads and writes back to: opened read-only or writable, and why not
writable (``SnapshotCounts.write_back_note``). No mlx."""

from __future__ import annotations

import logging
from pathlib import Path

from kvsnap.errors import StoreError
from kvsnap.runtime.warmup.report import SnapshotCounts
from kvsnap.store.fileio import probe_writable
from kvsnap.store.local import Store

log = logging.getLogger("kvsnap.runtime.warmup.run")


def open_store(path: str, write_back: bool, counts: SnapshotCounts, fault=None) -> Store | None:
    p = Path(path).expanduser()
    if not p.exists():
        if not write_back:
            counts.write_back_note = f"{p} does not exist and write-back is off"
            return None
        try:
            return Store.open(p, create=True, fault=fault)
        except (OSError, StoreError) as exc:
            counts.write_back_note = f"cannot create {p}: {exc}"
            return None
    if not write_back:
        counts.write_back_note = "write-back disabled (--no-write-back)"
        return Store.open(p, readonly=True)
    folder = Store(root=p).snapshots_dir if Store(root=p).snapshots_dir.is_dir() else p
    why = probe_writable(folder, fault)
    if why is not None:
        counts.write_back_note = (
            f"{p} is not writable here ({why}): "
            "prefilled warm prompts are served but not written back"
        )
        log.warning("[kvsnap] %s", counts.write_back_note)
        return Store.open(p, readonly=True)
    return Store.open(p, create=True, fault=fault)
