"""What a shared tier holds (kvsnap/store/tier_values.py): a sealed value opens only whole,
under the name, kind and model it was sealed for and under the fleet's secret; a record
re-keyed for another store keeps its tokens and nothing else changes but its three keyed
fields; two namespaces' names never meet. No servers, no network."""

from __future__ import annotations

import hashlib
import io
import struct

import pytest
from helpers.snapshot_meta import fixed_identity, snapshot_metadata

from kvsnap.errors import SnapshotError
from kvsnap.key import pack_tokens
from kvsnap.snapshot.file import FormatError, OutTensor, parse_header, write_snapshot
from kvsnap.snapshot.format import CHECKSUM_KEY, TENANT, TOKENS, TOKENS_DTYPE
from kvsnap.store.tier_values import (
    BLOCK,
    CHECKPOINT,
    KINDS,
    MAGIC,
    PREFIX,
    RECORD,
    RecordFields,
    TierNames,
    kv_digest,
    namespace_tag,
    record_fields,
    rekeyed_record,
    seal,
    unseal,
)

SECRET = hashlib.sha256(b"fleet one").digest()
OTHER_SECRET = hashlib.sha256(b"fleet two").digest()
IDENTITY = fixed_identity(["KVCache", "KVCache"])
MODEL = IDENTITY.digest
NAMES = TierNames.of(IDENTITY, namespace_tag(SECRET, "fp-alpha/salt"))
NAME = NAMES.value(BLOCK, "0123456789abcdef0123456789abcdef")
PAYLOAD = bytes(range(256)) * 2
TOKEN_IDS = list(range(5, 45))


def sealed(payload: bytes = PAYLOAD, **extra) -> bytes:
    return seal(SECRET, NAME, BLOCK, MODEL, payload, **extra)


def payload_start(value: bytes) -> int:
    (n,) = struct.unpack(">I", value[len(MAGIC) : len(MAGIC) + 4])
    return len(MAGIC) + 4 + n


# --- seal / unseal ----------------------------------------------------------------------------


def test_a_sealed_value_opens_to_its_payload_and_header():
    value = sealed(parts=[["block", "k", 3]])
    assert value.startswith(MAGIC)
    opened = unseal(SECRET, NAME, BLOCK, MODEL, value)
    assert bytes(opened.payload) == PAYLOAD
    assert opened.header["name"] == NAME and opened.header["kind"] == BLOCK
    assert opened.header["model"] == MODEL and opened.header["size"] == len(PAYLOAD)
    assert opened.header["parts"] == [["block", "k", 3]]
    # a bytearray (what a client may hand back) opens the same
    assert bytes(unseal(SECRET, NAME, BLOCK, MODEL, bytearray(value)).payload) == PAYLOAD


def test_an_empty_payload_seals_and_opens():
    opened = unseal(SECRET, NAME, BLOCK, MODEL, sealed(b""))
    assert bytes(opened.payload) == b""


@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_a_flipped_byte_anywhere_is_a_format_error(mask):
    value = sealed(parts=[["block", "k", 3]])
    start = payload_start(value)
    opened_anyway = []
    for i in range(len(value)):
        flipped = bytearray(value)
        flipped[i] ^= mask
        try:
            unseal(SECRET, NAME, BLOCK, MODEL, bytes(flipped))
        except FormatError:
            continue
        opened_anyway.append((i, "payload" if i >= start else "header"))
    assert opened_anyway == []


def test_a_truncated_value_is_a_format_error_at_every_length():
    value = sealed()
    for n in range(len(value)):
        with pytest.raises(FormatError):
            unseal(SECRET, NAME, BLOCK, MODEL, value[:n])


def test_bytes_appended_to_a_value_are_a_format_error():
    with pytest.raises(FormatError, match="size"):
        unseal(SECRET, NAME, BLOCK, MODEL, sealed() + b"\x00")


def test_a_header_length_past_the_value_is_a_format_error_not_a_crash():
    value = bytearray(sealed())
    value[len(MAGIC) : len(MAGIC) + 4] = struct.pack(">I", 2**32 - 1)
    with pytest.raises(FormatError, match="header length"):
        unseal(SECRET, NAME, BLOCK, MODEL, bytes(value))


