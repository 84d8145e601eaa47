"""The snapshot file on disk: safetensors with a checksum over every byte. No mlx here.

The checksum covers the 8-byte length, the whole JSON header (with the checksum value
itself replaced by its placeholder) and the data, so one flipped byte anywhere -- a
layer's offset in the metadata as much as a KV value -- is caught. Writing streams the
tensors once, hashing them as they go; the header is written first with a fixed-width
placeholder that is patched in place before the file is synced. Reading the header and
checking the file needs no mlx, so ``verify`` handles bf16 and runs without importing it.
"""

from __future__ import annotations

import io
import json
import math
import os
import stat
import struct
import threading
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterable

import xxhash

# FORMAT_VERSION is re-exported
from kvsnap.snapshot.format import CHECKSUM_KEY, DTYPE_SIZES, FORMAT_VERSION  # noqa: F401

# Bounds checked before anything is built from a header (a real one: a few hundred tensors, tens of
# KiB).
MAX_HEADER_BYTES = 16 << 20
MAX_TENSORS = 65536
MAX_TENSOR_NAME = 1024
MAX_NDIM = 8
MAX_META_KEYS = 1024
MAX_DIM = 2**53
# What checking a header costs in Python memory, at most (measured on CPython 3.11): ~700 bytes per
# JSON object, ~40-60 per list element or member, and its text held up to 3 times (bytes, decoded
# metadata, the layer list parsed again) -- 4 bytes per character once one is outside the BMP.
# A header may cost the file's size plus PARSE_SLACK: a real one costs a few % of its data, so
# only a header of many tiny values, or of long strings over little data, is refused.
PARSE_COST_OBJECT = 1024
PARSE_COST_VALUE = 96
PARSE_COST_BYTE_ASCII = 4
PARSE_COST_BYTE_OTHER = 13
PARSE_SLACK = 1 << 20
CHECKSUM_PLACEHOLDER = "0" * 32
CHECKSUM_MARKER = f'"{CHECKSUM_KEY}":"'.encode()
READ_CHUNK = 8 << 20


