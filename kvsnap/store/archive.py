"""A store as a set of files to ship: the checked file list, a staged atomic install, plain tarballs.

Shipping moves exactly these files, by their path relative to the store root:
``manifest.json``, ``snapshots/<key>.safetensors`` (records, or v2 whole files) and the
``blocks/<key>.safetensors`` and ``checkpoints/<key>.safetensors`` a record reaches. Nothing else is packed, pushed,
unpacked or pulled, so a name from an archive or a registry can never point outside the
store (``../x``, ``/etc/x``, ``snapshots/../../x`` are refused), nor at ``.lock`` or a
temp file.

Installs are staged: files are written (``0600``) into a temp folder next to the store
(``.kvsnap-stage-<name>-*``, ``0700``), checked — every snapshot's own checksum, every
field of the manifest — and only then moved in: a new store by renaming the whole folder,
an existing one under the store's writer lock, snapshots first, then the shipped
manifest's records are *merged* into the store's own (never replacing it: the store's
other records, and so their snapshots, stay live for ``gc``). A failed install removes the
temp folder and leaves the store as it was.

No mlx here: pack, unpack, push and pull never import it.
"""

from __future__ import annotations

import contextlib
import errno
import filecmp
import hashlib
import lzma
import os
import re
import shutil
import stat
import tarfile
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from kvsnap.errors import KvsnapError, ManifestError, SnapshotError, StoreError
from kvsnap.store.manifest import parse_manifest, referenced_files
from kvsnap.snapshot.format import PART_FOLDERS, PART_REL_RE, STORE_FILE_RE, relpath_of_file
from kvsnap.store.local import DIR_MODE, FILE_MODE, MANIFEST, SNAPSHOTS, Store
from kvsnap.store.tar_limits import BoundedTarInfo, ExpansionGuard, UnpackLimits
from kvsnap.store.stage import STAGE_PREFIX, adopt_stage, clean_stale_stages, new_stage  # noqa: F401  (STAGE_PREFIX re-exported)
CHUNK = 1 << 20


class ShipError(KvsnapError):
    """A store that cannot be shipped, or shipped content that cannot be installed."""


class ArchiveError(ShipError):
    """A tarball that cannot be read, or holds an entry kvsnap refuses to unpack."""


# --- which paths may be shipped -----------------------------------------------------------


SHIPPED = "only manifest.json and snapshots/, blocks/, checkpoints/<key>.safetensors are shipped"


def is_store_relpath(name: str) -> bool:
    return name == MANIFEST or bool(STORE_FILE_RE.fullmatch(name))


def check_relpath(name: str, where: str) -> str:
    """``name`` if it is a store file path; else a ShipError saying why (escape or unknown)."""
    if not isinstance(name, str) or not name:
        raise ShipError(f"{where}: empty file name; refusing it")
    if is_store_relpath(name):
        return name
    parts = name.replace("\\", "/").split("/")
    if name.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", name) or ".." in parts or "\x00" in name:
        raise ShipError(f"{where}: {name!r} escapes the store folder; refusing it ({SHIPPED})")
    raise ShipError(f"{where}: {name!r} is not a store file ({SHIPPED}); refusing it")


# --- the files of a local store -----------------------------------------------------------


@dataclass(frozen=True)
class StoreFile:
    relpath: str
    path: Path
    size: int
    ino: tuple[int, int]  # (st_dev, st_ino) when checked: a file replaced since is noticed


def check_manifest_bytes(data: bytes, where: str, dest: Path | None = None) -> dict:
    """A shipped manifest, checked field by field like the store's own; ShipError (nothing changed) if not."""
    untouched = f"nothing was changed in {dest}" if dest is not None else "nothing was changed"
    try:
        return parse_manifest(data, f"{where}: {MANIFEST}", f"refusing it ({untouched})")
    except ManifestError as exc:
        raise ShipError(str(exc)) from None