@pytest.mark.parametrize("value", [b"", b"KVSNAPT", b"plain bytes", "KVSNAPT2 text", None])
def test_what_is_not_a_sealed_value_is_a_format_error(value):
    with pytest.raises(FormatError):
        unseal(SECRET, NAME, BLOCK, MODEL, value)  # type: ignore[arg-type]


def test_a_value_copied_under_another_name_is_a_format_error():
    other = NAMES.value(BLOCK, "f" * 32)
    with pytest.raises(FormatError, match="name"):
        unseal(SECRET, other, BLOCK, MODEL, sealed())


def test_a_value_copied_into_another_namespace_is_a_format_error():
    names_b = TierNames.of(IDENTITY, namespace_tag(SECRET, "fp-bravo/salt"))
    with pytest.raises(FormatError, match="name"):
        unseal(SECRET, names_b.value(BLOCK, NAME.rsplit(":", 1)[1]), BLOCK, MODEL, sealed())


@pytest.mark.parametrize("kind", [RECORD, CHECKPOINT])
def test_a_value_opened_as_another_kind_is_a_format_error(kind):
    with pytest.raises(FormatError, match="kind"):
        unseal(SECRET, NAME, kind, MODEL, sealed())


def test_a_value_of_another_model_is_a_format_error():
    other = fixed_identity(["KVCache", "KVCache"], weights="e" * 32).digest
    assert other != MODEL
    with pytest.raises(FormatError, match="model"):
        unseal(SECRET, NAME, BLOCK, other, sealed())


def test_a_value_sealed_under_another_secret_is_a_format_error():
    foreign = seal(OTHER_SECRET, NAME, BLOCK, MODEL, PAYLOAD)
    with pytest.raises(FormatError, match="MAC"):
        unseal(SECRET, NAME, BLOCK, MODEL, foreign)


def test_a_header_rewritten_without_the_secret_is_a_format_error():
    """Someone with write access to the tier but not the secret: a header whose fields all
    fit (here its extra ``parts`` sizes changed) and a MAC they cannot recompute."""
    value = sealed(parts=[["block", "k", 3]])
    forged = value.replace(b'"k", 3', b'"k", 9')
    assert forged != value and len(forged) == len(value)
    with pytest.raises(FormatError, match="MAC"):
        unseal(SECRET, NAME, BLOCK, MODEL, forged)


def test_a_payload_swapped_for_another_of_the_same_size_is_a_format_error():
    value = sealed()
    start = payload_start(value)
    swapped = value[:start] + bytes(reversed(PAYLOAD))
    with pytest.raises(FormatError, match="MAC"):
        unseal(SECRET, NAME, BLOCK, MODEL, swapped)


# --- names ------------------------------------------------------------------------------------


def all_names(names: TierNames) -> set[str]:
    return {names.value(kind, "a" * 32) for kind in KINDS} | {names.index, names.scope}


def test_two_namespaces_share_no_name_and_differ_only_in_the_namespace_field():
    a = TierNames.of(IDENTITY, namespace_tag(SECRET, "fp-alpha/"))
    b = TierNames.of(IDENTITY, namespace_tag(SECRET, "fp-bravo/"))
    assert all_names(a).isdisjoint(all_names(b))
    for name in all_names(a) | all_names(b):
        assert name.startswith(PREFIX + ":")
    fa, fb = a.value(RECORD, "a" * 32).split(":"), b.value(RECORD, "a" * 32).split(":")
    assert [i for i in range(len(fa)) if fa[i] != fb[i]] == [4]
    assert fa[2] == MODEL and fa[3] == kv_digest(IDENTITY) and fa[5] == RECORD


def test_a_namespace_tag_names_neither_the_namespace_nor_its_hash_and_needs_the_secret():
    namespace = "fp-alpha/my-salt"
    tag = namespace_tag(SECRET, namespace)
    assert len(tag) == 32 and int(tag, 16) >= 0
    assert namespace not in tag and "my-salt" not in tag
    assert tag not in hashlib.sha256(namespace.encode()).hexdigest()
    assert tag != namespace_tag(OTHER_SECRET, namespace)
    assert tag == namespace_tag(SECRET, namespace)  # every replica of the fleet agrees
    # the tier's tag is not the local store's tag of the same namespace under the same secret
    from kvsnap.store.conversations import namespace_tag as store_tag

    assert tag != store_tag(SECRET, namespace)


