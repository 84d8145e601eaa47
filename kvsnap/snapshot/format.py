"""Every fact about kvsnap's files, in one place: the version numbers, the snapshot header's
fields, where a snapshot lives in a store, the dtypes a file may hold, and the OCI media
types named after those versions.

A new format version is one edit here: the header field the writer puts in, the value the
reader accepts and the media type ``kvsnap push`` labels a snapshot with all follow
(tests/snapshot/test_format.py bumps each constant in a copy of the package and checks).
This module imports nothing from kvsnap and no mlx, so every layer may import it.
"""

from __future__ import annotations

import json
import re

# --- versions -------------------------------------------------------------------------------

# The snapshot file. v3: a prompt record (its tokens, and the chain of content-addressed blocks
# and checkpoints that hold its state); v2: one file holding every layer's tensors (still read;
# `kvsnap migrate` turns it into v3). v2 made the checksum cover the header (v1: only the data).
FORMAT_VERSION = 3
WHOLE_FILE_FORMAT = 2  # the last format whose file holds the state itself
READ_FORMATS = (WHOLE_FILE_FORMAT, FORMAT_VERSION)
# a block or checkpoint file; keyed (the block and checkpoint key prefixes)
BLOCK_FORMAT_VERSION = 1
# how cache objects become tensors + layer metadata; keyed (identity and key prefix)
CODEC_FORMAT_VERSION = 1
# manifest.json's layout. Its first and only layout was written as 2 (the snapshot's number at the
# time) and readers take any integer, so 2 it stays: a lower number would read as older.
MANIFEST_FORMAT = 2
# one layer per store file, titled by its relative path; pull refuses other artifact types
OCI_ARTIFACT_VERSION = 1

# --- where things live in a store (every path relative to its root) ---------------------------

MANIFEST = "manifest.json"
SNAPSHOTS = "snapshots"
SUFFIX = ".safetensors"
KEY_RE = re.compile(r"[0-9a-f]{32}")  # a key, and every 128-bit digest in a header; use fullmatch
SNAPSHOT_REL_RE = re.compile(rf"{SNAPSHOTS}/[0-9a-f]{{32}}{re.escape(SUFFIX)}")
SNAPSHOT_REL_HINT = f"{SNAPSHOTS}/<32 hex digits>{SUFFIX}"  # how messages describe the path
SNAPSHOT_REL_MAX = len(SNAPSHOTS) + 1 + 32 + len(SUFFIX)
BLOCKS = "blocks"  # blocks/<key>.safetensors: the attention-KV slice of one run of tokens
# checkpoints/<key>.safetensors: non-trimmable layers' whole state at one token count
CHECKPOINTS = "checkpoints"
PART_FOLDERS = (BLOCKS, CHECKPOINTS)
# conversations/<key>.safetensors: a persisted request prefix (same record format, its own
# folder: users' data, never shipped); conversations/.secret: the store's tenant-tag secret
CONVERSATIONS = "conversations"
SECRET_NAME = ".secret"
PART_REL_RE = re.compile(rf"(?:{BLOCKS}|{CHECKPOINTS})/[0-9a-f]{{32}}{re.escape(SUFFIX)}")
# every file a store ships besides the manifest
STORE_FILE_RE = re.compile(rf"{SNAPSHOT_REL_RE.pattern}|{PART_REL_RE.pattern}")


def snapshot_filename(key: str) -> str:
    """The file name of the snapshot with this key (the key is the content address)."""
    return f"{key}{SUFFIX}"


def relpath_of_file(name: str) -> str:
    """The store-relative path of a file named ``name`` in the snapshots folder (as the manifest
    lists it)."""
    return f"{SNAPSHOTS}/{name}"


def snapshot_relpath(key: str) -> str:
    """The store-relative path of the snapshot with this key: ``snapshots/<key>.safetensors``."""
    return relpath_of_file(snapshot_filename(key))


def block_relpath(key: str) -> str:
    """``blocks/<key>.safetensors``."""
    return f"{BLOCKS}/{snapshot_filename(key)}"


def checkpoint_relpath(key: str) -> str:
    """``checkpoints/<key>.safetensors``."""
    return f"{CHECKPOINTS}/{snapshot_filename(key)}"


# --- the snapshot header (``__metadata__``, every value a string) ------------------------------

CHECKSUM_KEY = "kvsnap.xxh3_128"
TOKENS = "tokens"  # the tensor of the prefix's token ids, checked against the key and the request
TOKENS_DTYPE = "I32"
REQUIRED_META = (
    "kvsnap.format",
    "kvsnap.key",
    "kvsnap.model",
    "kvsnap.model_digest",
    "kvsnap.prompt_digest",
    "kvsnap.n_tokens",
    "kvsnap.tokens_digest",
    "kvsnap.layers",
)
OPTIONAL_META = ("kvsnap.name", "kvsnap.recorded")
# v3 records: {"block_tokens", "checkpoint_every", "blocks": [[key, start, end]], "checkpoints":
# [[key, end]]}
CHAIN = "kvsnap.chain"
# Block and checkpoint files (``kvsnap.kind`` says which).
PART_META = (
    "kvsnap.format",
    "kvsnap.kind",
    "kvsnap.key",
    "kvsnap.model_digest",
    "kvsnap.start",
    "kvsnap.end",
    "kvsnap.prefix_digest",
)  # + kvsnap.layers
# A part's KV form (quantized or unquantized), only where the model's KV has two: its key hashes it.
KV_FORM = "kvsnap.kv_form"
# A part's per-row digests (``snapshot/rows.py``): a sharded rank checks only the rows it reads.
ROW_DIGESTS = "kvsnap.row_digests"
# A conversation record's tenant: a digest of its API key's tag under the store's secret, one per
# key whatever the cache_salt (``store/conversations.py``); the disk budget's unit. Not keyed.
TENANT = "kvsnap.tenant"
BLOCK_KIND, CHECKPOINT_KIND = "block", "checkpoint"
HEADER_FIELDS = (
    REQUIRED_META
    + OPTIONAL_META
    + (
        CHAIN,
        "kvsnap.kind",
        "kvsnap.start",
        "kvsnap.end",
        "kvsnap.prefix_digest",
        KV_FORM,
        ROW_DIGESTS,
        TENANT,
        CHECKSUM_KEY,
    )
)