def collect_store(root: str | os.PathLike) -> list[StoreFile]:
    """Every file of the store to ship, each fully verified; refuses a store with any bad file."""
    store = Store.open(root, readonly=True).require_store()
    from kvsnap.store.parts import chain_relpaths

    files: list[StoreFile] = []
    reached: set[str] = set()
    for path in store.snapshot_files():
        try:
            reached.update(chain_relpaths(store.verify_file(path)))  # a record's blocks and checkpoints too
        except SnapshotError as exc:
            raise ShipError(f"{exc.path}: {exc.reason}; refusing to ship a store with a bad snapshot ({exc.fix}, or remove it; `kvsnap verify {store.root}` lists them)") from None
        st = path.stat()
        files.append(StoreFile(relpath_of_file(path.name), path, st.st_size, (st.st_dev, st.st_ino)))
    for rel in sorted(reached):  # parts no record reaches are gc's, not shipped
        st = (store.root / rel).stat()
        files.append(StoreFile(rel, store.root / rel, st.st_size, (st.st_dev, st.st_ino)))
    manifest = store.root / MANIFEST
    if manifest.exists() or manifest.is_symlink():
        st = manifest.lstat()
        if not stat.S_ISREG(st.st_mode):
            raise ShipError(f"{manifest}: not a regular file; refusing to ship it")
        missing = store.missing_files()  # read_manifest raises StoreError for a bad one
        if missing:
            raise ShipError(f"{store.root / missing[0]}: listed in the manifest but missing; run `kvsnap build` again (or `kvsnap verify {store.root}`) before shipping")
        files.append(StoreFile(MANIFEST, manifest, st.st_size, (st.st_dev, st.st_ino)))
    if not files:
        raise ShipError(f"{store.root}: the store is empty; build it first with `kvsnap build`")
    return files


@contextlib.contextmanager
def open_checked(f: StoreFile) -> Iterator[BinaryIO]:
    """Open a collected file, refusing it if it was replaced since it was verified."""
    fh = open(f.path, "rb")
    try:
        st = os.fstat(fh.fileno())
        if (st.st_dev, st.st_ino) != f.ino or st.st_size != f.size:
            raise ShipError(f"{f.path}: changed while shipping (a build or gc running?); run the command again")
        yield fh
    finally:
        fh.close()


def sha256_file(path: Path) -> str:
    from kvsnap.store.fileio import hash_file

    return "sha256:" + hash_file(path, hashlib.sha256()).hexdigest()


def present_with_digest(path: Path, size: int, digest: str) -> bool:
    """A regular file (not a link) of that size and sha256."""
    try:
        st = path.lstat()
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:
        return False
    try:
        return sha256_file(path) == digest
    except OSError:
        return False


# --- staged, atomic install ---------------------------------------------------------------


def existing_file_is_good(store: Store, relpath: str) -> bool:
    """A store file that passes its own checks (a record's parts are checked on their own)."""
    from kvsnap.store.parts import check_part

    path = store.root / relpath
    try:
        if PART_REL_RE.fullmatch(relpath):
            check_part(store, "block" if relpath.startswith(PART_FOLDERS[0]) else "checkpoint", path.stem, path=path)
        else:
            store.verify_file(path, parts=False)
    except (SnapshotError, OSError):
        return False
    return True


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
            raise StoreError(f"snapshot store {str(dest)!r} is a file, not a directory; give a folder")
        if any(path.iterdir()) and not Store(root=path).is_initialized():
            raise ShipError(f"{path} is not empty and not a kvsnap store; give an empty or new folder, or a store")
    return path


