"""A store as a plain tarball: ``pack`` writes a verified store's files, ``unpack`` checks a
tarball entry by entry and installs it.

An archive holds exactly the files ``store/shipping.py`` allows, by their path relative to
the store root; ``unpack`` refuses any other entry (escapes, links, devices, folders,
duplicates) and bounds the archive's expansion (``store/tar_limits.py``) before a byte is
written, then installs through ``store/install.py``'s staged, verified, atomic install.

No mlx here: pack and unpack never import it.
"""

from __future__ import annotations

import contextlib
import lzma
import os
import shutil
import tarfile
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable

from kvsnap.snapshot.format import PART_FOLDERS
from kvsnap.store.fileio import CHUNK, fsync_dir
from kvsnap.store.install import StagedInstall, check_destination
from kvsnap.store.local import FILE_MODE, SNAPSHOTS
from kvsnap.store.shipping import ShipError, check_relpath, collect_store, open_checked
from kvsnap.store.tar_limits import BoundedTarInfo, ExpansionGuard, UnpackLimits


class ArchiveError(ShipError):
    """A tarball that cannot be read, or holds an entry kvsnap refuses to unpack."""


@dataclass
class PackReport:
    archive: Path
    files: list[str]
    nbytes: int


@dataclass
class UnpackReport:
    dest: Path
    files: list[str]
    nbytes: int
    # differed from the store's good file of that name: not installed
    kept: list[str] = field(default_factory=list)


def _tar_mode(name: str, write: bool) -> str:
    if not write:
        return "r:*"
    lower = name.lower()
    for suffixes, comp in (
        ((".tar.gz", ".tgz"), "gz"),
        ((".tar.bz2", ".tbz2"), "bz2"),
        ((".tar.xz", ".txz"), "xz"),
    ):
        if lower.endswith(suffixes):
            return f"w:{comp}"
    return "w"


class _Counted:
    """A file read through, calling ``on_bytes(n)`` as the read position first passes bytes
    (tarfile seeks back while it guesses the compression: those bytes count once)."""

    def __init__(self, raw: BinaryIO, on_bytes: Callable[[int], None] | None):
        self.raw, self.on_bytes, self.reported = raw, on_bytes, 0

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.advance_to(self.raw.tell())
        return data

    def advance_to(self, pos: int) -> None:
        if self.on_bytes is not None and pos > self.reported:
            self.on_bytes(pos - self.reported)
            self.reported = pos

    def __getattr__(self, name: str):
        return getattr(self.raw, name)


