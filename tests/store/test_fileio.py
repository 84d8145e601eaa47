"""The one-open whole-file read: into an mlx buffer nothing wrote before (its pages are not
even resident when the read starts: ``mx.zeros`` would have touched every one), the bytes
exactly the file's data, and tensor views of them."""

from __future__ import annotations

import ctypes
import fcntl
import os

import mlx.core as mx
import numpy as np
import pytest

import kvsnap.store.fileio as fileio
from kvsnap.snapshot.file import OutTensor, write_snapshot
from kvsnap.store.fileio import read_whole, tensor_views, unfilled_buffer

LIBC = ctypes.CDLL(None, use_errno=True)
PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_fraction(view: memoryview) -> float:
    """The share of ``view``'s pages in memory (mincore), before anything reads them."""
    start = ctypes.addressof(ctypes.c_char.from_buffer(view))
    first = start - start % PAGE
    pages = (start + len(view) - first + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    if LIBC.mincore(ctypes.c_void_p(first), ctypes.c_size_t(pages * PAGE), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec) / pages


def _file(path, data: bytes, name: str = "t") -> None:
    with open(path, "wb") as f:
        tensors = [OutTensor(name, "U8", (len(data),), memoryview(data))] if data else []
        write_snapshot(f, tensors, {"kvsnap.test": "1"})


def test_the_buffer_a_file_is_read_into_was_never_written(tmp_path, monkeypatch):
    # 64 MiB: above malloc's largest mmap threshold, so the buffer is fresh pages
    data = np.random.default_rng(1).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
    path = tmp_path / "big.safetensors"
    _file(path, data)
    seen = []
    real = fileio.read_into

    def read_into(fd, view, offset, *rest):
        seen.append(resident_fraction(view))
        real(fd, view, offset, *rest)
        seen.append(resident_fraction(view))

    monkeypatch.setattr(fileio, "read_into", read_into)
    header, buf, view = read_whole(path)
    assert seen[0] < 0.05, f"{seen[0]:.0%} of the buffer was touched before the read"
    assert seen[1] > 0.95  # the probe sees pages the read wrote
    assert bytes(view) == data
    assert header.data_len == len(data)


def test_an_unfilled_buffer_is_mlx_memory_of_the_asked_size():
    buf, view = unfilled_buffer(3 << 20)
    assert buf.dtype == mx.uint8 and buf.shape == (3 << 20,)
    view[:4] = b"abcd"
    assert bytes(np.array(buf[:4])) == b"abcd"  # the view is the array's own memory
    empty, nothing = unfilled_buffer(0)
    assert empty.size == 1 and len(nothing) == 0


def test_tensor_views_are_the_files_tensors(tmp_path):
    values = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    path = tmp_path / "t.safetensors"
    with open(path, "wb") as f:
        write_snapshot(
            f,
            [
                OutTensor("a", "F32", (2, 3, 4), memoryview(values.tobytes())),
                OutTensor("b", "I32", (2,), memoryview(np.array([7, 9], np.int32).tobytes())),
            ],
            {"kvsnap.test": "1"},
        )
    header, buf, _ = read_whole(path)
    arrays = tensor_views(buf, header)
    assert np.array_equal(np.array(arrays["a"]), values)
    assert np.array(arrays["b"]).tolist() == [7, 9]


def test_a_file_without_data_reads_as_no_bytes(tmp_path):
    path = tmp_path / "empty.safetensors"
    _file(path, b"")
    header, _, view = read_whole(path)
    assert header.data_len == 0 and len(view) == 0


def _evict(path) -> bool:
    """Drop ``path`` from the page cache; False where that did not take (the probe still sees
    its data) or the filesystem refuses O_DIRECT (tmpfs), so the direct read cannot be seen."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return False
    with open(path, "rb") as f:
        return not fileio.data_cached(f.fileno(), os.fstat(f.fileno()).st_size)


def _big_part(path, seed: int = 2) -> np.ndarray:
    """A 6 MiB part (three fp32 tensors) whose data starts off a page boundary."""
    values = np.random.default_rng(seed).standard_normal((3, 512, 1024)).astype(np.float32)
    with open(path, "wb") as f:
        write_snapshot(
            f,
            [
                OutTensor(f"{i}.keys", "F32", (512, 1024), memoryview(values[i].tobytes()))
                for i in range(3)
            ],
            {"kvsnap.test": "1"},
        )
    return values


def test_a_part_not_in_the_page_cache_is_read_with_o_direct(tmp_path, monkeypatch):
    """Issue 41 item 4: a cold part read through the page cache cost the kernel's fill of its
    cache and then the copy into our memory. Read with O_DIRECT, the tensors and the checksum
    are the same, the buffer was fresh memory, and the file is still not in the page cache."""
    from kvsnap.snapshot.file import finish_checksum

    path = tmp_path / "cold.safetensors"
    values = _big_part(path)
    if not _evict(path):
        pytest.skip("this filesystem keeps the file cached or refuses O_DIRECT")
    direct = []
    real = fileio.read_direct

    def read_direct(*args):
        direct.append(real(*args))
        return direct[-1]

    monkeypatch.setattr(fileio, "read_direct", read_direct)
    header, arrays, state = fileio.read_tensors(path)
    finish_checksum(header, state)  # every data byte hashed, in order, none of the header's
    assert len(direct) == 1 and direct[0] is not None
    for i in range(3):
        assert np.array_equal(np.array(arrays[f"{i}.keys"]), values[i])
    with open(path, "rb") as f:
        assert not fileio.data_cached(f.fileno(), header.file_size), "read through the cache"


def test_a_cached_part_is_read_through_the_cache(tmp_path, monkeypatch):
    path = tmp_path / "warm.safetensors"
    values = _big_part(path, seed=3)  # just written: in the page cache
    monkeypatch.setattr(fileio, "read_direct", _refuse)
    _, arrays, _ = fileio.read_tensors(path)
    assert np.array_equal(np.array(arrays["2.keys"]), values[2])


def _refuse(*args):
    raise AssertionError("a part in the page cache was read with O_DIRECT")


def test_a_cold_part_damaged_or_cut_short_is_named(tmp_path, monkeypatch):
    """The direct read checks what the buffered one does: a flipped data byte fails the
    checksum, a file that ends early (here the second read finds the end) is named as cut."""
    from kvsnap.snapshot.file import FormatError, finish_checksum

    path = tmp_path / "bad.safetensors"
    _big_part(path, seed=4)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    if not _evict(path):
        pytest.skip("this filesystem keeps the file cached or refuses O_DIRECT")
    header, _, state = fileio.read_tensors(path)
    with pytest.raises(FormatError, match="checksum"):
        finish_checksum(header, state)
    _evict(path)
    calls = []
    real = os.preadv

    def preadv(fd, buffers, offset, *flags):
        if not flags and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            calls.append(offset)
            if len(calls) == 2:
                return 0
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(fileio, "DIRECT_CHUNK", 1 << 20)
    monkeypatch.setattr(os, "preadv", preadv)
    with pytest.raises(FormatError, match="truncated while reading"):
        fileio.read_tensors(path)