@dataclass
class StagedInstall:
    """Write files into a temp folder beside ``dest``, verify them, then move them in."""

    dest: Path
    tmp: Path | None = None
    staged: list[str] = field(default_factory=list)
    manifest: dict | None = None  # the shipped manifest, once verified
    reached: set[str] = field(default_factory=set)  # blocks and checkpoints the staged records need
    kept: list[str] = field(default_factory=list)  # shipped files that differ from the store's good one: not installed
    resume: bool = False  # take over a killed install's stage for this dest (pull: its files are digest-checked)
    leftover: set[str] = field(default_factory=set)  # files of an adopted stage not yet reused
    _lock_fd: int | None = None  # held while this install runs: a live stage is never cleaned or adopted

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
            raise ShipError(f"cannot make a temp folder next to {self.dest} ({exc.strerror or exc}); check the parent folder's permissions") from None

    def __enter__(self) -> "StagedInstall":
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()

    def _sweep_adopted(self) -> set[str]:
        """The store files an adopted stage holds; anything else in it is removed."""
        assert self.tmp is not None
        found = set()
        for entry in self.tmp.iterdir():
            if entry.name in (SNAPSHOTS, *PART_FOLDERS) and not entry.is_symlink() and entry.is_dir():
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
        """Count a file a killed install staged as staged, if it has this size and sha256; else drop it."""
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
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), FILE_MODE)
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        self.staged.append(relpath)

    def verify(self, source: str) -> None:
        """Every staged file's own checks (header, key, checksum; a block's or checkpoint's too) and
        the manifest's JSON. A record's parts are checked where they will be: staged, or already in ``dest``."""
        from kvsnap.store.parts import chain_relpaths, check_part

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
                    check_part(store, "block" if relpath.startswith(PART_FOLDERS[0]) else "checkpoint", path.stem, path=path)
                else:
                    self.reached.update(chain_relpaths(store.verify_file(path, parts=False)))
            except SnapshotError as exc:
                raise ShipError(f"{source}: {relpath}: {exc.reason}; refusing it (nothing was changed in {self.dest})") from None

    def _check_references(self, present: Callable[[str], bool]) -> None:
        """Every snapshot the shipped manifest lists is shipped too, or already in the store."""
        parts = sorted(r for r in self.reached if r not in self.staged and not present(r))
        if parts:
            raise ShipError(f"a shipped record needs {parts[0]}, which was not shipped and is not in {self.dest}; refusing it (nothing was changed in {self.dest}); ship the whole store with `kvsnap pack` or `kvsnap push`")
        if self.manifest is None:
            return
        missing = sorted(r for r in referenced_files(self.manifest) if r not in self.staged and not present(r))
        if missing:
            raise ShipError(f"{MANIFEST} lists {missing[0]}, which was not shipped and is not in {self.dest}; refusing it (nothing was changed in {self.dest}); ship the whole store with `kvsnap pack` or `kvsnap push`")

    def commit(self) -> None:
        """Move the staged files into ``dest``: all at once for a new store, else under the lock, merging the manifest."""
        assert self.tmp is not None
        if not self.staged:  # everything was already in place: leave the store untouched
            self.cleanup()
            return
        for folder in (*(self.tmp / f for f in (SNAPSHOTS, *PART_FOLDERS)), self.tmp):
            _fsync_dir(folder)
        if not self.dest.exists():
            self._check_references(lambda relpath: False)
            try:
                os.rename(self.tmp, self.dest)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise ShipError(f"cannot move the new store into {self.dest} ({exc.strerror or exc})") from None
            else:
                self.tmp = None
                self.cleanup()  # releases the stage lock, now on the new store's folder
                _fsync_dir(self.dest.parent)
                return
        try:
            store = Store.open(self.dest, create=True)
            with store.lock():
                try:
                    store.read_manifest()  # the store's own must be sound before anything moves
                except ManifestError as exc:
                    raise ShipError(f"{exc}; the install merges into it, so nothing was changed in {self.dest}") from None
                self._check_references(lambda relpath: _is_regular_file(store.root / relpath))
                # Parts before records, records before the manifest: what lands is always whole.
                files = sorted((r for r in self.staged if r != MANIFEST), key=lambda r: not PART_REL_RE.fullmatch(r))
                files = [r for r in files if not self._keeps_existing(store, r)]
                for relpath in files:
                    (store.root / relpath).parent.mkdir(mode=DIR_MODE, exist_ok=True)
                    os.replace(self.tmp / relpath, store.root / relpath)
                for folder in sorted({(store.root / r).parent for r in files}):
                    _fsync_dir(folder)
                if self.manifest is not None:
                    store.merge_manifest(self.manifest)
        except OSError as exc:
            raise ShipError(f"cannot move files into {self.dest} ({exc.strerror or exc}); check its permissions") from None
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


# --- tarballs -----------------------------------------------------------------------------


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
    kept: list[str] = field(default_factory=list)  # differed from the store's good file of that name: not installed


def _tar_mode(name: str, write: bool) -> str:
    if not write:
        return "r:*"
    lower = name.lower()
    for suffixes, comp in (((".tar.gz", ".tgz"), "gz"), ((".tar.bz2", ".tbz2"), "bz2"), ((".tar.xz", ".txz"), "xz")):
        if lower.endswith(suffixes):
            return f"w:{comp}"
    return "w"


