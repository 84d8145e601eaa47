"""The store's ``manifest.json``: one validating reader, the merge an install does, the writer's
bytes.

Every manifest kvsnap reads — the store's own, one inside a tarball, one pulled from a
registry — goes through ``parse_manifest``: size-bounded before it is read, JSON-parsed
with a depth bound, then every field the code uses is type-checked and bounded. A bad
one is a ``ManifestError`` naming the file, the field, the value and the fix, never an
AttributeError three calls later.

The store's file names and the manifest's format number are ``snapshot/format.py``'s: the
manifest lists snapshots by exactly ``format.snapshot_relpath(key)``. No mlx here.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import stat
from pathlib import Path
from typing import Callable

from kvsnap.errors import ManifestError
from kvsnap.key import canonical_json, hexdigest
from kvsnap.snapshot.format import (
    KEY_RE,
    MANIFEST_FORMAT,
    SNAPSHOT_REL_HINT,
    SNAPSHOT_REL_MAX,
    SNAPSHOT_REL_RE,
)

MAX_MANIFEST_BYTES = 16 << 20  # ~60,000 entries; a build writes a few hundred bytes per agent
MAX_RECORDS = 65536
MAX_ENTRIES = 65536  # per record
MAX_ID_CHARS = 128
MAX_DIGEST_CHARS = 128
MAX_TEXT_CHARS = 4096  # names and paths
MAX_EXTRA_DEPTH = 8  # fields kvsnap does not use may hold JSON, this deep at most
MAX_COUNT = 2**53  # integers beyond what every JSON reader keeps exact

STORE_FIX = "restore it from a backup, or delete it and rebuild with `kvsnap build`"


def empty_manifest() -> dict:
    return {"format": MANIFEST_FORMAT, "records": {}}


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _kind(value: object) -> str:
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        type(None): "null",
        int: "an integer",
        float: "a number",
    }.get(type(value), type(value).__name__)


class _Checker:
    """Field checks that raise one ManifestError naming the field path and the value."""

    def __init__(self, where: str, fix: str):
        self.where = where
        self.fix = fix

    def fail(self, field: str, value: object, expected: str) -> ManifestError:
        return ManifestError(
            self.where,
            f"is not a kvsnap manifest: {field} is {_kind(value)} {_show(value)}, expected "
            f"{expected}",
            self.fix,
        )

    def obj(self, field: str, value: object) -> dict:
        if not isinstance(value, dict):
            raise self.fail(field, value, "a JSON object")
        return value

    def text(
        self,
        field: str,
        value: object,
        limit: int,
        pattern: re.Pattern | None = None,
        expected: str = "",
    ) -> str:
        if (
            not isinstance(value, str)
            or not value
            or len(value) > limit
            or (pattern is not None and not pattern.fullmatch(value))
        ):
            raise self.fail(
                field, value, expected or f"a non-empty string of at most {limit} characters"
            )
        return value

    def count(self, field: str, value: object, optional: bool = True) -> None:
        if value is None and optional:
            return
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_COUNT:
            raise self.fail(
                field, value, f"an integer from 0 to {MAX_COUNT}" + (" or null" if optional else "")
            )

    def number(self, field: str, value: object) -> None:
        if value is not None and (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or not 0 <= value <= MAX_COUNT
        ):
            raise self.fail(field, value, "a number from 0 or null")

    def shallow(self, field: str, value: object) -> None:
        """A field kvsnap does not read: any JSON, but not nested past MAX_EXTRA_DEPTH."""
        stack = [(value, 1)]
        while stack:
            item, depth = stack.pop()
            if isinstance(item, (dict, list)):
                if depth > MAX_EXTRA_DEPTH:
                    raise ManifestError(
                        self.where,
                        f"is not a kvsnap manifest: {field} is nested more than {MAX_EXTRA_DEPTH} "
                        f"deep",
                        self.fix,
                    )
                stack += [
                    (v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)
                ]


def _check_entry(c: _Checker, field: str, entry: object) -> None:
    entry = c.obj(field, entry)
    c.text(
        f"{field}.file",
        entry.get("file"),
        SNAPSHOT_REL_MAX,
        SNAPSHOT_REL_RE,
        f"a store path {SNAPSHOT_REL_HINT}",
    )
    for name, value in entry.items():
        where = f"{field}.{name}"
        if name == "name":
            c.text(where, value, MAX_TEXT_CHARS)
        elif name == "key":
            c.text(where, value, 32, KEY_RE, "32 lowercase hex digits")
        elif name == "prompt_digest":
            c.text(where, value, MAX_DIGEST_CHARS)
        elif name == "n_tokens":
            c.count(where, value)
        elif name == "coverage":
            c.number(where, value)
        elif name != "file":
            c.shallow(where, value)


def _check_record(c: _Checker, field: str, record: object) -> None:
    record = c.obj(field, record)
    for name, value in record.items():
        where = f"{field}.{name}"
        if name == "entries":
            if not isinstance(value, list) or len(value) > MAX_ENTRIES:
                raise c.fail(where, value, f"a list of at most {MAX_ENTRIES} entries")
            for i, entry in enumerate(value):
                _check_entry(c, f"{where}[{i}]", entry)
        elif name == "model_digest":
            c.text(where, value, MAX_DIGEST_CHARS)
        elif name in ("model_path", "agents_file"):
            c.text(where, value, MAX_TEXT_CHARS)
        elif name == "updated":
            c.text(where, value, 64)
        elif name == "kv_settings":
            for key, setting in c.obj(where, value).items():
                c.count(f"{where}.{key}", setting)
        else:
            c.shallow(where, value)


def check_manifest(doc: object, where: str, fix: str = STORE_FIX) -> dict:
    """``doc`` if it has the shape kvsnap writes; else a ManifestError naming the field and
    value."""
    c = _Checker(where, fix)
    doc = c.obj("the top level", doc)
    records = doc.get("records")
    if not isinstance(records, dict) or len(records) > MAX_RECORDS:
        raise c.fail("records", records, f"an object of at most {MAX_RECORDS} records")
    for rid, record in records.items():
        c.text(f"record id {rid[:40]!r}", rid, MAX_ID_CHARS)
        _check_record(c, f"records[{rid!r}]", record)
    for name, value in doc.items():
        if name == "format":
            c.count("format", value, optional=False)
        elif name != "records":
            c.shallow(name, value)
    return doc


def parse_manifest(data: bytes, where: str, fix: str = STORE_FIX) -> dict:
    """Parse and check manifest bytes (at most MAX_MANIFEST_BYTES)."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(
            where,
            f"is {len(data)} bytes, over the {MAX_MANIFEST_BYTES}-byte limit for a manifest",
            fix,
        )
    try:
        doc = json.loads(data.decode("utf-8"))
    except RecursionError:
        raise ManifestError(
            where,
            "cannot be read (manifest.json is nested too deeply to be a kvsnap manifest)",
            fix,
        ) from None
    except ValueError as exc:  # also UnicodeDecodeError, and integers too long to convert
        raise ManifestError(
            where, f"cannot be read (manifest.json is not valid JSON: {str(exc)[:200]})", fix
        ) from None
    return check_manifest(doc, where, fix)


