"""Persisted request prefixes ("conversations") in a store: names, the tenant tag, lookup.

A conversation record is a v3 record like an agent's, in its own folder
(``conversations/<key>.safetensors``) and with the blocks and checkpoints it reaches shared
with every other record. Its key binds the model, the tokens and the namespace's tag: the
tag is an HMAC of the namespace (API-key fingerprint + cache_salt) under a per-store secret
(``conversations/.secret``, 0600), so nothing on disk is the key or an unsalted hash of it,
and a record can only be found by a request of its own namespace. Its header also carries
its key's tenant digest (``kvsnap.tenant``, the same HMAC of the key's fingerprint alone):
the disk budget's unit, so a key's cache_salts share one fair share.

Finding one needs no index file: the folder's names are listed (cheap, at most every few
seconds) and a request's tokens are hashed once, incrementally, into the key each prefix
length would have. No mlx.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import stat
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Container, Sequence

import xxhash

from kvsnap.errors import StoreError
from kvsnap.key import hexdigest, key_from_digests, pack_tokens
from kvsnap.snapshot.format import CONVERSATIONS, KEY_RE, SECRET_NAME, SUFFIX, snapshot_filename
from kvsnap.store.fileio import (
    FILE_MODE,
    TMP_PREFIX,
    Fsync,
    default_fsync,
    fsync_dir,
    make_dirs,
    store_files,
)

SECRET_BYTES = 32
INDEX_MAX_AGE_S = 2.0  # another server's new records are seen within this long


def conversations_dir(root: Path) -> Path:
    return root / CONVERSATIONS


def record_path(root: Path, key: str) -> Path:
    if not KEY_RE.fullmatch(key):
        raise StoreError(f"conversation key {key!r} is not 32 lowercase hex digits")
    return conversations_dir(root) / snapshot_filename(key)


def conversation_files(root: Path) -> list[Path]:
    """Every conversation record (temp files excluded), sorted; StoreError when
    ``conversations/`` is a symbolic link (removing through it would reach others' files)."""
    return store_files(root, CONVERSATIONS, SUFFIX)


# --- the tenant tag ---------------------------------------------------------------------------


def store_secret(root: Path, fsync: Fsync = default_fsync) -> bytes:
    """The store's secret, created (0600) by the first writer; two servers starting at once
    agree on one (the file is linked into place, never overwritten)."""
    path = conversations_dir(root) / SECRET_NAME
    if not path.exists() and not path.is_symlink():
        make_dirs(path.parent, fsync)
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + SECRET_NAME, dir=path.parent)
        try:
            os.fchmod(fd, FILE_MODE)
            os.write(fd, secrets.token_bytes(SECRET_BYTES))
            fsync(fd)
            os.close(fd)
            with contextlib.suppress(FileExistsError):  # another writer's is the one
                os.link(tmp, path)
        finally:
            os.unlink(tmp)
        fsync_dir(path.parent, fsync)
    st = path.lstat()
    if not stat.S_ISREG(st.st_mode) or st.st_size != SECRET_BYTES or st.st_mode & 0o077:
        raise StoreError(
            f"{path} is not a {SECRET_BYTES}-byte private file (mode {stat.filemode(st.st_mode)}, "
            f"{st.st_size} bytes); delete it to start the conversations afresh (their records "
            f"then no longer match), or restore it with mode 0600"
        )
    return path.read_bytes()


def namespace_tag(secret: bytes, namespace: str) -> str:
    """What identifies a namespace on disk: an HMAC under the store's secret."""
    return hmac.new(secret, namespace.encode(), hashlib.sha256).hexdigest()[:32]


def conversation_digest(tag: str) -> str:
    """A conversation record's ``kvsnap.prompt_digest``: binds its key to the namespace."""
    return hexdigest(f"kvsnap-conversation-v1|{tag}".encode())


def namespace_tenant(namespace: str) -> str:
    """The API key's fingerprint of a namespace ("<fingerprint>/<cache_salt>"), "" without a
    key."""
    return namespace.partition("/")[0]