def pack(root: str | os.PathLike, out: str | os.PathLike) -> PackReport:
    """Verify the store, then write its manifest and snapshots to a tarball (atomically, ``0600``)."""
    files = collect_store(root)
    out_path = Path(out).expanduser().absolute()
    store_root = Path(root).expanduser().resolve()
    if out_path.resolve() == store_root or store_root in out_path.resolve().parents:
        raise ArchiveError(f"{out_path}: the archive would be written inside the store {store_root}; write it elsewhere")
    if out_path.is_dir():
        raise ArchiveError(f"{out_path} is a folder; give a file name like snaps.tar")
    if not out_path.parent.is_dir():
        raise ArchiveError(f"{out_path.parent}: no such folder; create it first")
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{out_path.name}.", dir=out_path.parent)
    total = 0
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as raw:
            with tarfile.open(fileobj=raw, mode=_tar_mode(out_path.name, True), format=tarfile.PAX_FORMAT) as tar:
                for f in files:
                    with open_checked(f) as fh:
                        info = tarfile.TarInfo(f.relpath)
                        info.size = f.size
                        info.mode = FILE_MODE
                        info.mtime = int(os.fstat(fh.fileno()).st_mtime)
                        info.uid = info.gid = 0
                        info.uname = info.gname = ""
                        tar.addfile(info, fh)
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
    _fsync_dir(out_path.parent)
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


def unpack(archive: str | os.PathLike, dest: str | os.PathLike, limits: UnpackLimits | None = None) -> UnpackReport:
    """Unpack a tarball made by ``pack`` into ``dest``: checked entry by entry (names, kinds, and
    sizes against ``limits`` before a byte is written), verified, installed atomically."""
    limits = limits or UnpackLimits.from_env()
    path = Path(archive).expanduser()
    if not path.is_file():
        raise ArchiveError(f"{path}: no such archive file; make one with `kvsnap pack STORE -o {path}`")
    where = str(path)
    check_destination(dest)  # before reading anything: a bad destination is a usage error
    try:
        tar = tarfile.open(path, _tar_mode(path.name, False), tarinfo=BoundedTarInfo)
        guard = ExpansionGuard(limits, path.stat().st_size)
    except (tarfile.TarError, OSError, EOFError, zlib.error, lzma.LZMAError) as exc:
        first = (str(exc).splitlines() or [type(exc).__name__])[0].rstrip(":")
        raise ArchiveError(f"{path}: not a readable tar archive (.tar, .tar.gz, .tar.bz2, .tar.xz: {first}); make one with `kvsnap pack`") from None
    total = 0
    with tar, StagedInstall(Path(dest)) as staging:
        try:
            for member in tar:  # streaming: one entry at a time, nothing extracted by tarfile itself
                name = _member_name(member)
                label = f"{where}: entry {member.name!r}"
                if member.issym() or member.islnk():
                    raise ArchiveError(f"{label} is a {'symbolic' if member.issym() else 'hard'} link (to {member.linkname!r}); refusing it (a store holds only regular files)")
                if member.isdir():
                    if name in ("", ".", SNAPSHOTS, *PART_FOLDERS):
                        too_many = guard.admit(0)  # only the entry count can be broken here
                        if too_many:
                            raise ArchiveError(f"{label}: the archive {too_many}; refusing it")
                        continue
                    _check_name(name, where)  # says escape or unknown
                    raise ArchiveError(f"{label}: unexpected folder; refusing it")
                if not member.isreg():
                    kind = "device" if (member.ischr() or member.isblk()) else "FIFO" if member.isfifo() else "special file"
                    raise ArchiveError(f"{label} is a {kind}; refusing it (a store holds only regular files)")
                _check_name(name, where)
                if name in staging.staged:
                    raise ArchiveError(f"{label} appears twice; refusing the archive")
                too_big = guard.admit(member.size)
                if too_big:
                    raise ArchiveError(f"{label}: the archive {too_big}; refusing it (nothing was changed in {staging.dest})")
                src = tar.extractfile(member)
                assert src is not None
                with staging.open(name) as out:
                    shutil.copyfileobj(src, out, CHUNK)
                total += member.size
            if not staging.staged:
                raise ArchiveError(f"{where}: no store files inside (no manifest.json, no snapshots/); make the archive with `kvsnap pack`")
        except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError) as exc:
            raise ArchiveError(f"{where}: archive is truncated or corrupt ({exc}); nothing was changed in {staging.dest}") from None
        except OSError as exc:
            raise ArchiveError(f"{where}: cannot unpack ({exc.strerror or exc}); nothing was changed in {staging.dest}") from None
        staging.verify(where)
        files = list(staging.staged)
        staging.commit()
        return UnpackReport(staging.dest, files, total, list(staging.kept))
