"""The store a warm-up reads and writes back to: opened read-only or writable, and why not
writable (``SnapshotCounts.write_back_note``). No mlx."""

from __future__ import annotations

import logging
from pathlib import Path

from kvsnap.errors import StoreError
from kvsnap.runtime.warmup.report import SnapshotCounts
from kvsnap.store.local import Store
from kvsnap.store.opening import open_store_folder

log = logging.getLogger("kvsnap.runtime.warmup.run")


def open_store(path: str, write_back: bool, counts: SnapshotCounts, fault=None) -> Store | None:
    """The store to warm from (``store.opening``'s policy), or None; why write-back is off goes
    to ``counts``. A folder that is no store is a note and a cold start, never a crash."""
    p = Path(path).expanduser()
    try:
        opened = open_store_folder(p, write_back, fault)
    except StoreError as exc:
        counts.write_back_note = f"no store: {exc}"
        log.warning("[kvsnap] %s", counts.write_back_note)
        return None
    if opened.store is None:
        counts.write_back_note = f"{p} does not exist and write-back is off"
    elif not write_back:
        counts.write_back_note = "write-back disabled (--no-write-back)"
    elif opened.why_not is not None:
        counts.write_back_note = (
            f"{p} is not writable here ({opened.why_not}): "
            "prefilled warm prompts are served but not written back"
        )
        log.warning("[kvsnap] %s", counts.write_back_note)
    return opened.store
