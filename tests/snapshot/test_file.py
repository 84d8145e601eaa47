"""Reading a snapshot file's data and hashing it as it is read: the same checksum as hashing it
afterwards, whichever way the read is split, and a header without a usable checksum failing
where the checksum is compared, not before."""

from __future__ import annotations

import os

import numpy as np
import pytest

import kvsnap.snapshot.file as snapshot_file
from kvsnap.snapshot.file import (
    FormatError,
    OutTensor,
    finish_checksum,
    read_header,
    read_into,
    start_checksum,
    verify_checksum,
    write_snapshot,
)


def _file(path, nbytes: int) -> bytes:
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        write_snapshot(f, [OutTensor("t", "U8", (nbytes,), memoryview(data))], {"k": "v"})
    return data


@pytest.mark.parametrize("nbytes", [1, 4096, (3 << 20) + 5])
@pytest.mark.parametrize("two_threads", [False, True])
def test_hashing_while_reading_gives_the_files_checksum(tmp_path, monkeypatch, nbytes, two_threads):
    if two_threads:  # the two-thread split, then one hash over the whole buffer
        monkeypatch.setattr(snapshot_file, "PARALLEL_READ_MIN", 1)
        monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(snapshot_file, "HASH_CHUNK", 1 << 20)
    path = tmp_path / "f.safetensors"
    data = _file(path, nbytes)
    header = read_header(path)
    view = memoryview(bytearray(header.data_len))
    state = start_checksum(header)
    assert not isinstance(state, FormatError)
    with open(path, "rb") as f:
        read_into(f.fileno(), view, header.data_start, state)
    assert bytes(view) == data
    finish_checksum(header, state)  # no error: the recorded checksum
    verify_checksum(header, view)


def test_a_flipped_byte_fails_the_checksum_hashed_while_reading(tmp_path):
    path = tmp_path / "f.safetensors"
    _file(path, 3 << 20)
    raw = bytearray(path.read_bytes())
    raw[-(2 << 20)] ^= 1
    path.write_bytes(bytes(raw))
    header = read_header(path)
    view = memoryview(bytearray(header.data_len))
    state = start_checksum(header)
    with open(path, "rb") as f:
        read_into(f.fileno(), view, header.data_start, state)
    with pytest.raises(FormatError, match="checksum mismatch"):
        finish_checksum(header, state)


def test_a_header_without_a_checksum_fails_when_the_checksum_is_compared(tmp_path):
    path = tmp_path / "f.safetensors"
    with open(path, "wb") as f:
        write_snapshot(f, [OutTensor("t", "U8", (4,), memoryview(b"abcd"))], {})
    raw = path.read_bytes().replace(b'"kvsnap.xxh3_128":"', b'"kvsnap.xxh3_12X":"')
    path.write_bytes(raw)
    header = read_header(path)
    state = start_checksum(header)  # no raise here: the caller's other checks come first
    assert isinstance(state, FormatError)
    with pytest.raises(FormatError, match="has no checksum"):
        finish_checksum(header, state)
