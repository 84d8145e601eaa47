"""Collecting a store's garbage (``kvsnap gc``): temp files, records no manifest record lists,
blocks and checkpoints no kept record reaches, a dead build's pending file. Under the lock;
nothing is removed unless asked, and a folder or a link's target never is."""

from __future__ import annotations

from pathlib import Path
from typing import ContextManager, Protocol

from kvsnap.errors import SnapshotError
from kvsnap.snapshot.format import CONVERSATIONS, MANIFEST, PART_FOLDERS, SNAPSHOTS, relpath_of_file
from kvsnap.store.conversations import conversation_files
from kvsnap.store.fileio import (
    TMP_PREFIX,
    StoreFiles,
    check_store_folders,
    file_or_link,
    fsync_dir,
    remove_store_file,
    store_folder,
)
from kvsnap.store.paths import part_files, part_relpath_of_file, reached_parts, record_files
from kvsnap.store.pending import held_references
from kvsnap.store.reading import inspect_record


class Collected(StoreFiles, Protocol):
    """What gc needs of a store beyond its files: its lock and its manifest's references."""

    def lock(self) -> ContextManager[None]: ...

    def referenced(self) -> set[str]: ...


def temp_files(root: Path) -> list[Path]:
    """A writer's temp files left in the store's folders (a crash mid-write)."""
    found = [p for p in root.iterdir() if p.name.startswith(TMP_PREFIX)]
    for name in (SNAPSHOTS, *PART_FOLDERS, CONVERSATIONS):
        folder = store_folder(root, name)
        if folder is not None:
            found += [p for p in folder.iterdir() if p.name.startswith(TMP_PREFIX)]
    return sorted(found)


def collect(store: Collected, apply: bool) -> tuple[list[Path], int]:
    """Temp files and snapshots no manifest record refers to; removed only when ``apply``.

    Without a manifest nothing says which snapshots are in use (a store copied
    without it, or written only by a server), so every snapshot stays. A record a running
    build has committed but not yet listed (its pending file, which it holds) stays; a
    dead build's pending file goes. Blocks and
    checkpoints go when no record reaches them (agents' and persisted conversations').
    Folders are never removed; a symbolic link is removed, never what it points to, and a
    store folder that is a link is refused (``store_folder``): nothing is removed then.
    """
    root = store.root
    with store.lock():
        check_store_folders(root)  # a link refused before anything goes
        live = store.referenced()
        held, dead = held_references(root)  # StoreError (deleting nothing) if unreadable
        live |= held
        candidates = temp_files(root) + dead
        kept = record_files(store)
        if (root / MANIFEST).exists():
            candidates += [p for p in kept if relpath_of_file(p.name) not in live]
            kept = [p for p in kept if relpath_of_file(p.name) in live]
        # A block stays while any kept record reaches it, a conversation's included.
        kept += [p for p in conversation_files(root) if file_or_link(p)]
        try:
            reached: set[str] | None = reached_parts([inspect_record(store, p) for p in kept])
        except SnapshotError:
            reached = None  # an unreadable record might reach any of them: keep them all
        if reached is not None:
            candidates += [p for p in part_files(store) if part_relpath_of_file(p) not in reached]
        # a folder, a FIFO or a device is never removed (not a writer's): never listed
        doomed = [p for p in candidates if file_or_link(p)]
        freed = sum(p.lstat().st_size for p in doomed)
        if apply:
            for p in doomed:
                remove_store_file(p, root)
            for folder in sorted({p.parent for p in doomed}):
                fsync_dir(folder, store.fsync)
        return doomed, freed