def header_metadata(
    *,
    key: str,
    name: str,
    model: dict,
    model_digest: str,
    prompt_digest: str,
    n_tokens: int,
    tokens_digest: str,
    layers: list,
    recorded: dict,
    chain: dict | None = None,
    tenant: str = "",
) -> dict[str, str]:
    """The ``__metadata__`` a snapshot is written with (the writer adds the checksum).

    With ``chain`` it is a v3 prompt record; without, a v2 whole file (what ``kvsnap migrate``
    reads and the tests write). ``tenant``: a conversation record's ``kvsnap.tenant`` (no field
    when ""). Field order and JSON spelling are part of the file's bytes: keep them.
    """
    extra = {CHAIN: encode_chain(chain)} if chain is not None else {}
    if tenant:
        extra[TENANT] = tenant
    return {
        "kvsnap.format": str(FORMAT_VERSION if chain is not None else WHOLE_FILE_FORMAT),
        "kvsnap.key": key,
        "kvsnap.name": name,
        "kvsnap.model": json.dumps(model, sort_keys=True),
        "kvsnap.model_digest": model_digest,
        "kvsnap.prompt_digest": prompt_digest,
        "kvsnap.n_tokens": str(n_tokens),
        "kvsnap.tokens_digest": tokens_digest,
        "kvsnap.layers": json.dumps(layers),
        "kvsnap.recorded": json.dumps(recorded, sort_keys=True),
        **extra,
    }


def encode_chain(chain: dict) -> str:
    """``kvsnap.chain``'s text: compact, keys sorted (part of the file's bytes)."""
    return json.dumps(chain, sort_keys=True, separators=(",", ":"))


def part_metadata(
    *,
    kind: str,
    key: str,
    model_digest: str,
    start: int,
    end: int,
    prefix_digest: str,
    layers: list | None,
    form: str = "",
) -> dict[str, str]:
    """The header of a block (``kind`` "block": the sliceable layers' tensors for tokens [start,
    end))
    or a checkpoint (the other layers' whole state at ``end``, start 0). ``layers``: the whole
    layer list as of ``end`` -- a checkpoint's always, a block's only when every layer is
    sliceable (then it is exact; a hybrid restores its layer list from a checkpoint). ``form``:
    the KV form its key names, "" (no field) where the model has one."""
    return {
        "kvsnap.format": str(BLOCK_FORMAT_VERSION),
        "kvsnap.kind": kind,
        "kvsnap.key": key,
        "kvsnap.model_digest": model_digest,
        "kvsnap.start": str(start),
        "kvsnap.end": str(end),
        "kvsnap.prefix_digest": prefix_digest,
        **({"kvsnap.layers": json.dumps(layers)} if layers is not None else {}),
        **({KV_FORM: form} if form else {}),
    }


def check_format_field(value: str) -> str | None:
    """None if a header's ``kvsnap.format`` is one this kvsnap reads; else what is wrong, with the
    fix."""
    if value in {str(v) for v in READ_FORMATS}:
        return None
    return (
        f"snapshot format version {value[:20]!r} is not one this kvsnap reads "
        f"({' or '.join(map(str, READ_FORMATS))}); rebuild it with this kvsnap"
    )


# --- tensor dtypes: safetensors name -> (mlx dtype attribute, bytes per element) -------------

DTYPES: dict[str, tuple[str, int]] = {
    "BOOL": ("bool_", 1),
    "U8": ("uint8", 1),
    "I8": ("int8", 1),
    "U16": ("uint16", 2),
    "I16": ("int16", 2),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "U32": ("uint32", 4),
    "I32": ("int32", 4),
    "F32": ("float32", 4),
    "U64": ("uint64", 8),
    "I64": ("int64", 8),
    "F64": ("float64", 8),
}
DTYPE_SIZES = {name: size for name, (_, size) in DTYPES.items()}

# --- OCI (``kvsnap push`` / ``pull``) ---------------------------------------------------------

ARTIFACT_TYPE = f"application/vnd.kvsnap.store.v{OCI_ARTIFACT_VERSION}"
SNAPSHOT_MEDIA_TYPE = f"application/vnd.kvsnap.snapshot.v{FORMAT_VERSION}+safetensors"
# blocks and checkpoints
BLOCK_MEDIA_TYPE = f"application/vnd.kvsnap.block.v{BLOCK_FORMAT_VERSION}+safetensors"
MANIFEST_MEDIA_TYPE = f"application/vnd.kvsnap.manifest.v{MANIFEST_FORMAT}+json"