class FormatError(ValueError):
    """The bytes are not a well-formed kvsnap snapshot file; the message says what is wrong."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # offset within the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Header:
    header_len: int
    metadata: dict[str, str]
    tensors: dict[str, TensorEntry]
    file_size: int
    raw: bytes = b""  # the header bytes as stored, for the checksum

    @property
    def data_start(self) -> int:
        return 8 + self.header_len

    @property
    def data_len(self) -> int:
        return self.file_size - self.data_start


def _is_count(x: object) -> bool:
    return type(x) is int and 0 <= x <= MAX_DIM  # not bool: JSON true is no size


def _unique_keys(pairs: list) -> dict:
    """A repeated key would let two readers see two different headers: refuse it."""
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise FormatError(f"header repeats the key {k[:80]!r}")
        out[k] = v
    return out


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _entry(name: str, raw: object) -> TensorEntry:
    if len(name) > MAX_TENSOR_NAME:
        raise FormatError(
            f"tensor name {name[:40]!r}... is {len(name)} characters, over the {MAX_TENSOR_NAME} "
            f"limit"
        )
    if not isinstance(raw, dict):
        raise FormatError(f"tensor {name!r}: header entry is {_show(raw)}, not an object")
    dtype = raw.get("dtype")
    shape = raw.get("shape")
    offsets = raw.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise FormatError(f"tensor {name!r}: unknown dtype {_show(dtype)}")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(_is_count(d) for d in shape):
        raise FormatError(
            f"tensor {name!r}: bad shape {_show(shape)} (at most {MAX_NDIM} non-negative integer "
            f"dimensions)"
        )
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise FormatError(f"tensor {name!r}: bad data_offsets {_show(offsets)}")
    start, end = offsets
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if end - start != expected:
        raise FormatError(
            f"tensor {name!r}: data_offsets span {end - start} bytes but dtype and shape need "
            f"{expected}"
        )
    return TensorEntry(name, dtype, tuple(shape), start, end)


def parse_cost(raw: bytes) -> int:
    """An upper bound on the memory that parsing and checking this header text takes (C-speed
    counts)."""
    per_byte = PARSE_COST_BYTE_ASCII if raw.isascii() else PARSE_COST_BYTE_OTHER
    return (
        per_byte * len(raw)
        + PARSE_COST_OBJECT * raw.count(b"{")
        + PARSE_COST_VALUE * (raw.count(b",") + raw.count(b"["))
    )


def header_of_bytes(data: bytes | memoryview) -> Header:
    """``parse_header`` of a file held in memory; only the header's bytes are copied (a
    ``BytesIO`` of the whole would copy every tensor too)."""
    view = memoryview(data)
    declared = struct.unpack("<Q", view[:8])[0] if len(view) >= 8 else 0
    head = bytes(view[: 8 + min(declared, MAX_HEADER_BYTES)])
    return parse_header(io.BytesIO(head), len(view))


def parse_header(f: BinaryIO, file_size: int) -> Header:
    """Read and check the safetensors header: sizes, counts, offsets inside the file, no gaps or
    overlaps.

    Every bound is checked before the structure it limits is used: the declared size
    before the header is read, counts before entries are built.
    """
    if file_size < 8:
        raise FormatError(f"file is {file_size} bytes, too short for a safetensors header")
    f.seek(0)
    prefix = f.read(8)
    if len(prefix) != 8:
        raise FormatError(f"file ended after {len(prefix)} bytes (truncated while reading)")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > MAX_HEADER_BYTES:
        raise FormatError(
            f"declared header size {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit (not a "
            f"safetensors file, or a corrupt one)"
        )
    if 8 + header_len > file_size:
        raise FormatError(
            f"declared header size {header_len} runs past the end of the {file_size}-byte file "
            f"(truncated, or not a safetensors file)"
        )
    raw = f.read(header_len)
    if len(raw) != header_len:
        raise FormatError(
            f"file ended inside its {header_len}-byte header (truncated while reading)"
        )
    cost = parse_cost(raw)
    if cost > file_size + PARSE_SLACK:
        raise FormatError(
            f"a {header_len}-byte header holding "
            f"{raw.count(b'{')} JSON objects is more than a {file_size}-byte file can justify "
            f"(checking it would take about {cost} bytes of memory, over the file's size plus "
            f"{PARSE_SLACK}); refusing to parse it"
        )
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except FormatError:
        raise
    except RecursionError:
        raise FormatError("header JSON is nested too deeply") from None
    except ValueError as exc:  # also UnicodeDecodeError, and integers too long to convert
        raise FormatError(f"header is not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(doc, dict):
        raise FormatError(f"header is {type(doc).__name__}, not a JSON object")
    metadata = doc.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FormatError("__metadata__ must map strings to strings")
    if len(metadata) > MAX_META_KEYS:
        raise FormatError(f"__metadata__ has {len(metadata)} keys, over the {MAX_META_KEYS} limit")
    if len(doc) > MAX_TENSORS:
        raise FormatError(f"header lists {len(doc)} tensors, over the {MAX_TENSORS} limit")
    data_len = file_size - 8 - header_len
    tensors = {name: _entry(name, value) for name, value in doc.items()}
    cursor = 0
    for entry in sorted(tensors.values(), key=lambda e: e.start):
        if entry.start != cursor:
            raise FormatError(
                f"tensor {entry.name!r} starts at {entry.start}, expected {cursor} (gap or overlap)"
            )
        cursor = entry.end
    if cursor != data_len:
        raise FormatError(
            f"tensors cover {cursor} data bytes but the file holds {data_len} (truncated or padded)"
        )
    return Header(header_len, metadata, tensors, file_size, raw)


def read_header(path: str | os.PathLike) -> Header:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO must not hang a scan
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise FormatError("is not a regular file")
        return parse_header(f, st.st_size)


def _hashed_header(header: Header) -> bytes:
    """The header bytes as the writer hashed them: the checksum value back to its placeholder."""
    recorded = header.metadata.get(CHECKSUM_KEY)
    if not recorded or recorded == CHECKSUM_PLACEHOLDER:
        raise FormatError(
            "the header has no checksum (written by something other than kvsnap, or never finished)"
        )
    if (
        header.raw.count(CHECKSUM_MARKER) != 1
        or CHECKSUM_MARKER + recorded.encode() not in header.raw
    ):
        raise FormatError(
            "the checksum field is not where kvsnap writes it (the header was rewritten by another "
            "tool)"
        )
    return header.raw.replace(
        CHECKSUM_MARKER + recorded.encode(), CHECKSUM_MARKER + CHECKSUM_PLACEHOLDER.encode()
    )


def _header_hash(header: Header) -> "xxhash.xxh3_128":
    """The checksum's hash state after the length prefix and the header (placeholder in place)."""
    h = xxhash.xxh3_128()
    h.update(struct.pack("<Q", header.header_len))
    h.update(_hashed_header(header))
    return h


def _compare(header: Header, actual: str) -> None:
    recorded = header.metadata.get(CHECKSUM_KEY)
    if actual != recorded:
        raise FormatError(
            f"checksum mismatch (header says {recorded}, the file hashes to {actual}): the file is "
            f"corrupt"
        )


def file_checksum(path: str | os.PathLike, header: Header) -> str:
    """xxh3-128 of the length prefix, the header (placeholder in place) and the data."""
    h = _header_hash(header)
    with open(path, "rb") as f:
        f.seek(header.data_start)
        # never a buffer bigger than the file
        while chunk := f.read(min(READ_CHUNK, max(header.data_len, 1))):
            h.update(chunk)
    return h.hexdigest()


def verify_checksum(header: Header, data: memoryview | bytes) -> None:
    """Check the checksum over a header and data bytes already in memory (one read, no second
    pass)."""
    h = _header_hash(header)
    h.update(data)
    _compare(header, h.hexdigest())


