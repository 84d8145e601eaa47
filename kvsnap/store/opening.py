"""What a ``--kv-snapshots`` folder means, one policy for every server (``kvsnap serve``'s
warm-up, the mlx-lm and vllm-mlx routes) and its start-up check:

- a store (a manifest or a snapshots folder): read; written to only when something may be
  written back and a file can really be created in it (``probe_writable``);
- a missing folder, or one holding nothing but hidden entries (a lock, a rank's probe file):
  made a store when something may be written back, since an empty folder is also what a
  second rank sees while its first is creating the store; else there is nothing to read;
- a file, or a folder holding other files: never taken for a store (StoreError).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvsnap.errors import StoreError
from kvsnap.store.fileio import FaultFn, probe_writable
from kvsnap.store.local import MANIFEST, SNAPSHOTS, Store

BUILD_FIX = "give the folder passed to `kvsnap build --out`"


@dataclass(frozen=True)
class OpenedStore:
    """``store``: None where the folder is missing and nothing may be written. ``why_not``: the
    write probe's reason when writing was wanted and the store is read-only."""

    store: Store | None
    writable: bool
    why_not: str | None = None


def holds_nothing(folder: Path) -> bool:
    """A folder with no entries but hidden ones (a store's lock or a rank's probe file)."""
    try:
        return folder.is_dir() and all(e.name.startswith(".") for e in folder.iterdir())
    except OSError:
        return False


def check_store_folder(path: str | os.PathLike) -> None:
    """StoreError when ``path`` can never be a store: a file, or a folder holding other files
    and no store. Creates nothing (a server checks it before loading its model)."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise StoreError(f"{p} is a file, not a kvsnap store; {BUILD_FIX}")
    if p.is_dir() and not Store(root=p).is_initialized() and not holds_nothing(p):
        raise StoreError(
            f"{p} is not a kvsnap store (no {MANIFEST}, no {SNAPSHOTS}/) and holds other files; "
            f"{BUILD_FIX}, or a new or empty folder"
        )


def open_store_folder(
    path: str | os.PathLike, want_write: bool, fault: FaultFn | None = None
) -> OpenedStore:
    """The store at ``path``, writable when ``want_write`` and it can be (the module's policy);
    StoreError for a folder that is no store, or one that cannot be made one."""
    p = Path(path).expanduser()
    check_store_folder(p)
    fresh = not p.exists() or holds_nothing(p)
    if fresh and want_write:
        try:
            return OpenedStore(Store.open(p, create=True, fault=fault), True)
        except (OSError, StoreError) as exc:
            raise StoreError(f"{p} cannot be made a store ({exc}); {BUILD_FIX}") from None
    if not p.exists():
        return OpenedStore(None, False)
    store = Store.open(p, readonly=True)
    if not want_write:
        return OpenedStore(store, False)
    why = probe_writable(store.snapshots_dir if store.snapshots_dir.is_dir() else store.root, fault)
    if why is not None:
        return OpenedStore(store, False, why)
    return OpenedStore(Store.open(p, create=True, fault=fault), True)
