"""Fingerprints and snapshot keys: everything that makes a cached state valid, hashed with xxhash.

No mlx here. A snapshot's key is the hash of (model identity, prompt identity, tokens);
the model identity alone is the store's namespace for "snapshots of this model".
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import tempfile
from dataclasses import asdict, dataclass, field
from functools import cached_property
from importlib import metadata as _metadata
from pathlib import Path
from typing import Any, Iterable, Sequence

import xxhash

from kvsnap.errors import ModelError
from kvsnap.snapshot.format import CODEC_FORMAT_VERSION

DEFAULT_PREFILL_STEP = 512  # CPU attention is fastest in 512-row chunks; one shared default
DIGEST_CHUNK = 8 << 20  # read size only: a digest covers every byte of the file, whatever the chunk

# Files that decide how text becomes tokens (and how messages become text).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def hexdigest(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def tokens_digest(tokens: Sequence[int]) -> str:
    return tokens_digest_of_bytes(pack_tokens(tokens))


def tokens_digest_of_bytes(raw: bytes | memoryview) -> str:
    """The tokens digest straight from the int32-LE bytes of a ``tokens`` tensor (no list of ints:
    a Python int costs 36 bytes of memory per 4-byte token)."""
    h = xxhash.xxh3_128()
    h.update(b"tokens:int32le:")
    h.update(raw)
    return h.hexdigest()


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Tokens as int32 little-endian bytes (struct, not a Python loop: 100x faster on long
    prompts)."""
    return struct.pack(f"<{len(tokens)}i", *tokens)