def tenant_digest(secret: bytes, tenant: str) -> str:
    """A conversation record's ``kvsnap.tenant``: the key's tag under the store's secret (as
    a namespace's), digested like ``conversation_digest``, so records of one key share it
    whatever their cache_salt, and nothing on disk is the key or its fingerprint. "" (no
    field) for a request without a key: there, each cache_salt is all that tells clients
    apart, and the budget's unit stays the namespace."""
    if not tenant:
        return ""
    return hexdigest(f"kvsnap-tenant-v1|{namespace_tag(secret, tenant)}".encode())


def record_key(model_digest: str, conv_digest: str, tokens_digest: str, n_tokens: int) -> str:
    return key_from_digests(model_digest, conv_digest, tokens_digest, n_tokens)


# --- lookup -----------------------------------------------------------------------------------


@dataclass
class ConversationIndex:
    """The keys in ``conversations/``, listed at start and again when older than
    ``max_age_s`` and the folder changed (another server may have written some): a stat,
    then names only. Reading a record waits for a hit."""

    root: Path
    max_age_s: float = INDEX_MAX_AGE_S
    keys: set[str] = field(default_factory=set)
    listed_at: float = float("-inf")
    folder_mtime_ns: int = -1

    def current(self) -> set[str]:
        now = time.monotonic()
        if now - self.listed_at < self.max_age_s:
            return self.keys
        self.listed_at = now
        folder = conversations_dir(self.root)
        try:
            mtime = folder.stat().st_mtime_ns
        except FileNotFoundError:
            self.keys, self.folder_mtime_ns = set(), -1
            return self.keys
        if mtime != self.folder_mtime_ns:  # 10,000 names: ~5 ms; a stat: microseconds
            self.folder_mtime_ns = mtime
            self.keys = {
                name[: -len(SUFFIX)]
                for name in os.listdir(folder)
                if name.endswith(SUFFIX) and not name.startswith(TMP_PREFIX)
            }
        return self.keys

    def forget(self) -> None:
        """List again at the next lookup (the records were removed)."""
        self.listed_at, self.folder_mtime_ns = float("-inf"), -1


def longest_persisted(
    keys: set[str],
    model_digest: str,
    conv_digest: str,
    tokens: Sequence[int],
    above: int,
    exclude: Container[str] = frozenset(),
) -> tuple[int, str] | None:
    """(n, key) of the longest record among ``keys`` (and not in ``exclude``) holding
    ``tokens[:n]`` for some ``above < n < len(tokens)`` (one token is always left to
    compute), or None.

    One pass: the tokens digest of every prefix comes from one incremental hash (the bytes
    ``key.tokens_digest`` hashes), so a long prompt costs a few microseconds per new token."""
    if not keys or len(tokens) - 1 <= above:
        return None
    packed = pack_tokens(tokens[: len(tokens) - 1])
    h = xxhash.xxh3_128()
    h.update(b"tokens:int32le:")
    h.update(packed[: 4 * above])
    best = None
    for n in range(above + 1, len(tokens)):
        h.update(packed[4 * (n - 1) : 4 * n])
        key = key_from_digests(model_digest, conv_digest, h.hexdigest(), n)
        if key in keys and key not in exclude:
            best = (n, key)
    return best


def touch(path: Path) -> None:
    """Record a use: a record's mtime is its last use (budget eviction and ``gc`` read it)."""
    with contextlib.suppress(FileNotFoundError):  # evicted meanwhile: nothing to record
        os.utime(path)


def read_parts(info) -> list[tuple[str, str]]:
    """(kind, key) of the parts a load of the record ``info`` reads: every block, and its
    checkpoint at the end (a persisted record names no other)."""
    from kvsnap.snapshot.format import BLOCK_KIND, CHECKPOINT_KIND

    chain = info.chain
    if chain is None:
        return []
    return [(BLOCK_KIND, key) for key, _, _ in chain.blocks] + [
        (CHECKPOINT_KIND, key) for key, end in chain.checkpoints if end == info.n_tokens
    ]
