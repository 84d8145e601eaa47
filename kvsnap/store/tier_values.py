"""What a shared tier holds: names and sealed values. No mlx, no network.

Every value is one key holding its payload, its identity and its MAC together (never a
payload in one key and its metadata in another, which an LRU can evict apart):

    KVSNAPT1 | u32 big-endian header length | header JSON | payload

The header names the value's full key, kind, model digest and size; its ``mac`` is an
HMAC-SHA256 under the fleet's secret over the header (``mac`` left out) and the payload, so
a value copied under another key, flipped, truncated, or planted by someone without the
secret opens as ``None`` (a miss), never as data. A name carries the model identity, the KV
settings and the namespace's tag, so two tenants' (or models') key sets never meet.

A conversation record is stored keyed for the tier (its ``kvsnap.key``/``prompt_digest``/
``tenant`` computed under the fleet's secret) and re-keyed for the local store on fetch:
``rekeyed_record`` rewrites those three fields and the file's checksum, nothing else.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import struct
from dataclasses import dataclass

from kvsnap.errors import SnapshotError
from kvsnap.key import ModelIdentity, hexdigest
from kvsnap.snapshot.file import (
    FormatError,
    OutTensor,
    header_of_bytes,
    verify_checksum,
    write_snapshot,
)
from kvsnap.snapshot.format import CHECKSUM_KEY, TENANT, TOKENS

MAGIC = b"KVSNAPT1"
PREFIX = "kvsnap:t1"  # every name starts so: an operator's KEYS/SCAN pattern, a folder's name
MAX_HEADER = 64 << 10
RECORD, BLOCK, CHECKPOINT = "record", "block", "checkpoint"
KINDS = (RECORD, BLOCK, CHECKPOINT)


@dataclass(frozen=True)
class TierNames:
    """The names of one model's (and KV settings') values in one namespace."""

    model_digest: str
    kv_digest: str
    namespace_tag: str

    @classmethod
    def of(cls, identity: ModelIdentity, namespace_tag: str) -> TierNames:
        return cls(identity.digest, kv_digest(identity), namespace_tag)

    @property
    def scope(self) -> str:
        return f"{PREFIX}:{self.model_digest}:{self.kv_digest}:{self.namespace_tag}"

    def value(self, kind: str, key: str) -> str:
        if kind not in KINDS:
            raise ValueError(f"tier value kind {kind!r} is not one of {', '.join(KINDS)}")
        return f"{self.scope}:{kind}:{key}"

    @property
    def index(self) -> str:
        """The namespace's records (a sorted set by last write, bounded)."""
        return f"{self.scope}:records"


def kv_digest(identity: ModelIdentity) -> str:
    """The KV settings a value was made under, as 8 hex digits of its name."""
    fields = {
        "kv_dtype": identity.kv_dtype,
        "kv_bits": identity.kv_bits,
        "kv_group_size": identity.kv_group_size,
        "quantized_kv_start": identity.quantized_kv_start,
        "max_kv_size": identity.max_kv_size,
    }
    return hexdigest(json.dumps(fields, sort_keys=True).encode())[:8]


def namespace_tag(secret: bytes, namespace: str) -> str:
    """A namespace (API-key fingerprint + cache_salt) as the tier knows it: an HMAC under
    the fleet's secret, so no name is the key or an unsalted hash of it."""
    return hmac.new(secret, b"kvsnap-tier-ns|" + namespace.encode(), hashlib.sha256).hexdigest()[
        :32
    ]


def _mac(secret: bytes, header: dict, payload: bytes | memoryview) -> str:
    body = json.dumps({k: v for k, v in header.items() if k != "mac"}, sort_keys=True)
    h = hmac.new(secret, body.encode(), hashlib.sha256)
    h.update(payload)
    return h.hexdigest()


def seal(secret: bytes, name: str, kind: str, model_digest: str, payload: bytes, **extra) -> bytes:
    """``payload`` as the value stored under ``name``."""
    header = {"name": name, "kind": kind, "model": model_digest, "size": len(payload), **extra}
    header["mac"] = _mac(secret, header, payload)
    raw = json.dumps(header, sort_keys=True).encode()
    return MAGIC + struct.pack(">I", len(raw)) + raw + payload


@dataclass(frozen=True)
class Opened:
    header: dict
    payload: memoryview