def unpack_tokens(raw: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(raw) // 4}i", raw[: len(raw) // 4 * 4]))


def mlx_lm_minor() -> str:
    """'0.32' for mlx-lm 0.32.2: the cache-state layout changed between minors."""
    try:
        version = _metadata.version("mlx-lm")
    except _metadata.PackageNotFoundError:
        return "none"
    return ".".join(version.split(".")[:2])


def package_version(name: str) -> str:
    try:
        return _metadata.version(name)
    except _metadata.PackageNotFoundError:
        return "none"


# --- file digests, cached by (inode, size, mtime_ns) ---------------------------------


def default_cache_dir() -> Path:
    """kvsnap's own cache folder: ``$KVSNAP_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvsnap``, else
    ``~/.cache/kvsnap``. A relative ``XDG_CACHE_HOME`` is ignored, as the XDG spec says."""
    if os.environ.get("KVSNAP_CACHE_DIR"):
        return Path(os.environ["KVSNAP_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvsnap"


def hash_file(path: Path, chunk_size: int = DIGEST_CHUNK) -> str:
    """xxh3-128 of the whole file, read ``chunk_size`` bytes at a time (tests shrink it; the digest
    is the same)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of bytes, got {chunk_size}")
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            h.update(chunk)
    return h.hexdigest()


# A Hugging Face cache stores LFS files (all weights) as models--ORG--NAME/blobs/<sha256 of the
# bytes>;
# small git files are named by their git blob sha1 (40 hex) and never match this.
HUB_BLOB_NAME = re.compile(r"[0-9a-f]{64}")


def hub_blob_sha256(path: Path) -> str | None:
    """The sha256 that names ``path``'s bytes when it is (a link into) a Hugging Face cache blob;
    else None."""
    real = path.resolve()
    if real.parent.name != "blobs" or not real.parent.parent.name.startswith("models--"):
        return None
    return real.name if HUB_BLOB_NAME.fullmatch(real.name) else None


def hash_file_and_sha256(path: Path, chunk_size: int = DIGEST_CHUNK) -> tuple[str, str]:
    """(xxh3-128, sha256) of the whole file in one read: the sha256 checks a blob's name once."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of bytes, got {chunk_size}")
    h, sha = xxhash.xxh3_128(), hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_size):
            h.update(chunk)
            sha.update(chunk)
    return h.hexdigest(), sha.hexdigest()


@dataclass
class DigestCache:
    """Remembers file digests so a server start does not re-hash gigabytes of weights.

    An entry is reused only while the file's inode, size and mtime_ns are unchanged.
    Hugging Face cache blobs are also remembered by their name (the sha256 of their bytes,
    checked when first hashed), so a new copy of the same cache (another machine, an image
    layer, a re-download) needs no re-hash either: see docs/format.md.
    """

    path: Path | None = None
    hits: int = 0
    misses: int = 0
    blob_hits: int = 0
    chunk_size: int = DIGEST_CHUNK
    _entries: dict = field(default_factory=dict)
    _loaded: bool = False

    def _load(self) -> None:
        if self._loaded or self.path is None:
            return
        self._loaded = True
        try:
            self._entries = json.loads(self.path.read_text())
            if not isinstance(self._entries, dict):
                self._entries = {}
        except FileNotFoundError:
            self._entries = {}
        except (OSError, ValueError):
            self._entries = {}  # a damaged cache only costs a re-hash

    def _save(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd, tmp = tempfile.mkstemp(prefix=".digests.", dir=self.path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump(self._entries, f)
            os.replace(tmp, self.path)
        except OSError:
            pass  # read-only home: digests are recomputed next time, nothing is lost

    def digest(self, path: Path) -> str:
        self._load()
        st = path.stat()
        stamp = [st.st_ino, st.st_size, st.st_mtime_ns]
        real = str(path.resolve())
        entry = self._entries.get(real)
        if (
            isinstance(entry, dict)
            and entry.get("stamp") == stamp
            and isinstance(entry.get("digest"), str)
        ):
            self.hits += 1
            return entry["digest"]
        blob = hub_blob_sha256(path)
        known = self._entries.get(f"sha256:{blob}") if blob else None
        if (
            isinstance(known, dict)
            and known.get("size") == st.st_size
            and isinstance(known.get("digest"), str)
        ):
            self.blob_hits += 1
            value = known["digest"]
        elif blob:
            self.misses += 1
            value, sha256 = hash_file_and_sha256(path, self.chunk_size)
            if sha256 == blob:  # only bytes that really are the named blob teach the name
                self._entries[f"sha256:{blob}"] = {"size": st.st_size, "digest": value}
        else:
            self.misses += 1
            value = hash_file(path, self.chunk_size)
        self._entries[real] = {"stamp": stamp, "digest": value}
        self._save()
        return value


def weight_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("model*.safetensors")) or sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelError(
            f"{model_dir}: no *.safetensors weight files; give an mlx-lm model directory (convert "
            f"with mlx_lm.convert)"
        )
    return files


def weights_digest(model_dir: Path, cache: DigestCache | None = None) -> str:
    cache = cache or DigestCache()
    h = xxhash.xxh3_128()
    for f in weight_files(model_dir):
        h.update(f.name.encode() + b"\0" + cache.digest(f).encode() + b"\0")
    return h.hexdigest()


def tokenizer_digest(model_dir: Path) -> str:
    h = xxhash.xxh3_128()
    for name in TOKENIZER_FILES:
        p = model_dir / name
        if p.is_file():
            h.update(name.encode() + b"\0" + hash_file(p).encode() + b"\0")
    return h.hexdigest()


def read_config(model_dir: Path) -> dict:
    try:
        return json.loads((model_dir / "config.json").read_text())
    except FileNotFoundError:
        raise ModelError(f"{model_dir}: no config.json; give an mlx-lm model directory") from None
    except (OSError, ValueError) as exc:
        raise ModelError(
            f"{model_dir}/config.json cannot be read ({exc}); fix or re-download the model"
        ) from None


# --- identities ---------------------------------------------------------------------


@dataclass(frozen=True)
class KVSettings:
    """How the server will build its KV cache; build must use the same."""

    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = 0
    max_kv_size: int | None = None
    prefill_step_size: int = DEFAULT_PREFILL_STEP  # recorded, not keyed: only float noise


@dataclass(frozen=True)
class ModelIdentity:
    """Everything about a model that changes its KV bytes beyond float noise."""

    weights: str
    config: str
    tokenizer: str
    quantization: str
    kv_dtype: str
    kv_bits: int | None
    kv_group_size: int | None
    quantized_kv_start: int | None
    max_kv_size: int | None
    layout: tuple[str, ...]
    codec_version: int = CODEC_FORMAT_VERSION
    mlx_lm_minor: str = field(default_factory=mlx_lm_minor)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["layout"] = list(self.layout)
        return d

    @cached_property
    def digest(self) -> str:
        # once per identity: a start with 1,000 agents asked for it ~5 times per agent, at
        # ~40 us each (asdict copies every field): 0.2 ms of each agent's CPU at start
        return hexdigest(canonical_json(self.as_dict()).encode())

    @classmethod
    def from_dict(cls, d: dict) -> "ModelIdentity":
        d = dict(d)
        d["layout"] = tuple(d["layout"])
        return cls(**d)


def model_identity(
    model_dir: Path,
    kv_dtype: str,
    layout: Iterable[str],
    settings: KVSettings,
    cache: DigestCache | None = None,
) -> ModelIdentity:
    config = read_config(model_dir)
    quant = config.get("quantization") or config.get("quantization_config") or {}
    quantized_kv = settings.kv_bits is not None
    return ModelIdentity(
        weights=weights_digest(model_dir, cache),
        config=hexdigest(canonical_json(config).encode()),
        tokenizer=tokenizer_digest(model_dir),
        quantization=canonical_json(quant),
        kv_dtype=kv_dtype,
        kv_bits=settings.kv_bits,
        # Group size and start only matter when the KV is quantized.
        kv_group_size=settings.kv_group_size if quantized_kv else None,
        quantized_kv_start=settings.quantized_kv_start if quantized_kv else None,
        max_kv_size=settings.max_kv_size,
        layout=tuple(layout),
    )


def prompt_identity(
    template: str,
    chat_template_kwargs: dict | None,
    tools: Sequence[dict] | None,
    tokenization: dict | None = None,
) -> str:
    """Digest of what renders the messages: the resolved template, its kwargs and the tools.

    ``tokenization``: another server's request path (``Tokenization.descriptor()``);
    None, kvsnap's own, leaves the digest exactly as it always was.
    """
    fields: dict = {
        "template": template,
        "kwargs": chat_template_kwargs or {},
        "tools": list(tools or []),
    }
    if tokenization is not None:
        fields["tokenization"] = tokenization
    return hexdigest(canonical_json(fields).encode())


def snapshot_key(model: ModelIdentity, prompt_digest: str, tokens: Sequence[int]) -> str:
    """The content address of one snapshot: its file name is ``format.snapshot_filename(key)``."""
    return key_from_digests(model.digest, prompt_digest, tokens_digest(tokens), len(tokens))


def key_from_digests(
    model_digest: str, prompt_digest: str, tokens_digest: str, n_tokens: int
) -> str:
    """The key formula, from digests alone: what a reader recomputes from a header."""
    return hexdigest(
        f"kvsnap-key-v{CODEC_FORMAT_VERSION}|{model_digest}|{prompt_digest}|"
        f"{tokens_digest}|{n_tokens}".encode()
    )
