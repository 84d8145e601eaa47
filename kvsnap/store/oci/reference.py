"""``oci://[USER:PASSWORD@]HOST[:PORT]/REPO:TAG`` (or ``@sha256:…``): parsing, display and cache
folder.

A reference never shows its user info: ``str`` and ``repr`` write ``***@``, and a bad
reference is quoted in that redacted form.
"""

from __future__ import annotations

import ipaddress
import os
import re
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from kvsnap.errors import UsageError
from kvsnap.key import default_cache_dir
from kvsnap.store.oci.credentials import ENV_PASSWORD, ENV_USER, Credentials
from kvsnap.store.remote import redact

SCHEME = "oci://"
USAGE = "give oci://HOST[:PORT]/REPO:TAG, e.g. oci://registry.example.com/team/snaps:v1"
DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
REPO_RE = re.compile(
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
)
TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
HOST_RE = re.compile(
    r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)(?::[0-9]{1,5})?"
)
ENV_PLAIN_HTTP = "KVSNAP_REGISTRY_PLAIN_HTTP"


def _split_userinfo(rest: str) -> tuple[str | None, str]:
    """(user info or None, the rest); user info ends at the last @ that is not a digest's
    ``@sha256:`` (a password may hold / or @)."""
    digest_at = rest.rfind("@sha256:")
    userinfo_at = max((i for i, ch in enumerate(rest) if ch == "@" and i != digest_at), default=-1)
    return (rest[:userinfo_at], rest[userinfo_at + 1 :]) if userinfo_at >= 0 else (None, rest)


def _userinfo_credentials(userinfo: str, shown: str) -> Credentials:
    user, _, password = userinfo.partition(":")
    if not user:
        raise UsageError(
            f"{shown!r}: the user info before @ has no user name; give "
            f"oci://USER:PASSWORD@HOST/REPO:TAG, or set {ENV_USER} and {ENV_PASSWORD}"
        )
    return Credentials(
        urllib.parse.unquote(user),
        urllib.parse.unquote(password),
        "the user:password in the reference",
    )


def _split_name(path: str, shown: str) -> tuple[str, str | None, str | None]:
    """(repository, tag, digest) of ``REPO:TAG`` or ``REPO@sha256:…``, each checked."""
    digest = tag = None
    if "@" in path:
        path, _, digest = path.partition("@")
        if not DIGEST_RE.fullmatch(digest):
            raise UsageError(
                f"{shown!r}: {digest!r} is not a sha256 digest (sha256: and 64 hex digits); {USAGE}"
            )
    else:
        slash, colon = path.rfind("/"), path.rfind(":")
        if colon > slash:
            path, tag = path[:colon], path[colon + 1 :]
            if not TAG_RE.fullmatch(tag):
                raise UsageError(
                    f"{shown!r}: {tag!r} is not a valid tag (letters, digits, _ . -, at most 128); "
                    f"{USAGE}"
                )
    if not path or not REPO_RE.fullmatch(path):
        raise UsageError(
            f"{shown!r}: {path!r} is not a repository name (lowercase letters, digits, . _ - and "
            f"/); {USAGE}"
        )
    if tag is None and digest is None:
        raise UsageError(f"{shown!r} has no tag; {USAGE}")
    return path, tag, digest


@dataclass(frozen=True)
class Reference:
    host: str  # HOST[:PORT]
    repo: str
    tag: str | None = None
    digest: str | None = None
    # from oci://USER:PASSWORD@HOST/…
    credentials: Credentials | None = field(default=None, compare=False, repr=False)

    @classmethod
    def parse(cls, text: str) -> "Reference":
        if not isinstance(text, str) or not text.startswith(SCHEME):
            shown = redact(text) if isinstance(text, str) else text
            raise UsageError(f"{shown!r} is not an OCI reference; {USAGE}")
        userinfo, rest = _split_userinfo(text[len(SCHEME) :])
        # from here on only this redacted form is quoted
        shown = SCHEME + ("***@" if userinfo is not None else "") + rest
        host, _, path = rest.partition("/")
        credentials = _userinfo_credentials(userinfo, shown) if userinfo is not None else None
        if not host or not HOST_RE.fullmatch(host):
            raise UsageError(f"{shown!r}: {host!r} is not a registry host; {USAGE}")
        repo, tag, digest = _split_name(path, shown)
        return cls(host=host, repo=repo, tag=tag, digest=digest, credentials=credentials)

    @property
    def reference(self) -> str:
        return self.digest or self.tag or ""

    def __str__(self) -> str:
        userinfo = "***@" if self.credentials is not None else ""
        return f"{SCHEME}{userinfo}{self.host}/{self.repo}" + (
            f"@{self.digest}" if self.digest else f":{self.tag}"
        )

    def __repr__(self) -> str:
        return f"Reference({str(self)!r})"

    def cache_dir(self, base: Path | None = None) -> Path:
        """``<cache>/oci/<host>/<repo>/<tag>`` (``:`` in host and digest written ``_``)."""
        base = base if base is not None else default_cache_dir() / "oci"
        return (
            base
            / self.host.replace(":", "_").strip("[]")
            / self.repo
            / self.reference.replace(":", "_")
        )


def as_reference(ref: "Reference | str") -> Reference:
    return ref if isinstance(ref, Reference) else Reference.parse(ref)


def default_plain_http(host: str) -> bool:
    """Plain HTTP for a loopback registry (as docker does) or when
    ``$KVSNAP_REGISTRY_PLAIN_HTTP=1``."""
    if os.environ.get(ENV_PLAIN_HTTP, "").strip().lower() in ("1", "true", "yes"):
        return True
    name = host.rsplit(":", 1)[0] if not host.startswith("[") else host[1 : host.index("]")]
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
