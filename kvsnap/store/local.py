"""The snapshot store on disk: atomic writes, header-only scans, verification, manifest, gc, lock.

Layout (every path relative to the root, so the folder can be moved or shipped; the names
are ``snapshot/format.py``'s)::

    ROOT/manifest.json               what each build produced: one record per (model, agents file)
    ROOT/snapshots/<key>.safetensors   one record per warm prefix, named by its content key
    ROOT/blocks/<key>.safetensors      attention KV of one run of tokens, shared by records
    ROOT/checkpoints/<key>.safetensors non-trimmable layers' state at one token count
    ROOT/.lock                       writers hold an exclusive flock on it
    ROOT/.pending-<random>           a running build's records not yet in the manifest (gc keeps
                                     them while the build holds the file; ``store/pending.py``)

Only ``load_arrays`` imports mlx.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from kvsnap.errors import SnapshotError, StoreError
from kvsnap.key import ModelIdentity, unpack_tokens
from kvsnap.snapshot.file import (
    FormatError,
    OutTensor,
    check_data,
    parse_header,
    read_header,
    tensor_bytes,
    verify_checksum,
    write_snapshot,
)
from kvsnap.snapshot.format import (
    CONVERSATIONS,
    DTYPES,
    KEY_RE,
    MANIFEST,
    PART_FOLDERS,
    SNAPSHOTS,
    SUFFIX,
    TOKENS,
    relpath_of_file,
    snapshot_filename,
)
from kvsnap.snapshot.header import (
    MAX_NAME_CHARS,
    MAX_TOKENS,
    SnapshotInfo,
    check_token_count,
    inspect_header,
)
from kvsnap.snapshot.layer_list import check_offsets
from kvsnap.store.conversations import conversation_files
from kvsnap.store.fileio import (
    DIR_MODE,
    FILE_MODE,
    TMP_PREFIX,
    FaultFn,
    atomic_write,
    check_regular,
    check_store_folders,
    default_fsync,
    file_or_link,
    fsync_dir,
    make_dirs,
    read_whole,
    remove_store_file,
    store_files,
    store_folder,
)
from kvsnap.store.foreign import Problem, classify, require_model
from kvsnap.store.manifest import (
    encode_manifest,
    merge_manifests,
    read_manifest_file,
    referenced_files,
    update_manifest,
)
from kvsnap.store.parts import (
    assemble,
    chain_relpaths,
    part_files,
    part_relpath_of_file,
    reached_parts,
    verify_chain,
)
from kvsnap.store.pending import held_references

LOCK = ".lock"
# the modes and prefix others import from here
__all__ = ["DIR_MODE", "FILE_MODE", "TMP_PREFIX", "Store"]


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
        if not isinstance(key, str) or not KEY_RE.fullmatch(key):
            raise StoreError(f"snapshot key {key!r} is not 32 lowercase hex digits")
        return self.snapshots_dir / snapshot_filename(key)

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

    # --- writing ----------------------------------------------------------------

    def _atomic_write(self, target: Path, write: Callable[[Any], object]) -> None:
        atomic_write(target, write, self.fault, self.fsync)

    def put(self, key: str, tensors: list[OutTensor], metadata: dict[str, str]) -> Path:
        """Write one snapshot atomically. The caller holds the lock."""
        target = self.path_for(key)
        name = metadata.get("kvsnap.name", "")
        if len(name) > MAX_NAME_CHARS:  # never write a file the reader would refuse
            raise StoreError(
                f"agent name {name[:40]!r}... is {len(name)} characters, over the {MAX_NAME_CHARS} "
                f"a snapshot may hold; give the agent a shorter name"
            )
        try:
            self._atomic_write(
                target, lambda f: write_snapshot(f, tensors, metadata, on_progress=self.fault)
            )
        except OSError as exc:
            hint = (
                "free some disk space"
                if exc.errno == errno.ENOSPC
                else "check the folder's permissions"
            )
            raise StoreError(
                f"cannot write snapshot {target} ({exc.strerror or exc}); the store is unchanged; "
                f"{hint}"
            ) from exc
        self.fault("after-rename")
        return target

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

    # --- reading ----------------------------------------------------------------

    def snapshot_files(self) -> list[Path]:
        """The agents' records; StoreError when ``snapshots/`` is a link (``store_folder``)."""
        return store_files(self.root, SNAPSHOTS, SUFFIX)

    def temp_files(self) -> list[Path]:
        found = [p for p in self.root.iterdir() if p.name.startswith(TMP_PREFIX)]
        for name in (SNAPSHOTS, *PART_FOLDERS, CONVERSATIONS):
            folder = store_folder(self.root, name)
            if folder is not None:
                found += [p for p in folder.iterdir() if p.name.startswith(TMP_PREFIX)]
        return sorted(found)

    def inspect(self, path: Path, max_tokens: int = MAX_TOKENS) -> SnapshotInfo:
        """Header checks only (cheap), tokens included, from one open and one header parse;
        raises SnapshotError naming the file and the reason. ``max_tokens`` bounds the token
        count before the tokens are read (the model's context, when the caller knows it)."""
        self._check_regular(path)
        try:
            with open(path, "rb") as f:
                header = parse_header(f, os.fstat(f.fileno()).st_size)
                check_token_count(header, max_tokens)
                tok = header.tensors.get(TOKENS)
                raw = None
                if tok is not None:  # its bounds were checked against the file size by parse_header
                    f.seek(header.data_start + tok.start)
                    raw = f.read(tok.nbytes)
            info = inspect_header(path, header, raw, max_tokens)
        except FormatError as exc:
            raise SnapshotError(str(path), str(exc)) from None
        except OSError as exc:
            raise SnapshotError(
                str(path), f"cannot be read ({exc.strerror or exc})", "check the file's permissions"
            ) from None
        # a record's size is its state's: its blocks and checkpoints (a stat each)
        if info.chain is not None:
            info = replace(
                info,
                nbytes=info.nbytes + sum(_size(self.root / rel) for rel in chain_relpaths(info)),
            )
        return info

    def _check_regular(self, path: Path) -> None:
        check_regular(path, self.root)

    def verify_file(
        self, path: Path, expected: ModelIdentity | None = None, parts: bool = True
    ) -> SnapshotInfo:
        """Full check: header, identity, tokens, data checksum, and (optionally) the model; for a
        v3 record also every block and checkpoint it reaches (unless ``parts`` is False)."""
        info = self.inspect(path)
        try:
            check_data(path, read_header(path))
            check_offsets(info.layers, info.n_tokens)
        except FormatError as exc:
            raise SnapshotError(str(path), str(exc)) from None
        require_model(info, expected)
        if info.chain is not None and parts:
            verify_chain(self, info)
        return info

    def scan(
        self, expected: ModelIdentity | None = None, max_tokens: int = MAX_TOKENS
    ) -> tuple[list[SnapshotInfo], list[Problem]]:
        """Header-only scan of every snapshot; foreign ones are problems only when ``expected`` is
        given."""
        infos, bad = [], []
        for path in self.snapshot_files():
            try:
                infos.append(self.inspect(path, max_tokens))
            except SnapshotError as exc:
                bad.append(Problem(path, exc.reason))
        good, foreign = classify(infos, expected)
        return good, bad + foreign

    def read_tokens(self, info: SnapshotInfo) -> list[int]:
        """The token ids a snapshot holds: from the index when it has them, else from the file (no
        mlx)."""
        if info.tokens or info.n_tokens == 0:
            return list(info.tokens)
        try:
            raw = tensor_bytes(info.path, read_header(info.path), TOKENS)
        except (FormatError, KeyError) as exc:
            raise SnapshotError(str(info.path), f"tokens cannot be read ({exc})") from None
        except OSError as exc:
            raise SnapshotError(str(info.path), f"cannot be read ({exc.strerror or exc})") from None
        return unpack_tokens(raw)

    def load_arrays(self, info: SnapshotInfo, expected: ModelIdentity | None = None) -> dict:
        """Read the file once into mlx memory, checksum exactly those bytes, and view the tensors.

        One open file, one copy: the header is parsed and the data read through the same
        descriptor straight into an mlx buffer (nothing is memory-mapped), the checksum is
        computed over those very bytes, and the tensors are zero-copy views of the buffer.
        So what is verified is what is served, even if the file is replaced meanwhile.
        """
        import mlx.core as mx

        path = info.path
        self._check_regular(path)
        try:
            header, buf, view = read_whole(path)
            tok = header.tensors.get(TOKENS)
            # The tokens come from the bytes just read: one open, one parse, one read.
            current = inspect_header(
                path, header, bytes(view[tok.start : tok.end]) if tok is not None else None
            )
            verify_checksum(header, view)
            check_offsets(current.layers, current.n_tokens)
            if (
                current.key != info.key
                or current.layers != info.layers
                or current.n_tokens != info.n_tokens
                or current.chain != info.chain
            ):
                raise SnapshotError(
                    str(path),
                    f"now holds another snapshot (key {current.key}) than the one indexed "
                    f"({info.key})",
                    "restart, or rebuild it with `kvsnap build`",
                )
            require_model(current, expected)
        except FormatError as exc:
            raise SnapshotError(str(path), str(exc)) from None
        except OSError as exc:
            raise SnapshotError(
                str(path), f"cannot be read ({exc.strerror or exc})", "check the file's permissions"
            ) from None
        # a v3 record (just read and checked): its state is in blocks and checkpoints
        if current.chain is not None:
            return assemble(self, current)[0]
        arrays = {}
        for name, entry in header.tensors.items():
            arrays[name] = (
                buf[entry.start : entry.end]
                .view(getattr(mx, DTYPES[entry.dtype][0]))
                .reshape(entry.shape)
            )
        mx.eval(list(arrays.values()))
        return arrays

    # --- garbage collection -----------------------------------------------------

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
        """Temp files and snapshots no manifest record refers to; removed only when ``apply``.

        Without a manifest nothing says which snapshots are in use (a store copied
        without it, or written only by a server), so every snapshot stays. A record a running
        build has committed but not yet listed (its pending file, which it holds) stays; a
        dead build's pending file goes. Blocks and
        checkpoints go when no record reaches them (agents' and persisted conversations').
        Folders are never removed; a symbolic link is removed, never what it points to, and a
        store folder that is a link is refused (``store_folder``): nothing is removed then.
        """
        with self.lock():
            check_store_folders(self.root)  # a link refused before anything goes
            live = self.referenced()
            held, dead = held_references(self.root)  # StoreError (deleting nothing) if unreadable
            live |= held
            candidates = self.temp_files() + dead
            kept = self.snapshot_files()
            if (self.root / MANIFEST).exists():
                candidates += [p for p in kept if relpath_of_file(p.name) not in live]
                kept = [p for p in kept if relpath_of_file(p.name) in live]
            # A block stays while any kept record reaches it, a conversation's included.
            kept += [p for p in conversation_files(self.root) if file_or_link(p)]
            try:
                reached: set[str] | None = reached_parts([self.inspect(p) for p in kept])
            except SnapshotError:
                reached = None  # an unreadable record might reach any of them: keep them all
            if reached is not None:
                candidates += [
                    p for p in part_files(self) if part_relpath_of_file(p) not in reached
                ]
            # a folder, a FIFO or a device is never removed (not a writer's): never listed
            doomed = [p for p in candidates if file_or_link(p)]
            freed = sum(p.lstat().st_size for p in doomed)
            if apply:
                for p in doomed:
                    remove_store_file(p, self.root)
                for folder in sorted({p.parent for p in doomed}):
                    self._fsync_dir(folder)
            return doomed, freed

    def _fsync_dir(self, folder: Path) -> None:
        fsync_dir(folder, self.fsync)


def _size(path: Path) -> int:
    """A file's size, 0 when it is missing (reading it later names the problem)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0