def read_manifest_file(path: Path, fix: str = STORE_FIX) -> dict:
    """The manifest at ``path`` (an empty one if there is none), size-checked before it is read."""
    try:
        # a FIFO planted here must not hang gc
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ManifestError(
                    str(path),
                    "is not a regular file",
                    "replace it with the store's manifest, or delete it and rebuild with `kvsnap "
                    "build`",
                )
            if st.st_size > MAX_MANIFEST_BYTES:
                raise ManifestError(
                    str(path),
                    f"is {st.st_size} bytes, over the {MAX_MANIFEST_BYTES}-byte limit for a "
                    f"manifest",
                    fix,
                )
            # not MAX_MANIFEST_BYTES: read() allocates what it is asked for
            data = f.read(st.st_size + 1)
    except FileNotFoundError:
        return empty_manifest()
    except OSError as exc:
        raise ManifestError(
            str(path), f"cannot be read ({exc.strerror or exc})", "check the file's permissions"
        ) from None
    return parse_manifest(data, str(path), fix)


def encode_manifest(manifest: dict) -> bytes:
    return json.dumps(manifest, indent=1, sort_keys=True).encode()


def referenced_files(manifest: dict) -> set[str]:
    """Every snapshot path any record lists (the manifest is already checked)."""
    return {
        entry["file"]
        for record in manifest["records"].values()
        for entry in record.get("entries", [])
    }


def _merge_record(current: dict, incoming: dict) -> dict:
    """``current`` with the incoming entries it lacks added: its fields and entries are kept as
    they are."""
    have = {(e.get("name"), e["file"]) for e in current.get("entries", [])}
    added = [e for e in incoming.get("entries", []) if (e.get("name"), e["file"]) not in have]
    if not added:
        return current
    return {**current, "entries": [*current.get("entries", []), *added]}


def merge_manifests(current: dict, incoming: dict) -> dict:
    """What an install leaves: every current record as it is, plus what the incoming ones add.

    Installs merge, never replace or shrink: an incoming record with an id the store already
    has only adds the entries that record lacks (a shipped manifest with that id and no
    entries once emptied a record, and ``gc`` then deleted its live files). A store's
    records, and so every snapshot they list, stay referenced and ``gc`` keeps them.
    """
    records = dict(current["records"])
    for rid, record in incoming["records"].items():
        records[rid] = _merge_record(records[rid], record) if rid in records else record
    return {**incoming, **current, "records": records}


def update_manifest(
    manifest: dict, record_id: str, update: Callable[[dict], dict], where: str
) -> bytes:
    """The bytes of ``manifest`` with one record replaced, checked as a reader would check them."""
    new = {
        **manifest,
        "records": {
            **manifest["records"],
            record_id: update(manifest["records"].get(record_id, {})),
        },
    }
    data = encode_manifest(new)
    parse_manifest(data, where, "this record cannot be written; nothing was changed")
    return data


def record_id(model_digest: str, agents_file: str) -> str:
    """One manifest record per (model identity, agents file)."""
    return hexdigest(
        canonical_json({"model": model_digest, "agents": os.path.abspath(agents_file)}).encode()
    )[:16]


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