def unseal(secret: bytes, name: str, kind: str, model_digest: str, value: bytes) -> Opened:
    """The value stored under ``name``, checked: FormatError (why) unless it is whole, was
    sealed under this name, kind and model, and its MAC holds."""
    if not isinstance(value, (bytes, bytearray)) or value[: len(MAGIC)] != MAGIC:
        raise FormatError("not a kvsnap tier value (no KVSNAPT1 magic)")
    if len(value) < len(MAGIC) + 4:
        raise FormatError("truncated before its header")
    (n,) = struct.unpack(">I", value[len(MAGIC) : len(MAGIC) + 4])
    start = len(MAGIC) + 4
    if n > MAX_HEADER or start + n > len(value):
        raise FormatError(f"its header length {n} runs past the value ({len(value)} bytes)")
    try:
        header = json.loads(bytes(value[start : start + n]))
    except ValueError as exc:
        raise FormatError(f"its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise FormatError("its header is not an object")
    payload = memoryview(value)[start + n :]
    want = {"name": name, "kind": kind, "model": model_digest, "size": len(payload)}
    for field, expected in want.items():
        if header.get(field) != expected:
            raise FormatError(
                f"its {field} is {str(header.get(field))[:80]!r}, expected {str(expected)[:80]!r}"
            )
    if not isinstance(header.get("mac"), str) or not hmac.compare_digest(
        header["mac"], _mac(secret, header, payload)
    ):
        raise FormatError("its MAC does not hold (flipped, truncated or not sealed by this fleet)")
    return Opened(header, payload)


# --- conversation records ---------------------------------------------------------------------


@dataclass(frozen=True)
class RecordFields:
    key: str
    prompt_digest: str
    tenant: str


def _checked_record(data: bytes | memoryview):
    """A record file's parsed header and its tokens' bytes, its checksum checked."""
    try:
        header = header_of_bytes(data)
        verify_checksum(header, memoryview(data)[header.data_start :])
        tok = header.tensors.get(TOKENS)
        if tok is None:
            raise FormatError("it holds no tokens")
    except FormatError as exc:
        raise SnapshotError("tier record", str(exc)) from None
    start = header.data_start + tok.start
    return header, bytes(data[start : start + tok.nbytes])


def record_fields(data: bytes | memoryview) -> tuple[dict, bytes]:
    """A record file's metadata and its tokens' bytes, its checksum checked; SnapshotError."""
    header, raw = _checked_record(data)
    return dict(header.metadata), raw


def record_info(data: bytes, path, max_tokens: int):
    """The ``SnapshotInfo`` of record bytes that will be stored at ``path`` (its name, key,
    tokens and chain checked as the store checks a file); SnapshotError."""
    from kvsnap.snapshot.header import inspect_header

    try:
        header = header_of_bytes(data)
        tok = header.tensors.get(TOKENS)
        raw = None
        if tok is not None:
            raw = data[header.data_start + tok.start : header.data_start + tok.end]
        return inspect_header(path, header, raw, max_tokens)
    except FormatError as exc:
        raise SnapshotError(str(path), str(exc)) from None


def check_part_bytes(kind: str, data: bytes | memoryview, path) -> None:
    """A block's or checkpoint's bytes, to be stored at ``path``, checked as the store checks
    the file (header, the key its fields hash to, its name, checksum) without writing and
    reading it back; SnapshotError."""
    from kvsnap.snapshot.chain import inspect_part

    try:
        header = header_of_bytes(data)
        info = inspect_part(path, header)
        if info.kind != kind:
            raise FormatError(f"holds a {info.kind}, not a {kind}")
        verify_checksum(header, memoryview(data)[header.data_start :])
    except FormatError as exc:
        raise SnapshotError(str(path), str(exc)) from None


def rekeyed_record(data: bytes | memoryview, fields: RecordFields) -> bytes:
    """The record file ``data`` with its key, prompt digest and tenant replaced (order kept,
    checksum rewritten); SnapshotError if ``data`` is not a sound record."""
    header, raw = _checked_record(data)  # one parse: the metadata and the tokens' entry
    meta, tok = dict(header.metadata), header.tensors[TOKENS]
    meta.pop(CHECKSUM_KEY, None)
    if (TENANT in meta) != bool(fields.tenant):
        raise SnapshotError("tier record", "its tenant field does not fit this namespace")
    meta["kvsnap.key"] = fields.key
    meta["kvsnap.prompt_digest"] = fields.prompt_digest
    if fields.tenant:
        meta[TENANT] = fields.tenant
    out = io.BytesIO()
    write_snapshot(out, [OutTensor(TOKENS, tok.dtype, tok.shape, memoryview(raw))], meta)
    return out.getvalue()
