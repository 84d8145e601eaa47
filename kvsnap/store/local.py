"""The snapshot store on disk: ``Store`` opens a folder, holds its lock and its manifest, and
hands each job to its module: writing (``store/writing.py``), reading (``store/reading.py``),
checking (``store/checking.py``) and collecting garbage (``store/collecting.py``).

Layout (every path relative to the root, so the folder can be moved or shipped; the names
are ``snapshot/format.py``'s)::

    ROOT/manifest.json               what each build produced: one record per (model, agents file)
    ROOT/snapshots/<key>.safetensors   one record per warm prefix, named by its content key
    ROOT/blocks/<key>.safetensors      attention KV of one run of tokens, shared by records
    ROOT/checkpoints/<key>.safetensors non-trimmable layers' state at one token count
    ROOT/.lock                       writers hold an exclusive flock on it
    ROOT/.pending-<random>           a running build's records not yet in the manifest (gc keeps
                                     them while the build holds the file; ``store/pending.py``)

Only ``load_arrays`` imports mlx (in ``reading``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from kvsnap.errors import StoreError
from kvsnap.key import ModelIdentity
from kvsnap.snapshot.file import OutTensor
from kvsnap.snapshot.format import MANIFEST, SNAPSHOTS, relpath_of_file
from kvsnap.snapshot.header import MAX_TOKENS, SnapshotInfo
from kvsnap.store import collecting, reading, writing
from kvsnap.store.checking import PartHealth, verify_record
from kvsnap.store.fileio import (
    DIR_MODE,
    FILE_MODE,
    TMP_PREFIX,
    FaultFn,
    atomic_write,
    default_fsync,
    fsync_dir,
    make_dirs,
)
from kvsnap.store.foreign import Problem
from kvsnap.store.manifest import (
    encode_manifest,
    merge_manifests,
    read_manifest_file,
    referenced_files,
    update_manifest,
)
from kvsnap.store.paths import record_files, record_path

LOCK = ".lock"
# the modes and prefix others import from here
__all__ = [
    "DIR_MODE",
    "FILE_MODE",
    "MANIFEST",
    "SNAPSHOTS",
    "TMP_PREFIX",
    "SnapshotInfo",
    "Store",
]


def _no_fault(point: str) -> None:
    return None


@dataclass
class Store:
    root: Path
    readonly: bool = False
    fault: FaultFn = _no_fault
    fsync: Callable[[int], None] = default_fsync  # a seam: tests spy on it
    _lock_depth: int = field(default=0, repr=False)
    _lock_fd: int | None = field(default=None, repr=False)
    # parts checked, read or written through this object, while a warm-up remembers them
    checked: PartHealth | None = field(default=None, repr=False)

    # --- opening ----------------------------------------------------------------

    @classmethod
    def open(
        cls,
        root: str | os.PathLike,
        create: bool = False,
        readonly: bool = False,
        fault: FaultFn | None = None,
    ) -> "Store":
        path = Path(root).expanduser()
        if path.exists() and not path.is_dir():
            raise StoreError(
                f"snapshot store {str(root)!r} is a file, not a directory; give a folder"
            )
        if not path.exists():
            if not create:
                raise StoreError(
                    f"snapshot store {str(root)!r} does not exist; build one with `kvsnap build "
                    f"agents.json --model M --out {root}`"
                )
            make_dirs(path)
        store = cls(root=path.resolve(), readonly=readonly, fault=fault or _no_fault)
        if create and not readonly:
            make_dirs(store.root / SNAPSHOTS, store.fsync)
        return store

    @property
    def snapshots_dir(self) -> Path:
        return self.root / SNAPSHOTS

    def path_for(self, key: str) -> Path:
        return record_path(self, key)

    def is_initialized(self) -> bool:
        """Whether the folder looks like a store (a manifest or a snapshots folder)."""
        return (self.root / MANIFEST).is_file() or self.snapshots_dir.is_dir()

    def require_store(self) -> "Store":
        """This store, or a StoreError if the folder holds neither a manifest nor a snapshots
        folder."""
        if not self.is_initialized():
            raise StoreError(
                f"{self.root} is not a kvsnap store (no {MANIFEST}, no {SNAPSHOTS}/); give the "
                f"folder passed to `kvsnap build --out`"
            )
        return self

    def _inside(self, path: Path) -> bool:
        try:
            path.resolve().relative_to(self.root)
            return True
        except ValueError:
            return False

    # --- locking ----------------------------------------------------------------

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Exclusive writer lock (re-entrant in one process); blocks while another writer holds
        it."""
        if self.readonly:
            raise StoreError(f"{self.root}: the store is read-only here; writes are disabled")
        if self._lock_depth == 0:
            fd = self._open_lock_file()
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._lock_fd = fd
        self._lock_depth += 1
        try:
            yield
        finally:
            self._lock_depth -= 1
            if self._lock_depth == 0 and self._lock_fd is not None:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
                os.close(self._lock_fd)
                self._lock_fd = None

    def _open_lock_file(self) -> int:
        """The lock file, never through a link: a dangling one made every writer create its
        target, a file outside the store."""
        path = self.root / LOCK
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, FILE_MODE)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise StoreError(
                f"{path} is a symbolic link (to {os.readlink(path)}); kvsnap never writes "
                f"through a link; delete it (writers make their own lock file)"
            ) from None

    @contextlib.contextmanager
    def checks_remembered(self) -> Iterator[PartHealth]:
        """Within: a part checked, read or written through this store is checked once (a
        warm-up writing back prompts that share blocks); outside, every check runs again."""
        if self.checked is not None:
            yield self.checked
            return
        self.checked = PartHealth()
        try:
            yield self.checked
        finally:
            self.checked = None

    # --- writing: ``store/writing.py`` ---------------------------------------------------

    def _atomic_write(self, target: Path, write: Callable[[Any], object]) -> None:
        atomic_write(target, write, self.fault, self.fsync)

    def put(self, key: str, tensors: list[OutTensor], metadata: dict[str, str]) -> Path:
        """Write one snapshot atomically. The caller holds the lock."""
        return writing.put_record(self, key, tensors, metadata)

    # --- manifest ---------------------------------------------------------------

    def read_manifest(self) -> dict:
        """The store's manifest, checked field by field (an empty one when there is none);
        ManifestError if damaged."""
        return read_manifest_file(self.root / MANIFEST)

    def _write_manifest(self, data: bytes) -> None:
        try:
            self._atomic_write(self.root / MANIFEST, lambda f: f.write(data))
        except OSError as exc:
            raise StoreError(
                f"cannot write {self.root / MANIFEST} ({exc.strerror or exc}); the previous "
                f"manifest is intact"
            ) from exc

    def update_record(self, record_id: str, update: Callable[[dict], dict]) -> None:
        """Read-modify-write one manifest record, atomically, under the lock."""
        with self.lock():
            self._write_manifest(
                update_manifest(self.read_manifest(), record_id, update, str(self.root / MANIFEST))
            )

    def merge_manifest(self, incoming: dict) -> bool:
        """Add an installed manifest's records to this store's (the caller holds the lock); False
        if nothing changed.

        An install never replaces the manifest: records it does not carry stay, so their
        snapshots stay referenced and ``gc`` keeps them.
        """
        assert self._lock_depth > 0, "merge_manifest runs under the store lock"
        current = self.read_manifest()
        merged = merge_manifests(current, incoming)
        if merged == current and (self.root / MANIFEST).exists():
            return False
        self._write_manifest(encode_manifest(merged))
        return True

    # --- reading: ``store/reading.py``; checking: ``store/checking.py`` -------------------

    def snapshot_files(self) -> list[Path]:
        """The agents' records; StoreError when ``snapshots/`` is a link (``store_folder``)."""
        return record_files(self)

    def temp_files(self) -> list[Path]:
        return collecting.temp_files(self.root)

    def inspect(self, path: Path, max_tokens: int = MAX_TOKENS) -> SnapshotInfo:
        """Header checks only (``reading.inspect_record``); SnapshotError names the file."""
        return reading.inspect_record(self, path, max_tokens)

    def verify_file(
        self, path: Path, expected: ModelIdentity | None = None, parts: bool = True
    ) -> SnapshotInfo:
        """Full check: header, identity, tokens, data checksum, and (optionally) the model; for a
        v3 record also every block and checkpoint it reaches (unless ``parts`` is False)."""
        return verify_record(self, self.inspect(path), expected, parts)

    def scan(
        self, expected: ModelIdentity | None = None, max_tokens: int = MAX_TOKENS
    ) -> tuple[list[SnapshotInfo], list[Problem]]:
        """Header-only scan of every snapshot; foreign ones are problems only when ``expected`` is
        given."""
        return reading.scan_records(self, expected, max_tokens)

    def read_tokens(self, info: SnapshotInfo) -> list[int]:
        """The token ids a snapshot holds (no mlx)."""
        return reading.read_tokens(info)

    def load_arrays(self, info: SnapshotInfo, expected: ModelIdentity | None = None) -> dict:
        """The record's state in mlx memory, checked as read (``reading.load_record``)."""
        return reading.load_record(self, info, expected)

    # --- collecting: ``store/collecting.py`` --------------------------------------

    def referenced(self) -> set[str]:
        """Every snapshot path a manifest record lists; ManifestError (deleting nothing) if the
        manifest is damaged."""
        return referenced_files(self.read_manifest())

    def missing_files(self, referenced: set[str] | None = None) -> list[str]:
        """The snapshot paths the manifest lists (``referenced``, else read now) that are not in
        the folder, sorted."""
        listed = self.referenced() if referenced is None else referenced
        return sorted(listed - {relpath_of_file(p.name) for p in self.snapshot_files()})

    def gc(self, apply: bool) -> tuple[list[Path], int]:
        """Garbage removed (only when ``apply``) and its bytes (``collecting.collect``)."""
        return collecting.collect(self, apply)

    def _fsync_dir(self, folder: Path) -> None:
        fsync_dir(folder, self.fsync)