def start_checksum(header: Header) -> "xxhash.xxh3_128 | FormatError":
    """The checksum's hash state before the data, for a reader that hashes the data as it
    reads it; or the FormatError a header without a usable checksum gets, for the reader to
    raise where ``verify_checksum`` would have (after its other checks)."""
    try:
        return _header_hash(header)
    except FormatError as exc:
        return exc


def finish_checksum(header: Header, state: "xxhash.xxh3_128 | FormatError") -> None:
    """Raise FormatError unless ``state`` (``start_checksum``'s, fed every data byte) hashes
    to the recorded checksum."""
    if isinstance(state, FormatError):
        raise state
    _compare(header, state.hexdigest())


def check_data(path: str | os.PathLike, header: Header) -> None:
    """Raise FormatError unless the file's bytes (header and data) hash to the recorded checksum."""
    _compare(header, file_checksum(path, header))


def tensor_bytes(path: str | os.PathLike, header: Header, name: str) -> bytes:
    entry = header.tensors[name]
    with open(path, "rb") as f:
        f.seek(header.data_start + entry.start)
        return f.read(entry.nbytes)


@dataclass(frozen=True)
class OutTensor:
    """A tensor to write: its safetensors dtype, shape and a C-contiguous buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: memoryview

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


def write_snapshot(
    f: BinaryIO,
    tensors: Iterable[OutTensor],
    metadata: dict[str, str],
    on_progress: Callable[[str], None] | None = None,
) -> str:
    """Write a complete snapshot to an open file; return its checksum.

    ``on_progress("mid-write")`` fires after the first tensor, for fault injection.
    """
    tensors = sorted(tensors, key=lambda t: t.name)
    header: dict = {"__metadata__": {**metadata, CHECKSUM_KEY: CHECKSUM_PLACEHOLDER}}
    offset = 0
    for t in tensors:
        if t.dtype not in DTYPE_SIZES or t.nbytes != math.prod(t.shape) * DTYPE_SIZES[t.dtype]:
            raise ValueError(
                f"tensor {t.name!r}: {t.nbytes} bytes do not match {t.dtype}{list(t.shape)}"
            )
        header[t.name] = {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    encoded = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # 8-byte alignment, like the safetensors library
    placeholder_at = encoded.index(CHECKSUM_MARKER + CHECKSUM_PLACEHOLDER.encode()) + len(
        CHECKSUM_MARKER
    )
    prefix = struct.pack("<Q", len(encoded))
    f.write(prefix)
    f.write(encoded)
    h = xxhash.xxh3_128()
    h.update(prefix)
    h.update(encoded)
    for i, t in enumerate(tensors):
        f.write(t.data)
        h.update(t.data)
        if i == 0 and on_progress:
            on_progress("mid-write")
    checksum = h.hexdigest()
    f.seek(8 + placeholder_at)
    f.write(checksum.encode())
    f.seek(0, os.SEEK_END)
    return checksum


PARALLEL_READ_MIN = 64 * 2**20  # below this one thread reads as fast as two
# A reader that hashes as it reads takes this much at a time: the bytes are hashed while they
# are still in the cache (one pass over memory, not two), and the GIL, which the hash holds,
# is let go at every read.
HASH_CHUNK = 1 << 20


def read_into(
    fd: int, view: memoryview, offset: int, hasher: "xxhash.xxh3_128 | None" = None
) -> None:
    """Fill ``view`` from ``fd`` at ``offset``: two threads for large files. The pages are
    fresh memory, and first-touching them is what bounds a restore: two threads read a
    450 MiB snapshot in 0.15 s against 0.28 s (scripts/bench_restore_threads.py, 2 cores).
    With ``hasher``, the bytes as they lie in ``view`` are fed to it in order: chunk by chunk
    as one thread reads HASH_CHUNK at a time, or all at once after a two-thread read."""
    total = len(view)
    parts = 2 if total >= PARALLEL_READ_MIN and (os.cpu_count() or 1) > 1 else 1
    chunked = hasher if parts == 1 else None
    bounds = [total * i // parts for i in range(parts + 1)]
    errors: list[BaseException] = []

    def part(lo: int, hi: int) -> None:
        try:
            done = lo
            while done < hi:
                stop = min(hi, done + HASH_CHUNK) if chunked is not None else hi
                n = os.preadv(fd, [view[done:stop]], offset + done)
                if not n:
                    raise FormatError(
                        f"file ended after {done} of {total} data bytes (truncated while reading)"
                    )
                if chunked is not None:
                    chunked.update(view[done : done + n])
                done += n
        except BaseException as exc:  # handed to the caller's thread, raised there
            errors.append(exc)

    if parts == 1:
        part(0, total)
    else:
        workers = [
            threading.Thread(target=part, args=(bounds[i], bounds[i + 1]), name="kvsnap-read")
            for i in range(parts)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    if errors:
        raise errors[0]
    if hasher is not None and chunked is None:
        hasher.update(view)
