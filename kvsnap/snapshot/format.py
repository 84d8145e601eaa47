"""Every fact about kvsnap's files, in one place: the version numbers, the snapshot header's
fields, where a snapshot lives in a store, the dtypes a file may hold, and the OCI media
types named after those versions.

A new format version is one edit here: the header field the writer puts in, the value the
reader accepts and the media type ``kvsnap push`` labels a snapshot with all follow
(tests/test_format_owner.py bumps each constant in a copy of the package and checks).
This module imports nothing from kvsnap and no mlx, so every layer may import it.
"""

from __future__ import annotations

import json
import re

# --- versions -------------------------------------------------------------------------------

FORMAT_VERSION = 2  # the snapshot file; v2: the checksum covers the header too (v1 covered only the data)
CODEC_FORMAT_VERSION = 1  # how cache objects become tensors + layer metadata; keyed (identity and key prefix)
# manifest.json's layout. Its first and only layout was written as 2 (the snapshot's number at the
# time) and readers take any integer, so 2 it stays: a lower number would read as older.
MANIFEST_FORMAT = 2
OCI_ARTIFACT_VERSION = 1  # one layer per store file, titled by its relative path; pull refuses other artifact types

# --- where things live in a store (every path relative to its root) ---------------------------

MANIFEST = "manifest.json"
SNAPSHOTS = "snapshots"
SUFFIX = ".safetensors"
KEY_RE = re.compile(r"[0-9a-f]{32}")  # a key, and every 128-bit digest in a header; use fullmatch
SNAPSHOT_REL_RE = re.compile(rf"{SNAPSHOTS}/[0-9a-f]{{32}}{re.escape(SUFFIX)}")
SNAPSHOT_REL_HINT = f"{SNAPSHOTS}/<32 hex digits>{SUFFIX}"  # how messages describe the path
SNAPSHOT_REL_MAX = len(SNAPSHOTS) + 1 + 32 + len(SUFFIX)


def snapshot_filename(key: str) -> str:
    """The file name of the snapshot with this key (the key is the content address)."""
    return f"{key}{SUFFIX}"


def relpath_of_file(name: str) -> str:
    """The store-relative path of a file named ``name`` in the snapshots folder (as the manifest lists it)."""
    return f"{SNAPSHOTS}/{name}"


def snapshot_relpath(key: str) -> str:
    """The store-relative path of the snapshot with this key: ``snapshots/<key>.safetensors``."""
    return relpath_of_file(snapshot_filename(key))


# --- the snapshot header (``__metadata__``, every value a string) ------------------------------

CHECKSUM_KEY = "kvsnap.xxh3_128"
TOKENS = "tokens"  # the tensor of the prefix's token ids, checked against the key and the request
TOKENS_DTYPE = "I32"
REQUIRED_META = ("kvsnap.format", "kvsnap.key", "kvsnap.model", "kvsnap.model_digest", "kvsnap.prompt_digest", "kvsnap.n_tokens", "kvsnap.tokens_digest", "kvsnap.layers")
OPTIONAL_META = ("kvsnap.name", "kvsnap.recorded")
HEADER_FIELDS = REQUIRED_META + OPTIONAL_META + (CHECKSUM_KEY,)


def header_metadata(
    *, key: str, name: str, model: dict, model_digest: str, prompt_digest: str, n_tokens: int, tokens_digest: str, layers: list, recorded: dict
) -> dict[str, str]:
    """The ``__metadata__`` a snapshot is written with (the writer adds the checksum).

    Field order and JSON spelling are part of the file's bytes: keep them.
    """
    return {
        "kvsnap.format": str(FORMAT_VERSION),
        "kvsnap.key": key,
        "kvsnap.name": name,
        "kvsnap.model": json.dumps(model, sort_keys=True),
        "kvsnap.model_digest": model_digest,
        "kvsnap.prompt_digest": prompt_digest,
        "kvsnap.n_tokens": str(n_tokens),
        "kvsnap.tokens_digest": tokens_digest,
        "kvsnap.layers": json.dumps(layers),
        "kvsnap.recorded": json.dumps(recorded, sort_keys=True),
    }


def check_format_field(value: str) -> str | None:
    """None if a header's ``kvsnap.format`` is the one this kvsnap reads; else what is wrong, with the fix."""
    if value == str(FORMAT_VERSION):
        return None
    return f"snapshot format version {value[:20]!r} is not the supported {FORMAT_VERSION}; rebuild it with this kvsnap"


# --- tensor dtypes: safetensors name -> (mlx dtype attribute, bytes per element) -------------

DTYPES: dict[str, tuple[str, int]] = {
    "BOOL": ("bool_", 1), "U8": ("uint8", 1), "I8": ("int8", 1), "U16": ("uint16", 2), "I16": ("int16", 2),
    "F16": ("float16", 2), "BF16": ("bfloat16", 2), "U32": ("uint32", 4), "I32": ("int32", 4),
    "F32": ("float32", 4), "U64": ("uint64", 8), "I64": ("int64", 8), "F64": ("float64", 8),
}
DTYPE_SIZES = {name: size for name, (_, size) in DTYPES.items()}

# --- OCI (``kvsnap push`` / ``pull``) ---------------------------------------------------------

ARTIFACT_TYPE = f"application/vnd.kvsnap.store.v{OCI_ARTIFACT_VERSION}"
SNAPSHOT_MEDIA_TYPE = f"application/vnd.kvsnap.snapshot.v{FORMAT_VERSION}+safetensors"
MANIFEST_MEDIA_TYPE = f"application/vnd.kvsnap.manifest.v{MANIFEST_FORMAT}+json"
