"""Shipped files installed into a store: staged, verified, then moved in atomically.

Installs are staged: files are written (``0600``) into a temp folder next to the store
(``.kvsnap-stage-<name>-*``, ``0700``), checked — every snapshot's own checksum, every
field of the manifest — and only then moved in: a new store by renaming the whole folder,
an existing one under the store's writer lock, snapshots first, then the shipped
manifest's records are *merged* into the store's own (never replacing it: the store's
other records, and so their snapshots, stay live for ``gc``). A failed install removes the
temp folder and leaves the store as it was. ``unpack`` (``store/archive.py``) and ``pull``
(``store/oci/download.py``) both install through ``StagedInstall``.

No mlx here.
"""

from __future__ import annotations

import contextlib
import errno
import filecmp
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from kvsnap.errors import ManifestError, SnapshotError, StoreError
from kvsnap.snapshot.format import PART_FOLDERS, PART_REL_RE
from kvsnap.store.fileio import fsync_dir, make_dirs
from kvsnap.store.local import DIR_MODE, FILE_MODE, MANIFEST, SNAPSHOTS, Store
from kvsnap.store.manifest import parse_manifest, referenced_files
from kvsnap.store.shipping import ShipError, is_store_relpath, present_with_digest
from kvsnap.store.stage import adopt_stage, clean_stale_stages, new_stage


def check_manifest_bytes(data: bytes, where: str, dest: Path | None = None) -> dict:
    """A shipped manifest, checked field by field like the store's own; ShipError (nothing changed)
    if not."""
    untouched = f"nothing was changed in {dest}" if dest is not None else "nothing was changed"
    try:
        return parse_manifest(data, f"{where}: {MANIFEST}", f"refusing it ({untouched})")
    except ManifestError as exc:
        raise ShipError(str(exc)) from None


def check_part_file(store: Store, relpath: str, path: Path) -> None:
    """A block or checkpoint file at ``path`` (stored or staged as ``relpath``) checked on its
    own: header, key, checksum; SnapshotError names it."""
    from kvsnap.store.checking import check_part

    kind = "block" if relpath.startswith(PART_FOLDERS[0]) else "checkpoint"
    check_part(store, kind, path.stem, path=path)


def existing_file_is_good(store: Store, relpath: str) -> bool:
    """A store file that passes its own checks (a record's parts are checked on their own)."""
    path = store.root / relpath
    try:
        if PART_REL_RE.fullmatch(relpath):
            check_part_file(store, relpath, path)
        else:
            store.verify_file(path, parts=False)
    except (SnapshotError, OSError):
        return False
    return True


