"""A build's pending records: the ones it has committed but not yet listed in ``manifest.json``.

A build writes the manifest once per batch of entries, not once per entry (each write reads,
checks and rewrites the whole manifest: per entry, N agents cost O(N²)). Until its batch is
written, each committed record's store path is one line of ``ROOT/.pending-<random>``, a file
the build holds an exclusive ``flock`` on from its first line to its end. ``gc``, under the
store lock like every writer of these files, counts the lines of every held file as
references, so it never removes a record a running build has committed; a file nobody holds
is a dead build's, and ``gc`` removes it (that build's unlisted records become gc-able: a
crash loses the entries since its last manifest write, never a listed one).

Nothing here is fsynced: a pending file that outlives its build is never read. No mlx.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import stat
from pathlib import Path

from kvsnap.errors import StoreError
from kvsnap.snapshot.format import SNAPSHOT_REL_RE
from kvsnap.store.fileio import FILE_MODE
from kvsnap.store.manifest import MAX_MANIFEST_BYTES

PENDING_PREFIX = ".pending-"
# a held file lists at most one batch: as many records as a manifest may list
MAX_PENDING_BYTES = MAX_MANIFEST_BYTES


class PendingRecords:
    """One build's pending file. Made on the first ``add``; every call under the store lock."""

    def __init__(self, root: Path):
        self.root = root
        self.path: Path | None = None
        self._fd: int | None = None

    def add(self, relpath: str) -> None:
        """List one committed record (``snapshots/<key>.safetensors``) until ``clear``."""
        if not SNAPSHOT_REL_RE.fullmatch(relpath):
            raise ValueError(f"pending record path {relpath!r} is not a store record path")
        if self._fd is None:
            self._open()
        assert self._fd is not None
        data = (relpath + "\n").encode()
        while data:
            data = data[os.write(self._fd, data) :]

    def clear(self) -> None:
        """Its records are in the manifest now: list none."""
        if self._fd is not None:
            os.ftruncate(self._fd, 0)

    def close(self) -> None:
        """Remove the file, then let go of it (removed while held: gc never sees it unheld)."""
        if self._fd is None:
            return
        try:
            if self.path is not None:
                self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd, self.path = None, None

    def _open(self) -> None:
        path = self.root / f"{PENDING_PREFIX}{secrets.token_hex(8)}"
        fd = os.open(
            path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_APPEND, FILE_MODE
        )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new: nobody else can hold it
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        self._fd, self.path = fd, path


def pending_files(root: Path) -> list[Path]:
    """Every entry of the store's root named like a pending file, sorted."""
    return sorted(p for p in root.iterdir() if p.name.startswith(PENDING_PREFIX))


def held_references(root: Path) -> tuple[set[str], list[Path]]:
    """(the record paths every held pending file lists, the pending files nobody holds: dead
    builds' files and links, for gc to remove). The caller holds the store lock.

    StoreError when a held file cannot be read or lists something that is not a record path:
    a caller that deletes must then delete nothing."""
    listed: set[str] = set()
    dead: list[Path] = []
    for path in pending_files(root):
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(mode):
            dead.append(path)  # no build makes a link: removed as a link, never followed
            continue
        if not stat.S_ISREG(mode):
            continue  # a folder or a FIFO is nobody's file: left alone (``file_or_link``)
        lines = _read_if_held(path)
        if lines is None:
            dead.append(path)
            continue
        for line in lines:
            if not SNAPSHOT_REL_RE.fullmatch(line):
                raise StoreError(
                    f"{path}, the pending file of a running build, lists {line[:80]!r}, not a "
                    f"record path; nothing was removed; run gc again when the build has ended"
                )
            listed.add(line)
    return listed, dead


def _read_if_held(path: Path) -> list[str] | None:
    """The lines of a pending file a build holds; None when nobody holds it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise StoreError(
            f"{path}, a build's pending file, cannot be opened ({exc.strerror or exc}); nothing "
            f"was removed; check the file's permissions"
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
        else:
            return None  # nobody holds it: its build has ended
        size = os.fstat(fd).st_size
        if size > MAX_PENDING_BYTES:
            raise StoreError(
                f"{path}, the pending file of a running build, is {size} bytes, over the "
                f"{MAX_PENDING_BYTES}-byte limit; nothing was removed; run gc again when the "
                f"build has ended"
            )
        data = os.pread(fd, size, 0)
    finally:
        os.close(fd)
    try:
        return data.decode("ascii").splitlines()
    except UnicodeDecodeError:
        raise StoreError(
            f"{path}, the pending file of a running build, is not text; nothing was removed; "
            f"run gc again when the build has ended"
        ) from None