def test_another_model_or_other_kv_settings_have_other_names():
    other_model = fixed_identity(["KVCache", "KVCache"], weights="e" * 32)
    other_kv = fixed_identity(["KVCache", "KVCache"], max_kv_size=4096)
    tag = namespace_tag(SECRET, "fp-alpha/")
    scopes = {TierNames.of(i, tag).scope for i in (IDENTITY, other_model, other_kv)}
    assert len(scopes) == 3
    assert kv_digest(IDENTITY) == kv_digest(other_model) != kv_digest(other_kv)


def test_an_unknown_kind_has_no_name():
    with pytest.raises(ValueError, match="kind"):
        NAMES.value("snapshot", "a" * 32)


# --- records ----------------------------------------------------------------------------------


def record_bytes(tokens=TOKEN_IDS, tenant: str = "") -> bytes:
    meta = snapshot_metadata(IDENTITY, tokens, "[]")
    if tenant:
        meta[TENANT] = tenant
    out = io.BytesIO()
    raw = pack_tokens(tokens)
    write_snapshot(out, [OutTensor(TOKENS, TOKENS_DTYPE, (len(tokens),), memoryview(raw))], meta)
    return out.getvalue()


def metadata(data: bytes) -> dict:
    return dict(parse_header(io.BytesIO(data), len(data)).metadata)


@pytest.mark.parametrize("tenant", ["", "7" * 32])
def test_a_rekeyed_record_keeps_its_tokens_and_changes_only_its_keyed_fields(tenant):
    data = record_bytes(tenant=tenant)
    fields = RecordFields("1" * 32, "2" * 32, "3" * 32 if tenant else "")
    out = rekeyed_record(data, fields)
    meta, raw = record_fields(out)  # its checksum holds
    assert raw == pack_tokens(TOKEN_IDS)
    assert meta["kvsnap.key"] == fields.key
    assert meta["kvsnap.prompt_digest"] == fields.prompt_digest
    assert meta.get(TENANT, "") == fields.tenant
    before, after = metadata(data), metadata(out)
    assert list(before) == list(after)  # the fields' order is part of the file's bytes
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {"kvsnap.key", "kvsnap.prompt_digest", CHECKSUM_KEY} | (
        {TENANT} if tenant else set()
    )
    # re-keyed back, it is the same file byte for byte
    again = rekeyed_record(out, RecordFields(before["kvsnap.key"], "d" * 32, tenant))
    assert again == data


@pytest.mark.parametrize("tenant, new", [("", "3" * 32), ("7" * 32, "")])
def test_a_record_rekeyed_for_a_namespace_of_another_kind_is_refused(tenant, new):
    with pytest.raises(SnapshotError, match="tenant"):
        rekeyed_record(record_bytes(tenant=tenant), RecordFields("1" * 32, "2" * 32, new))


def test_a_damaged_record_is_not_rekeyed():
    data = bytearray(record_bytes())
    data[-1] ^= 0x01  # a token
    with pytest.raises(SnapshotError):
        rekeyed_record(bytes(data), RecordFields("1" * 32, "2" * 32, ""))
    with pytest.raises(SnapshotError):
        record_fields(bytes(data))
    with pytest.raises(SnapshotError):
        record_fields(record_bytes()[:-4])


# --- parts checked in memory ------------------------------------------------------------------


def test_bytes_that_are_not_a_block_are_refused_before_anything_is_written(tmp_path):
    from kvsnap.store.tier_values import check_part_bytes

    target = tmp_path / "blocks" / "0123456789abcdef0123456789abcdef.safetensors"
    record = record_bytes()  # a sound kvsnap file, but a record, not a block
    for data in (PAYLOAD, record, record[:-1]):
        with pytest.raises(SnapshotError):
            check_part_bytes("block", data, target)
    assert not target.exists()
