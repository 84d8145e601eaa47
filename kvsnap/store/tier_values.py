"""What a shared tier holds: names and sealed values. No mlx, no network.

Every value is one key holding its payload, its identity and its MAC together (never a
payload in one key and its metadata in another, which an LRU can evict apart):

    KVSNAPT2 | u32 big-endian header length | header JSON | payload

The header names the value's full key, kind, model digest and size; its ``mac`` is a keyed
BLAKE3 (its key derived from the fleet's secret) over the header (``mac`` left out) and the
payload, so
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
from typing import Any, Callable, Iterable

from kvsnap.errors import SnapshotError
from kvsnap.key import ModelIdentity, hexdigest
from kvsnap.snapshot.file import (
    MAX_HEADER_BYTES,
    FormatError,
    Header,
    OutTensor,
    finish_checksum,
    header_of_bytes,
    parse_header,
    start_checksum,
    verify_checksum,
    write_snapshot,
)
from kvsnap.snapshot.format import CHECKSUM_KEY, TENANT, TOKENS

# t2: values MAC'd with keyed BLAKE3 (t1's HMAC-SHA256 took 1.1 of a fetch's ~4 CPU seconds
# per 1.9 GB); another prefix, so replicas of either format see the other's values as misses
MAGIC = b"KVSNAPT2"
PREFIX = "kvsnap:t2"  # every name starts so: an operator's KEYS/SCAN pattern, a folder's name
MAC_CONTEXT = "kvsnap 2026-12 shared tier value MAC"  # BLAKE3 derive_key context
MAX_HEADER = 64 << 10
HASH_CHUNK = 1 << 20  # a received part is MAC-ed and checksummed this much at a time (in L2)
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


def _mac_state(secret: bytes, header: dict):
    """The MAC's state over the header (``mac`` left out), to be fed the payload: keyed
    BLAKE3 (2.5x HMAC-SHA256's speed on one core here, and it lets go of the GIL)."""
    import blake3

    body = json.dumps({k: v for k, v in header.items() if k != "mac"}, sort_keys=True)
    key = blake3.blake3(secret, derive_key_context=MAC_CONTEXT).digest()
    state = blake3.blake3(key=key)
    state.update(body.encode())
    return state


def _mac(secret: bytes, header: dict, payload: bytes | memoryview) -> str:
    h = _mac_state(secret, header)
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


def unseal(
    secret: bytes, name: str, kind: str, model_digest: str, value: bytes | bytearray
) -> Opened:
    """The value stored under ``name``, checked: FormatError (why) unless it is whole, was
    sealed under this name, kind and model, and its MAC holds."""
    if not isinstance(value, (bytes, bytearray)) or value[: len(MAGIC)] != MAGIC:
        raise FormatError("not a kvsnap tier value (no KVSNAPT2 magic)")
    if len(value) < len(MAGIC) + 4:
        raise FormatError("truncated before its header")
    (n,) = struct.unpack(">I", value[len(MAGIC) : len(MAGIC) + 4])
    start = len(MAGIC) + 4
    if n > MAX_HEADER or start + n > len(value):
        raise FormatError(f"its header length {n} runs past the value ({len(value)} bytes)")
    header = _sealed_header(value[start : start + n])
    payload = memoryview(value)[start + n :]
    _check_identity(header, name, kind, model_digest, len(payload))
    _check_mac(header, _mac(secret, header, payload))
    return Opened(header, payload)


def _sealed_header(raw: bytes | bytearray | memoryview) -> dict:
    try:
        header = json.loads(bytes(raw))
    except ValueError as exc:
        raise FormatError(f"its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise FormatError("its header is not an object")
    return header


def _check_identity(header: dict, name: str, kind: str, model_digest: str, size: int) -> None:
    want = {"name": name, "kind": kind, "model": model_digest, "size": size}
    for field, expected in want.items():
        if header.get(field) != expected:
            raise FormatError(
                f"its {field} is {str(header.get(field))[:80]!r}, expected {str(expected)[:80]!r}"
            )


def _check_mac(header: dict, computed: str) -> None:
    if not isinstance(header.get("mac"), str) or not hmac.compare_digest(header["mac"], computed):
        raise FormatError("its MAC does not hold (flipped, truncated or not sealed by this fleet)")


@dataclass(frozen=True)
class ReceivedPart:
    """A block or checkpoint received from the tier into buffers of the caller's (``place``):
    its file's header, the file's bytes before its data, its data (``runs``: one buffer of its
    own, or runs of a record's buffers, ``tier_layout``) and what ``place`` returned beside
    them (the tensors viewing them)."""

    header: Header
    head: bytes
    runs: tuple[memoryview, ...]
    held: Any

    @property
    def nbytes(self) -> int:
        """The part file's size: its head, then its runs in order (what the keeper writes)."""
        return len(self.head) + sum(len(run) for run in self.runs)


def receive_part(
    value: Any,
    secret: bytes,
    name: str,
    tier_kind: str,
    model_digest: str,
    kind: str,
    path,
    place: Callable[[Header], tuple[memoryview | Iterable[memoryview], Any]],
) -> ReceivedPart:
    """A sealed block or checkpoint read from ``value`` (a ``tier_backends.ValueReader``)
    with its data received straight into the buffer ``place(header)`` gives, or into the runs
    it gives (an iterable) in the data's order (one pass, no copy of the value in between),
    then checked as ``unseal`` and ``check_part_bytes`` check a value held whole: this name,
    kind and model, the MAC, the file's header, name and checksum. FormatError (or the store's
    SnapshotError) otherwise: nothing received may be used then."""
    from kvsnap.snapshot.chain import inspect_part

    def read(n: int) -> bytearray:
        out = bytearray(n)
        value.read_into(memoryview(out))
        return out

    fixed = len(MAGIC) + 4
    size = value.size
    if size < fixed:
        raise FormatError("truncated before its header")
    first = read(fixed)
    if first[: len(MAGIC)] != MAGIC:
        raise FormatError("not a kvsnap tier value (no KVSNAPT2 magic)")
    (n,) = struct.unpack(">I", first[len(MAGIC) :])
    if n > MAX_HEADER or fixed + n > size:
        raise FormatError(f"its header length {n} runs past the value ({size} bytes)")
    header = _sealed_header(read(n))
    payload_size = size - fixed - n
    _check_identity(header, name, tier_kind, model_digest, payload_size)
    if payload_size < 8:
        raise FormatError(f"its payload is {payload_size} bytes, too short for a part")
    prefix = read(8)
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > MAX_HEADER_BYTES or 8 + header_len > payload_size:
        raise FormatError(f"its part's header length {header_len} runs past the value")
    head = bytes(prefix + read(header_len))
    part = parse_header(io.BytesIO(head), payload_size)
    info = inspect_part(path, part)
    if info.kind != kind:
        raise FormatError(f"holds a {info.kind}, not a {kind}")
    placed, held = place(part)
    mac = _mac_state(secret, header)
    mac.update(head)
    checksum = start_checksum(part)
    hashes = (mac.update,) if isinstance(checksum, FormatError) else (mac.update, checksum.update)
    runs = []
    got = 0
    for run in (placed,) if isinstance(placed, memoryview) else placed:
        if got + len(run) > part.data_len:
            raise ValueError(f"placed more than the part's {part.data_len} data bytes")
        for at in range(0, len(run), HASH_CHUNK):  # each piece hashed while still in the cache
            piece = run[at : at + HASH_CHUNK]
            value.read_into(piece)
            for update in hashes:
                update(piece)
        runs.append(run)
        got += len(run)
    if got != part.data_len:
        raise ValueError(f"placed {got} bytes for the part's {part.data_len} data bytes")
    _check_mac(header, mac.hexdigest())
    finish_checksum(part, checksum)
    return ReceivedPart(part, head, tuple(runs), held)


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
