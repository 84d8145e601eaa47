"""Checked file I/O for a store: the one place that creates folders, lists and removes a
store's files, writes files atomically, hashes files in chunks and reads a file whole into
mlx memory that nothing wrote before.

The store's jobs (``store/writing.py``, ``reading.py``, ``checking.py``, ``collecting.py``)
and ``store/local.py`` (manifest, lock) all use it, so none needs another for a write or a
read. Only the readers import mlx (``unfilled_buffer``, ``tensor_views``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import stat
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Protocol, TypeVar

from kvsnap.errors import SnapshotError, StoreError
from kvsnap.snapshot.file import FormatError, Header, parse_header, read_into, start_checksum
from kvsnap.snapshot.format import CONVERSATIONS, DTYPES, PART_FOLDERS, SNAPSHOTS
from kvsnap.store.part_readers import on_mlx_thread

TMP_PREFIX = ".tmp-"
FILE_MODE = 0o600
DIR_MODE = 0o700
CHUNK = 1 << 20
# O_DIRECT wants the file offset, the length and the memory aligned to the device's logical
# block (512 B or 4 KiB); 4 KiB suits both. Parts under DIRECT_MIN are read through the cache.
DIRECT_ALIGN = 4096
DIRECT_MIN = 1 << 20
DIRECT_CHUNK = 8 << 20

FaultFn = Callable[[str], None]
Fsync = Callable[[int], None]


def default_fsync(fd: int) -> None:
    """``os.fsync``, looked up at each call (so a test's spy on it sees every one)."""
    os.fsync(fd)


class Hasher(Protocol):
    def update(self, data: bytes, /) -> Any: ...


class StoreFiles(Protocol):
    """What a store's file readers and writers need of it (``store.local.Store`` has it)."""

    @property
    def root(self) -> Path: ...

    @property
    def fault(self) -> FaultFn: ...

    @property
    def fsync(self) -> Fsync: ...


def fsync_dir(folder: Path, fsync: Fsync = default_fsync) -> None:
    """Make a folder's entries (a rename, a new or removed file or folder) durable."""
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fsync(fd)
    finally:
        os.close(fd)


def make_dirs(folder: Path, fsync: Fsync = default_fsync) -> None:
    """Create ``folder`` and any missing parents (0700), each fsynced in its parent: a new
    folder's entry is not durable until its parent is, and a crash must not lose it while
    the files renamed into it are on disk."""
    missing = []
    here = Path(folder)
    while not here.is_dir():
        missing.append(here)
        if here.parent == here:
            break
        here = here.parent
    for new in reversed(missing):
        try:
            new.mkdir(mode=DIR_MODE)
            os.chmod(new, DIR_MODE)  # mkdir's mode is masked by the umask
        except FileExistsError:
            if not new.is_dir():
                raise  # a file in the way: the caller names it
        # even when another writer made it: it may not have got this far
        fsync_dir(new.parent, fsync)


def atomic_write(
    target: Path, write: Callable[[Any], object], fault: FaultFn, fsync: Fsync = default_fsync
) -> None:
    """Temp file in the target's folder, fsync, rename over the target, fsync the folder.
    A crash at any point leaves the old file or the new one, never a mix."""
    make_dirs(target.parent, fsync)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + target.name + ".", dir=target.parent)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            fault("after-write")
            fsync(f.fileno())
        fault("after-fsync")
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(target.parent, fsync)


