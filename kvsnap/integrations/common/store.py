"""The store an upstream route warms from (``--kv-snapshots``, a folder or a remote URL): read-only,
or writable when something may be written back and the store layer's write probe says it can be."""

from __future__ import annotations

import logging
from pathlib import Path

from kvsnap.errors import StoreError, UsageError
from kvsnap.integrations.common.argv import OPTION
from kvsnap.store.fileio import probe_writable
from kvsnap.store.local import Store
from kvsnap.store.remote import resolve_kv_snapshots

log = logging.getLogger("kvsnap.integrations")


def open_store(kv_snapshots: str, want_write: bool = False) -> tuple[Store, bool]:
    """The store, and whether warm prompts prefilled here can be written back to it.

    A remote URL is pulled into kvsnap's cache folder first, as ``kvsnap serve`` does.
    Writable is decided by really creating a file (``probe_writable``). A missing or empty
    folder becomes a store only when there is something to write back (``want_write``): an
    empty one is also what another rank sees while the first one is creating the store.
    """
    path = resolve_kv_snapshots(kv_snapshots)
    if path is None:
        raise UsageError(f"{OPTION} needs a directory, e.g. {OPTION} ./snaps")
    folder = Path(path).expanduser()
    if want_write and (not folder.exists() or _holds_nothing(folder)):
        try:
            return Store.open(folder, create=True), True
        except (OSError, StoreError) as exc:
            raise StoreError(
                f"{folder} cannot be made a store ({exc}); give the folder passed to "
                f"`kvsnap build --out`"
            ) from None
    store = Store.open(folder, readonly=True).require_store()
    if not want_write:
        return store, False
    probe_dir = store.snapshots_dir if store.snapshots_dir.is_dir() else store.root
    why = probe_writable(probe_dir)
    if why is not None:
        log.warning(
            "[kvsnap] %s is not writable here (%s): warm prompts without a snapshot are prefilled "
            "at every start and not written back",
            store.root,
            why,
        )
        return store, False
    return Store.open(folder, create=True), True


def _holds_nothing(folder: Path) -> bool:
    """A folder with no entries but hidden ones (a store's lock or a rank's probe file)."""
    try:
        return folder.is_dir() and all(e.name.startswith(".") for e in folder.iterdir())
    except OSError:
        return False
