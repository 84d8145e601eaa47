"""A store as a set of files to ship: which paths may be shipped, and the checked file list.

Shipping moves exactly these files, by their path relative to the store root:
``manifest.json``, ``snapshots/<key>.safetensors`` (records, or v2 whole files) and the
``blocks/<key>.safetensors`` and ``checkpoints/<key>.safetensors`` a record reaches. Nothing else
is packed, pushed,
unpacked or pulled, so a name from an archive or a registry can never point outside the
store (``../x``, ``/etc/x``, ``snapshots/../../x`` are refused), nor at ``.lock`` or a
temp file.

Installing shipped files is ``store/install.py``'s; tarballs are ``store/archive.py``'s, a
registry ``store/oci``'s. No mlx here.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

from kvsnap.errors import KvsnapError, SnapshotError
from kvsnap.snapshot.format import STORE_FILE_RE, relpath_of_file
from kvsnap.store.local import MANIFEST, Store


class ShipError(KvsnapError):
    """A store that cannot be shipped, or shipped content that cannot be installed."""


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
    if (
        name.startswith(("/", "\\"))
        or re.match(r"[A-Za-z]:", name)
        or ".." in parts
        or "\x00" in name
    ):
        raise ShipError(f"{where}: {name!r} escapes the store folder; refusing it ({SHIPPED})")
    raise ShipError(f"{where}: {name!r} is not a store file ({SHIPPED}); refusing it")


# --- the files of a local store -----------------------------------------------------------


@dataclass(frozen=True)
class StoreFile:
    relpath: str
    path: Path
    size: int
    ino: tuple[int, int]  # (st_dev, st_ino) when checked: a file replaced since is noticed


def collect_store(root: str | os.PathLike) -> list[StoreFile]:
    """Every file of the store to ship, each fully verified; refuses a store with any bad file."""
    store = Store.open(root, readonly=True).require_store()
    from kvsnap.store.paths import chain_relpaths

    files: list[StoreFile] = []
    reached: set[str] = set()
    for path in store.snapshot_files():
        try:
            # a record's blocks and checkpoints too
            reached.update(chain_relpaths(store.verify_file(path)))
        except SnapshotError as exc:
            raise ShipError(
                f"{exc.path}: {exc.reason}; refusing to ship a store with a bad snapshot "
                f"({exc.fix}, or remove it; `kvsnap verify {store.root}` lists them)"
            ) from None
        st = path.stat()
        files.append(
            StoreFile(relpath_of_file(path.name), path, st.st_size, (st.st_dev, st.st_ino))
        )
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
            raise ShipError(
                f"{store.root / missing[0]}: listed in the manifest but missing; run `kvsnap "
                f"build` again (or `kvsnap verify {store.root}`) before shipping"
            )
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
            raise ShipError(
                f"{f.path}: changed while shipping (a build or gc running?); run the command again"
            )
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