def store_folder(root: Path, name: str) -> Path | None:
    """``root/name`` when it is a real folder of the store, None when it is missing. A symbolic
    link there (wherever it points, inside the store too) or a file is a StoreError: listing
    or removing through it would reach files the store does not own."""
    folder = root / name
    try:
        st = folder.lstat()
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        raise StoreError(
            f"{folder} is a symbolic link (to {os.readlink(folder)}); kvsnap never lists or "
            f"removes store files through a link; replace it with a real folder holding its "
            f"files (or link the whole store instead)"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise StoreError(f"{folder} is not a folder; move it out of the store")
    return folder


def check_store_folders(root: Path) -> None:
    """StoreError unless each of the store's folders is a real folder or missing: a remover
    checks them all before it removes anything, so a refusal leaves nothing half done."""
    for name in (SNAPSHOTS, *PART_FOLDERS, CONVERSATIONS):
        store_folder(root, name)


def probe_writable(folder: Path, fault: Callable[[str], None] | None = None) -> str | None:
    """None if a file can really be created in ``folder``, else why not.

    A real create-and-delete, not ``os.access``: root passes every access check, and a
    read-only mount or a full disk only shows up when writing.
    """
    try:
        if fault is not None:
            fault("write-probe")
        fd, tmp = tempfile.mkstemp(prefix=".tmp-probe-", dir=folder)
        os.close(fd)
        os.unlink(tmp)
        return None
    except OSError as exc:
        return exc.strerror or str(exc)


def store_files(root: Path, name: str, suffix: str) -> list[Path]:
    """The entries of the store's folder ``root/name`` whose names end in ``suffix``, temp files
    excluded, sorted ([] when the folder is missing; see ``store_folder`` for a link)."""
    folder = store_folder(root, name)
    if folder is None:
        return []
    names = os.listdir(folder)
    return sorted(folder / n for n in names if n.endswith(suffix) and not n.startswith(TMP_PREFIX))


def remove_store_file(path: Path, root: Path) -> int | None:
    """Remove ``path``, an entry of the store's ``root`` or of one of its real folders (never
    through a link: see ``store_folder``); returns the bytes it held, or None when nothing was
    removed: gone already, or not a file (a folder, a device). A symbolic link is removed as a
    link: what it points to is never touched."""
    try:
        where = path.parent.relative_to(root).parts
    except ValueError:
        where = ("..", "..")  # outside the store
    if len(where) > 1:
        raise StoreError(f"{path} is not a file of the store {root}; nothing was removed")
    if where and store_folder(root, where[0]) is None:
        return None  # its folder is gone: so is it
    try:
        st = path.lstat()
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            return None
        path.unlink()
    except FileNotFoundError:
        return None  # another writer removed it already
    return st.st_size


def file_or_link(path: Path) -> bool:
    """Whether ``path`` may be a record: a regular file, or a link (removed as a link). A
    folder, a FIFO or a device named like one is none that a writer made and reaches no part:
    it is never removed (not ours), and must not keep every block as an unread record would
    (``kvsnap verify`` names it)."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return False
    return stat.S_ISREG(mode) or stat.S_ISLNK(mode)


H = TypeVar("H", bound=Hasher)


def hash_file(path: Path, hasher: H) -> H:
    """Feed a file to ``hasher`` in CHUNK-sized reads (never the whole file in memory)."""
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            hasher.update(chunk)
    return hasher


def check_regular(path: Path, root: Path) -> None:
    """SnapshotError unless ``path`` is a regular file (a link, even one inside ``root``, is
    not)."""
    if path.is_symlink():
        try:
            path.resolve().relative_to(root)
            where = "inside"
        except ValueError:
            where = "outside"
        reason = f"is a symbolic link (pointing {where} the store); snapshots must be regular files"
        raise SnapshotError(str(path), reason, "replace it with the real file or delete it")
    try:
        st = path.lstat()
    except FileNotFoundError:
        raise SnapshotError(str(path), "does not exist") from None
    if not stat.S_ISREG(st.st_mode):
        raise SnapshotError(str(path), "is not a regular file", "delete it")


class _UnfilledNpy:
    """A file object that mlx's ``.npy`` loader reads: a header for ``n`` bytes, then data it
    never writes. mlx allocates the array and hands its memory to ``readinto``, which leaves it
    as it is: the one way to an mlx buffer nothing has written (``mx.zeros`` and ``mx.empty``
    write zeros over every page, a pass the read then repeats)."""

    name = "unfilled.npy"
    closed = False

    def __init__(self, n: int):
        text = "{'descr': '|u1', 'fortran_order': False, 'shape': (%d,), }" % n
        text += " " * (-(len(text) + 11) % 64) + "\n"  # numpy pads the header to 64 bytes
        self.head = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text.encode()
        self.pos = 0

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset
        return self.pos

    def readinto(self, into: Any) -> int:
        n = len(into) if isinstance(into, memoryview) else memoryview(into).nbytes
        if self.pos < len(self.head):
            n = min(n, len(self.head) - self.pos)
            into[:n] = self.head[self.pos : self.pos + n]
        self.pos += n
        return n


def unfilled_buffer(n: int) -> tuple[Any, memoryview]:
    """An evaluated mlx uint8 array of ``max(n, 1)`` bytes whose memory nothing has written
    (fresh pages stay untouched until the read copies into them), and a writable view of its
    first ``n`` bytes. Runs on the calling thread's mlx stream.

    Only on the engine's own thread (or before it runs the model): the load's Python reader
    needs the GIL on the stream's worker, and mlx-lm's ``mx.clear_cache`` waits for every
    stream while holding the GIL, so made beside the engine's steps this hangs the process.
    Other threads use ``zeroed_buffer``."""
    import mlx.core as mx

    buf = mx.load(_UnfilledNpy(max(1, n)), format="npy")  # type: ignore[arg-type]
    # mlx arrays are buffers; its stubs do not say so
    return buf, memoryview(buf)[:n]  # type: ignore[arg-type]


def tensor_views(buf: Any, header: Header, at: int = 0) -> dict:
    """Every tensor of ``header`` as a view of ``buf`` (its data bytes, from byte ``at``),
    evaluated here: a view left lazy would be evaluated on whichever thread touches it first.
    Tensors of one dtype (every block of a model without quantized KV) are cut by one split of
    the whole buffer: a quarter of the mlx calls of a slice, a view and a reshape each."""
    import mlx.core as mx

    entries = sorted(header.tensors.values(), key=lambda e: e.start)
    dtypes = {e.dtype for e in entries}
    if len(dtypes) == 1:
        name, size = DTYPES[dtypes.pop()]
        flat = buf[at : at + header.data_len].view(getattr(mx, name))
        pieces = mx.split(flat, [e.start // size for e in entries[1:]]) if entries[1:] else [flat]
        arrays = {e.name: piece.reshape(e.shape) for e, piece in zip(entries, pieces)}
    else:
        arrays = {
            e.name: buf[at + e.start : at + e.end]
            .view(getattr(mx, DTYPES[e.dtype][0]))
            .reshape(e.shape)
            for e in entries
        }
    mx.eval(list(arrays.values()))
    return {name: arrays[name] for name in header.tensors}


def read_ahead(fd: int, header: Header) -> None:
    """Ask the kernel for the whole data section now (Linux; a no-op where the data is cached):
    a file not in the page cache is then fetched in one request, while the buffer is made and
    the other parts are opened, not in the read's own chunks."""
    if hasattr(os, "posix_fadvise") and header.data_len:
        os.posix_fadvise(fd, header.data_start, header.data_len, os.POSIX_FADV_WILLNEED)


def unfilled_tensors(header: Header, beside_the_engine: bool = False) -> tuple[memoryview, dict]:
    """A buffer nothing wrote for ``header``'s data (a writable view of it) and its tensors as
    evaluated views of it, made before a byte is read: views copy nothing, so they show the
    bytes the read then puts there. One trip to the owning thread for a pool thread's read.
    ``beside_the_engine``: made on a thread that runs while the engine steps (a zeroed buffer,
    see ``unfilled_buffer``)."""
    buf, view = (zeroed_buffer if beside_the_engine else unfilled_buffer)(header.data_len)
    return view, tensor_views(buf, header)


def zeroed_buffer(n: int) -> tuple[Any, memoryview]:
    """``unfilled_buffer``'s result made by mlx alone (zeros: its pages are written once more),
    safe on a thread that runs beside the engine's steps."""
    import mlx.core as mx

    buf = mx.zeros((max(1, n),), dtype=mx.uint8)
    mx.eval(buf)
    return buf, memoryview(buf)[:n]  # type: ignore[arg-type]


def read_whole(path: Path) -> tuple[Header, Any, memoryview]:
    """One open: the header parsed, the data read into a fresh mlx buffer that nothing wrote
    before (nothing memory-mapped). Returns (header, buffer, a view of its data bytes); the
    caller checksums exactly that view. FormatError / OSError propagate for the caller to
    name."""
    with open(path, "rb") as f:
        header = parse_header(f, os.fstat(f.fileno()).st_size)
        read_ahead(f.fileno(), header)
        buf, view = on_mlx_thread(unfilled_buffer, header.data_len)
        read_into(f.fileno(), view, header.data_start)
    return header, buf, view


def read_tensors(path: Path) -> tuple[Header, dict, Any]:
    """One open: the header parsed, its tensors (views of one mlx buffer nothing wrote before)
    filled by one read, and the checksum's state fed every data byte as it was read (each
    chunk hashed while still in the cache) for ``finish_checksum`` -- or the FormatError of a
    header without a usable checksum, which ``finish_checksum`` raises. Safe on a pool thread
    of ``store/part_readers.py``: the buffer and views are made on the thread that owns the
    read, only the read and the hash happen here. A file not in the page cache (a restart's
    first read) is read with O_DIRECT (``read_direct``). FormatError / OSError propagate."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        cold = not data_cached(f.fileno(), size)
        if cold:  # the header's read must not pull the data into the cache (readahead)
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        header = parse_header(f, size)
        state = start_checksum(header)
        hasher = None if isinstance(state, FormatError) else state
        if cold:
            arrays = read_direct(path, header, hasher)
            if arrays is not None:
                return header, arrays, state
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_NORMAL)
        read_ahead(f.fileno(), header)
        view, arrays = on_mlx_thread(unfilled_tensors, header)
        read_into(f.fileno(), view, header.data_start, hasher)
    return header, arrays, state


def data_cached(fd: int, size: int) -> bool:
    """Whether a file's last page is in the page cache (``mincore`` over a one-page mapping,
    which reads nothing: a probing read would start the kernel's readahead); True for files
    under DIRECT_MIN and where O_DIRECT or the probe is not there (Linux only)."""
    if size < DIRECT_MIN or not hasattr(os, "O_DIRECT") or not sys.platform.startswith("linux"):
        return True
    page = mmap.PAGESIZE
    offset = (size - 1) // page * page
    libc = ctypes.CDLL(None, use_errno=True)
    m = mmap.mmap(
        fd,
        size - offset,
        flags=mmap.MAP_PRIVATE,
        prot=mmap.PROT_READ | mmap.PROT_WRITE,
        offset=offset,
    )
    try:
        vec = (ctypes.c_ubyte * 1)()
        first = ctypes.c_char.from_buffer(m)
        try:
            rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(first)), ctypes.c_size_t(1), vec)
        finally:
            del first
        return rc != 0 or bool(vec[0] & 1)  # a failed probe: the buffered read
    finally:
        m.close()


def address_of(view: memoryview) -> int:
    """The address of a writable buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def read_direct(path: Path, header: Header, hasher: Any) -> dict | None:
    """``header``'s tensors read with O_DIRECT into mlx memory nothing wrote before, hashed as
    they arrive; None where the filesystem refuses O_DIRECT (the caller reads through the cache).

    A cold file read through the page cache costs the CPU twice over: the kernel fills its cache
    pages and then copies them into ours. O_DIRECT has the device write into our pages; a cold
    restore's CPU falls below a plain read's (docs/benchmarks.md). The read starts at the page
    holding the first data byte: the buffer is one aligned span from there, the tensors views
    at the data's offset in it."""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:  # tmpfs and a few others refuse O_DIRECT: the buffered read
        return None
    try:
        first = header.data_start - header.data_start % DIRECT_ALIGN
        skip = header.data_start - first
        end = skip + header.data_len  # the data's end in the span read
        span = -(-end // DIRECT_ALIGN) * DIRECT_ALIGN
        buf, whole = on_mlx_thread(unfilled_buffer, span + DIRECT_ALIGN)
        pad = -address_of(whole) % DIRECT_ALIGN
        arrays = on_mlx_thread(tensor_views, buf, header, pad + skip)
        target = whole[pad : pad + span]
        done = hashed = 0
        while done < end:
            try:
                n = os.preadv(fd, [target[done : min(span, done + DIRECT_CHUNK)]], first + done)
            except OSError as exc:
                if exc.errno == errno.EINVAL and done == 0:  # alignment the device refuses
                    return None
                raise
            done += n
            if done < end and (not n or n % DIRECT_ALIGN):
                raise FormatError(
                    f"file ended after {max(0, done - skip)} of {header.data_len} data bytes "
                    "(truncated while reading)"
                )
            if hasher is not None and min(done, end) > max(hashed, skip):
                hasher.update(target[max(hashed, skip) : min(done, end)])
                hashed = min(done, end)
        return arrays
    finally:
        os.close(fd)