def pack(
    root: str | os.PathLike,
    out: str | os.PathLike,
    on_bytes: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> PackReport:
    """Verify the store, then write its manifest and snapshots to a tarball (atomically,
    ``0600``). ``on_total(n)``: the store bytes to pack, once verified; ``on_bytes(n)`` as they
    are read: its sum is ``nbytes``."""
    files = collect_store(root)
    out_path = Path(out).expanduser().absolute()
    store_root = Path(root).expanduser().resolve()
    if out_path.resolve() == store_root or store_root in out_path.resolve().parents:
        raise ArchiveError(
            f"{out_path}: the archive would be written inside the store {store_root}; write it "
            f"elsewhere"
        )
    if out_path.is_dir():
        raise ArchiveError(f"{out_path} is a folder; give a file name like snaps.tar")
    if not out_path.parent.is_dir():
        raise ArchiveError(f"{out_path.parent}: no such folder; create it first")
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{out_path.name}.", dir=out_path.parent)
    total = 0
    if on_total is not None:
        on_total(sum(f.size for f in files))
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as raw:
            with tarfile.open(
                fileobj=raw, mode=_tar_mode(out_path.name, True), format=tarfile.PAX_FORMAT
            ) as tar:  # type: ignore[call-overload]  # mode from the file name
                for f in files:
                    with open_checked(f) as fh:
                        info = tarfile.TarInfo(f.relpath)
                        info.size = f.size
                        info.mode = FILE_MODE
                        info.mtime = int(os.fstat(fh.fileno()).st_mtime)
                        info.uid = info.gid = 0
                        info.uname = info.gname = ""
                        tar.addfile(info, _Counted(fh, on_bytes))
                        total += f.size
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, out_path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise ArchiveError(f"cannot write {out_path} ({exc.strerror or exc})") from None
        raise
    fsync_dir(out_path.parent)
    return PackReport(out_path, [f.relpath for f in files], total)


def _member_name(member: tarfile.TarInfo) -> str:
    name = member.name
    while name.startswith("./"):
        name = name[2:]
    return name.rstrip("/") if member.isdir() else name


def _check_name(name: str, where: str) -> None:
    try:
        check_relpath(name, where)
    except ShipError as exc:
        raise ArchiveError(str(exc)) from None


def unpack(
    archive: str | os.PathLike,
    dest: str | os.PathLike,
    limits: UnpackLimits | None = None,
    on_bytes: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> UnpackReport:
    """Unpack a tarball made by ``pack`` into ``dest``: checked entry by entry (names, kinds, and
    sizes against ``limits`` before a byte is written), verified, installed atomically.
    ``on_total(n)``: the archive's size; ``on_bytes(n)`` as the archive is read (compressed
    bytes; the sum is the archive's size once it is unpacked)."""
    limits = limits or UnpackLimits.from_env()
    path = Path(archive).expanduser()
    if not path.is_file():
        raise ArchiveError(
            f"{path}: no such archive file; make one with `kvsnap pack STORE -o {path}`"
        )
    where = str(path)
    check_destination(dest)  # before reading anything: a bad destination is a usage error
    raw = None
    try:
        raw = open(path, "rb")
        size = os.fstat(raw.fileno()).st_size
        counted = _Counted(raw, on_bytes)
        # the mode is chosen at run time, the file object is duck-typed: typeshed wants literals
        open_tar: Any = tarfile.open
        tar = open_tar(fileobj=counted, mode=_tar_mode(path.name, False), tarinfo=BoundedTarInfo)
        guard = ExpansionGuard(limits, size)
    except (tarfile.TarError, OSError, EOFError, zlib.error, lzma.LZMAError) as exc:
        if raw is not None:
            raw.close()
        first = (str(exc).splitlines() or [type(exc).__name__])[0].rstrip(":")
        raise ArchiveError(
            f"{path}: not a readable tar archive (.tar, .tar.gz, .tar.bz2, .tar.xz: {first}); make "
            f"one with `kvsnap pack`"
        ) from None
    if on_total is not None:
        on_total(size)
    total = 0
    with raw, tar, StagedInstall(Path(dest)) as staging:
        try:
            # streaming: one entry at a time, nothing extracted by tarfile itself
            for member in tar:
                name = _member_name(member)
                label = f"{where}: entry {member.name!r}"
                if member.issym() or member.islnk():
                    raise ArchiveError(
                        f"{label} is a {'symbolic' if member.issym() else 'hard'} link (to "
                        f"{member.linkname!r}); refusing it (a store holds only regular files)"
                    )
                if member.isdir():
                    if name in ("", ".", SNAPSHOTS, *PART_FOLDERS):
                        too_many = guard.admit(0)  # only the entry count can be broken here
                        if too_many:
                            raise ArchiveError(f"{label}: the archive {too_many}; refusing it")
                        continue
                    _check_name(name, where)  # says escape or unknown
                    raise ArchiveError(f"{label}: unexpected folder; refusing it")
                if not member.isreg():
                    kind = (
                        "device"
                        if (member.ischr() or member.isblk())
                        else "FIFO"
                        if member.isfifo()
                        else "special file"
                    )
                    raise ArchiveError(
                        f"{label} is a {kind}; refusing it (a store holds only regular files)"
                    )
                _check_name(name, where)
                if name in staging.staged:
                    raise ArchiveError(f"{label} appears twice; refusing the archive")
                too_big = guard.admit(member.size)
                if too_big:
                    raise ArchiveError(
                        f"{label}: the archive {too_big}; refusing it (nothing was changed in "
                        f"{staging.dest})"
                    )
                src = tar.extractfile(member)
                assert src is not None
                with staging.open(name) as out:
                    shutil.copyfileobj(src, out, CHUNK)
                total += member.size
            if not staging.staged:
                raise ArchiveError(
                    f"{where}: no store files inside (no manifest.json, no snapshots/); make the "
                    f"archive with `kvsnap pack`"
                )
        except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError) as exc:
            raise ArchiveError(
                f"{where}: archive is truncated or corrupt ({exc}); nothing was changed in "
                f"{staging.dest}"
            ) from None
        except OSError as exc:
            raise ArchiveError(
                f"{where}: cannot unpack ({exc.strerror or exc}); nothing was changed in "
                f"{staging.dest}"
            ) from None
        # the end-of-archive blocks tarfile stops before count as read
        counted.advance_to(size)
        staging.verify(where)
        files = list(staging.staged)
        staging.commit()
        return UnpackReport(staging.dest, files, total, list(staging.kept))
