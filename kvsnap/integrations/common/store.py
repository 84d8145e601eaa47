"""The store an upstream route warms from (``--kv-snapshots``, a folder or a remote URL): read-only,
or writable when something may be written back and it can be (``store.opening``'s policy)."""

from __future__ import annotations

import logging
from pathlib import Path

from kvsnap.errors import UsageError
from kvsnap.integrations.common.argv import OPTION
from kvsnap.store.local import Store
from kvsnap.store.opening import open_store_folder
from kvsnap.store.remote import resolve_kv_snapshots

log = logging.getLogger("kvsnap.integrations")


def open_store(kv_snapshots: str, want_write: bool = False) -> tuple[Store, bool]:
    """The store, and whether warm prompts prefilled here can be written back to it.

    A remote URL is pulled into kvsnap's cache folder first, as ``kvsnap serve`` does; the
    folder then means what ``store.opening`` says for every server. Nothing to read and nothing
    to write is no store (StoreError).
    """
    path = resolve_kv_snapshots(kv_snapshots)
    if path is None:
        raise UsageError(f"{OPTION} needs a directory, e.g. {OPTION} ./snaps")
    folder = Path(path).expanduser()
    opened = open_store_folder(folder, want_write)
    if opened.store is None or not opened.store.is_initialized():
        # missing or empty with nothing to write back: say what to give instead
        return Store.open(folder, readonly=True).require_store(), False
    if opened.why_not is not None:
        log.warning(
            "[kvsnap] %s is not writable here (%s): warm prompts without a snapshot are prefilled "
            "at every start and not written back",
            opened.store.root,
            opened.why_not,
        )
    return opened.store, opened.writable
