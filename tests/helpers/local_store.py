"""Builds into a local store and the faults the store tests inject into its files (FAULTS)."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

from kvsnap.build.pipeline import build_snapshots
from kvsnap.snapshot.format import (
    CHECKSUM_KEY,
    FORMAT_VERSION,
)
from kvsnap.store.local import Store


def agents(names, extra: str = "") -> list[dict]:
    return [
        {
            "name": n,
            "messages": [
                {
                    "role": "system",
                    "content": f"You are the {n} agent. Answer briefly and check the tests "
                    f"first.{extra}",
                }
            ],
        }
        for n in names
    ]


def write_agents(path: Path, entries: list) -> Path:
    path.write_text(json.dumps(entries))
    return path


def build(lm, agents_file: Path, root: Path, fault=None, **kw):
    from kvsnap.prompts import load_warm_prompts

    store = Store.open(root, create=True, fault=fault)
    return build_snapshots(lm, load_warm_prompts(agents_file), store, str(agents_file), **kw)


def tree(root: Path) -> dict[str, object]:
    """Every path under root with its bytes (or link target): 'nothing changed' is equality."""
    out: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_file():
                out[rel] = p.read_bytes()
            else:
                out[rel] = "dir"
    return out


def stamps(store: Store) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in store.snapshot_files()}


def header_bounds(data: bytes) -> tuple[int, int]:
    (n,) = struct.unpack("<Q", data[:8])
    return 8, 8 + n


def craft(header_json: str, data: bytes) -> bytes:
    enc = header_json.encode()
    enc += b" " * (-len(enc) % 8)
    return struct.pack("<Q", len(enc)) + enc + data


def flip_at(path: Path, offset: int) -> None:
    b = bytearray(path.read_bytes())
    b[offset] ^= 0x01
    path.write_bytes(bytes(b))


def flip_kv_byte(path: Path) -> None:
    """A byte inside layer 0's keys (the tokens tensor comes last and has its own check)."""
    flip_at(path, header_bounds(path.read_bytes())[1] + 100)


def flip_in_metadata(field: str):
    """Flip a byte inside a hex value in the header: the JSON stays valid."""

    def apply(path: Path, **_):
        data = path.read_bytes()
        start, end = header_bounds(data)
        at = data.index(f'"{field}":"'.encode(), start, end) + len(field) + 4 + 5
        assert chr(data[at]) in "0123456789abcdef"
        flip_at(path, at)

    return apply


def flip_layer_offset(path: Path, **_):
    """A layer's token offset in the header's layer list: 28 -> 29 (still valid JSON)."""
    data = path.read_bytes()
    start, end = header_bounds(data)
    at = data.index(b'\\"offset\\": ', start, end) + len(b'\\"offset\\": ')
    assert chr(data[at]).isdigit()
    flip_at(path, at)


def flip_format_version(path: Path, **_):
    data = path.read_bytes()
    start, end = header_bounds(data)
    at = data.index(f'"kvsnap.format":"{FORMAT_VERSION}"'.encode(), start, end) + len(
        '"kvsnap.format":"'
    )  # a record
    b = bytearray(data)
    b[at] = ord("1")  # no kvsnap reads format 1 any more
    path.write_bytes(bytes(b))


def set_length_prefix(value_of):
    def apply(path: Path, **_):
        b = bytearray(path.read_bytes())
        b[:8] = struct.pack("<Q", value_of(len(b)))
        path.write_bytes(bytes(b))

    return apply


def truncate_to(fraction: float):
    def apply(path: Path, **_):
        os.truncate(path, int(path.stat().st_size * fraction))

    return apply


def overwrite_with(content: bytes):
    def apply(path: Path, **_):
        path.write_bytes(content)

    return apply


def symlink_outside(path: Path, outside: Path, **_):
    outside.mkdir(exist_ok=True)
    target = outside / path.name
    shutil.move(str(path), target)
    path.symlink_to(target)


def copy_donor(path: Path, donor: Path, **_):
    shutil.copyfile(donor, path)


def make_directory(path: Path, **_):
    path.unlink()
    path.mkdir()


# name -> (how to damage a good snapshot in place, what the refusal must say)
FAULTS = {
    "data-byte-flipped": (
        lambda path, **_: flip_kv_byte(path),
        r"tokens do not match the recorded tokens digest",
    ),  # a record's data is its tokens
    "header-tokens-digest-flipped": (
        flip_in_metadata("kvsnap.tokens_digest"),
        r"tokens do not match the recorded tokens digest",
    ),
    "header-checksum-flipped": (flip_in_metadata(CHECKSUM_KEY), r"checksum mismatch"),
    "header-layer-offset-flipped": (flip_layer_offset, r"checksum mismatch"),
    "header-json-broken": (lambda path, **_: flip_at(path, 8), r"header is not valid JSON"),
    "old-format-version": (
        flip_format_version,
        rf"format version '1' is not one this kvsnap reads \(2 or {FORMAT_VERSION}\); rebuild",
    ),
    "truncated": (truncate_to(0.6), r"truncated"),
    "zero-length": (truncate_to(0), r"file is 0 bytes"),
    "huge-header-size": (
        set_length_prefix(lambda size: 1 << 40),
        r"declared header size \d+ exceeds the \d+-byte limit",
    ),
    "header-size-past-end": (
        set_length_prefix(lambda size: size),
        r"runs past the end of the \d+-byte file",
    ),
    "offsets-past-end": (
        overwrite_with(
            craft(
                '{"tokens":{"dtype":"I32","shape":[1000000],"data_offsets":[0,4000000]}}',
                b"\0" * 16,
            )
        ),
        r"tensors cover 4000000 data bytes but the file holds 16",
    ),
    "not-safetensors": (
        overwrite_with(b"this is a text file, not a snapshot\n" * 20),
        r"not a safetensors file",
    ),
    "plain-safetensors": (
        overwrite_with(craft('{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', b"\0" * 8)),
        r"not a kvsnap snapshot: metadata lacks",
    ),
    "duplicate-header-key": (
        overwrite_with(
            craft(
                '{"x":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"x":{"dtype":"I8","shape":'
                '[4],"data_offsets":[0,4]}}',
                b"\0" * 4,
            )
        ),
        r"header repeats the key 'x'",
    ),
    "symlink-outside-store": (symlink_outside, r"symbolic link \(pointing outside the store\)"),
    "copied-over-another-key": (copy_donor, r"file name does not match its key"),
    "directory": (make_directory, r"not a regular file"),
}