def _remove(path: Path) -> None:
    """Remove a file, link or folder of a stage (already gone is fine)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _is_regular_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


def check_destination(dest: str | os.PathLike) -> Path:
    """The absolute install folder; refuses a file, or a non-empty folder that is not a store."""
    path = Path(dest).expanduser().absolute()
    if path.is_symlink() and not path.exists():
        raise ShipError(f"{path}: a dangling symbolic link; give a folder")
    if path.exists():
        if not path.is_dir():
            raise StoreError(
                f"snapshot store {str(dest)!r} is a file, not a directory; give a folder"
            )
        if any(path.iterdir()) and not Store(root=path).is_initialized():
            raise ShipError(
                f"{path} is not empty and not a kvsnap store; give an empty or new folder, or a "
                f"store"
            )
    return path


@dataclass
class StagedInstall:
    """Write files into a temp folder beside ``dest``, verify them, then move them in."""

    dest: Path
    tmp: Path | None = None
    staged: list[str] = field(default_factory=list)
    manifest: dict | None = None  # the shipped manifest, once verified
    reached: set[str] = field(default_factory=set)  # blocks and checkpoints the staged records need
    # shipped files that differ from the store's good one: not installed
    kept: list[str] = field(default_factory=list)
    # take over a killed install's stage for this dest (pull: its files are digest-checked)
    resume: bool = False
    leftover: set[str] = field(default_factory=set)  # files of an adopted stage not yet reused
    # held while this install runs: a live stage is never cleaned or adopted
    _lock_fd: int | None = None

    def __post_init__(self) -> None:
        self.dest = check_destination(self.dest)
        try:
            os.makedirs(self.dest.parent, mode=DIR_MODE, exist_ok=True)
            clean_stale_stages(self.dest.parent)
            adopted = adopt_stage(self.dest) if self.resume else None
            self.tmp, self._lock_fd = adopted or new_stage(self.dest, DIR_MODE)
            if adopted:
                self.leftover = self._sweep_adopted()
            for folder in (SNAPSHOTS, *PART_FOLDERS):
                (self.tmp / folder).mkdir(mode=DIR_MODE, exist_ok=True)
                os.chmod(self.tmp / folder, DIR_MODE)
        except OSError as exc:
            self.cleanup()
            raise ShipError(
                f"cannot make a temp folder next to {self.dest} ({exc.strerror or exc}); check the "
                f"parent folder's permissions"
            ) from None

    def __enter__(self) -> "StagedInstall":
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()

    def _sweep_adopted(self) -> set[str]:
        """The store files an adopted stage holds; anything else in it is removed."""
        assert self.tmp is not None
        found = set()
        for entry in self.tmp.iterdir():
            if (
                entry.name in (SNAPSHOTS, *PART_FOLDERS)
                and not entry.is_symlink()
                and entry.is_dir()
            ):
                for f in entry.iterdir():
                    rel = f"{entry.name}/{f.name}"
                    if is_store_relpath(rel) and _is_regular_file(f):
                        found.add(rel)
                    else:
                        _remove(f)
            elif entry.name == MANIFEST and _is_regular_file(entry):
                found.add(MANIFEST)
            else:
                _remove(entry)
        return found

    def reuse(self, relpath: str, size: int, digest: str) -> bool:
        """Count a file a killed install staged as staged, if it has this size and sha256; else
        drop it."""
        assert self.tmp is not None
        if relpath not in self.leftover or relpath in self.staged:
            return False
        self.leftover.discard(relpath)
        if present_with_digest(self.tmp / relpath, size, digest):
            self.staged.append(relpath)
            return True
        _remove(self.tmp / relpath)
        return False

    def _drop_leftovers(self) -> None:
        """An adopted stage's files this install did not reuse never reach the store."""
        assert self.tmp is not None
        for relpath in sorted(self.leftover):
            _remove(self.tmp / relpath)
        self.leftover.clear()

    @contextlib.contextmanager
    def open(self, relpath: str) -> Iterator[BinaryIO]:
        """A new ``0600`` file at ``relpath`` in the temp folder, fsynced when the block ends."""
        assert self.tmp is not None and is_store_relpath(relpath), relpath
        if relpath in self.staged:
            raise ShipError(f"{relpath}: given twice; refusing it")
        if relpath in self.leftover:
            self.leftover.discard(relpath)
            _remove(self.tmp / relpath)
        target = self.tmp / relpath
        fd = os.open(
            target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), FILE_MODE
        )
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        self.staged.append(relpath)

    def verify(self, source: str) -> None:
        """Every staged file's own checks (header, key, checksum; a block's or checkpoint's too) and
        the manifest's JSON. A record's parts are checked where they will be: staged, or already in
        ``dest``."""
        from kvsnap.store.paths import chain_relpaths

        assert self.tmp is not None
        self._drop_leftovers()
        store = Store(root=self.tmp.resolve(), readonly=True)
        self.reached = set()
        for relpath in self.staged:
            path = store.root / relpath
            if relpath == MANIFEST:
                self.manifest = check_manifest_bytes(path.read_bytes(), source, self.dest)
                continue
            try:
                if PART_REL_RE.fullmatch(relpath):
                    check_part_file(store, relpath, path)
                else:
                    self.reached.update(chain_relpaths(store.verify_file(path, parts=False)))
            except SnapshotError as exc:
                raise ShipError(
                    f"{source}: {relpath}: {exc.reason}; refusing it (nothing was changed in "
                    f"{self.dest})"
                ) from None

    def _check_references(self, present: Callable[[str], bool]) -> None:
        """Every snapshot the shipped manifest lists is shipped too, or already in the store."""
        parts = sorted(r for r in self.reached if r not in self.staged and not present(r))
        if parts:
            raise ShipError(
                f"a shipped record needs {parts[0]}, which was not shipped and is not in "
                f"{self.dest}; refusing it (nothing was changed in {self.dest}); ship the whole "
                f"store with `kvsnap pack` or `kvsnap push`"
            )
        if self.manifest is None:
            return
        missing = sorted(
            r for r in referenced_files(self.manifest) if r not in self.staged and not present(r)
        )
        if missing:
            raise ShipError(
                f"{MANIFEST} lists {missing[0]}, which was not shipped and is not in {self.dest}; "
                f"refusing it (nothing was changed in {self.dest}); ship the whole store with "
                f"`kvsnap pack` or `kvsnap push`"
            )

    def commit(self) -> None:
        """Move the staged files into ``dest``: all at once for a new store, else under the lock,
        merging the manifest."""
        assert self.tmp is not None
        if not self.staged:  # everything was already in place: leave the store untouched
            self.cleanup()
            return
        for folder in (*(self.tmp / f for f in (SNAPSHOTS, *PART_FOLDERS)), self.tmp):
            fsync_dir(folder)
        if not self.dest.exists():
            self._check_references(lambda relpath: False)
            try:
                os.rename(self.tmp, self.dest)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise ShipError(
                        f"cannot move the new store into {self.dest} ({exc.strerror or exc})"
                    ) from None
            else:
                self.tmp = None
                self.cleanup()  # releases the stage lock, now on the new store's folder
                fsync_dir(self.dest.parent)
                return
        try:
            store = Store.open(self.dest, create=True)
            with store.lock():
                try:
                    store.read_manifest()  # the store's own must be sound before anything moves
                except ManifestError as exc:
                    raise ShipError(
                        f"{exc}; the install merges into it, so nothing was changed in {self.dest}"
                    ) from None
                self._check_references(lambda relpath: _is_regular_file(store.root / relpath))
                # Parts before records, records before the manifest: what lands is always whole.
                files = sorted(
                    (r for r in self.staged if r != MANIFEST),
                    key=lambda r: not PART_REL_RE.fullmatch(r),
                )
                files = [r for r in files if not self._keeps_existing(store, r)]
                for relpath in files:
                    # a new blocks/ or checkpoints/ is durable in the root before it is used
                    make_dirs((store.root / relpath).parent, store.fsync)
                    os.replace(self.tmp / relpath, store.root / relpath)
                for folder in sorted({(store.root / r).parent for r in files}):
                    fsync_dir(folder)
                if self.manifest is not None:
                    store.merge_manifest(self.manifest)
        except OSError as exc:
            raise ShipError(
                f"cannot move files into {self.dest} ({exc.strerror or exc}); check its permissions"
            ) from None
        finally:
            self.cleanup()

    def _keeps_existing(self, store: Store, relpath: str) -> bool:
        """True when ``dest`` already has a good file of that name: a key names content but does not
        hash it, so shipped bytes never replace it (a different one is listed in ``kept``)."""
        assert self.tmp is not None
        target = store.root / relpath
        if not _is_regular_file(target):
            return False
        if filecmp.cmp(self.tmp / relpath, target, shallow=False):
            return True
        if not existing_file_is_good(store, relpath):
            return False  # a damaged copy: the verified shipped one repairs it
        self.kept.append(relpath)
        return True

    def cleanup(self) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
