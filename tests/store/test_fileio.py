"""The one-open whole-file read: into an mlx buffer nothing wrote before (its pages are not
even resident when the read starts: ``mx.zeros`` would have touched every one), the bytes
exactly the file's data, and tensor views of them."""

from __future__ import annotations

import ctypes
import os

import mlx.core as mx
import numpy as np

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
