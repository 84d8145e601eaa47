"""Remote stores behind one seam: a URL scheme names the module that ships a store there.

``--kv-snapshots``, ``kvsnap push`` and ``kvsnap pull`` go through this module only. A value
without ``SCHEME://`` is a local folder and stays as it is; ``oci://…`` is handled by
:mod:`kvsnap.store.oci`. A backend module is imported only when its scheme is used, so
``kvsnap ls`` and ``--help`` never load an HTTP client.

A backend module provides three functions (see :class:`Backend`): ``fetch(url)`` pulls the
store into kvsnap's cache folder and returns that folder (what ``serve`` starts from);
``push(root, url, plain_http)`` and ``pull(url, dest, plain_http)`` return reports with the
fields the CLI prints. Adding ``s3://`` means one module with those functions and one row in
``BACKENDS``.

Every backend quotes a URL only through :func:`redact`: user info and tokens never reach a
message or a log.
"""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Protocol

from kvsnap.errors import UsageError

# scheme -> the module that implements it (imported lazily, on first use); read-only at run time
BACKENDS = MappingProxyType({"oci": "kvsnap.store.oci"})

SCHEME_RE = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
SECRET_PATTERNS = (
    (re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/\s@]*@"), r"\1***@"),  # scheme://user:password@
    (re.compile(r"\b(Basic|Bearer)\s+[A-Za-z0-9._~+/=-]+", re.I), r"\1 ***"),
    (
        re.compile(
            r'("?(?:secret|password|passwd|auth|token|identitytoken|access_token)"?'
            r'\s*[:=]\s*)("[^"]*"|[^\s,}]+)',
            re.I,
        ),
        r"\1***",
    ),
)


class Backend(Protocol):
    """What a module named in ``BACKENDS`` provides."""

    def fetch(self, url: str) -> Path: ...

    # report: ref, manifest_digest, uploaded, skipped, uploaded_bytes
    def push(
        self,
        root: str | os.PathLike,
        url: str,
        plain_http: bool | None = None,
        deadlines=None,
        on_bytes: Callable[[int], None] | None = None,
        on_total: Callable[[int], None] | None = None,
    ): ...

    # report: ref, dest, manifest_digest, downloaded, present, downloaded_bytes, kept
    def pull(
        self,
        url: str,
        dest: str | os.PathLike,
        plain_http: bool | None = None,
        deadlines=None,
        on_bytes: Callable[[int], None] | None = None,
        on_total: Callable[[int], None] | None = None,
    ): ...


def redact(text: str) -> str:
    """``text`` with anything shaped like a credential replaced by ``***`` (URL user info, auth
    headers, secret fields)."""
    for pattern, replacement in SECRET_PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def scheme_of(value: str) -> str | None:
    """The URL scheme of ``value`` in lower case, or None for a local path."""
    match = SCHEME_RE.match(value)
    return match.group(1).lower() if match else None


def known_schemes() -> str:
    return ", ".join(f"{s}://" for s in sorted(BACKENDS))


def backend_module(url: str, what: str) -> str:
    """The name of the module for ``url``'s scheme, not imported; a UsageError naming the value,
    the known schemes and the fix."""
    scheme = scheme_of(url)
    if scheme is None:
        raise UsageError(
            f"{what} {redact(url)!r} is not a remote store URL; give one of {known_schemes()}, "
            f"e.g. oci://registry.example.com/team/snaps:v1"
        )
    if scheme not in BACKENDS:
        raise UsageError(
            f"{what} {redact(url)!r}: kvsnap has no remote store backend for {scheme}:// (it knows "
            f"{known_schemes()}); "
            f"give oci://HOST[:PORT]/REPO:TAG, or a local folder (copy the store there first)"
        )
    return BACKENDS[scheme]


def backend_for(url: str, what: str) -> Backend:
    return importlib.import_module(backend_module(url, what))


def check_kv_snapshots(value: str | None) -> None:
    """Refuse an unknown scheme before anything slow runs (no backend is imported)."""
    if value and scheme_of(value) is not None:
        backend_module(value, "--kv-snapshots")


def resolve_kv_snapshots(value: str | None) -> str | None:
    """``--kv-snapshots``: a folder stays as it is; a remote URL is pulled into kvsnap's cache
    folder first, whose path is returned."""
    if not value or scheme_of(value) is None:
        return value
    return str(backend_for(value, "--kv-snapshots").fetch(value))


def push(
    root: str | os.PathLike,
    url: str,
    plain_http: bool | None = None,
    deadlines=None,
    on_bytes: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
):
    """Ship the store at ``root`` to ``url``; the backend's push report. ``deadlines``: the
    backend's per-request limits (None: its defaults and environment). ``on_total(n)``: the
    bytes to send, once known; ``on_bytes(n)``: bytes sent so far, as they go."""
    return backend_for(url, "push to").push(
        root,
        url,
        plain_http=plain_http,
        **_given(deadlines=deadlines, on_bytes=on_bytes, on_total=on_total),
    )


def pull(
    url: str,
    dest: str | os.PathLike,
    plain_http: bool | None = None,
    deadlines=None,
    on_bytes: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
):
    """Install the store at ``url`` into ``dest`` (merged, staged, verified); the backend's pull
    report. ``on_total`` / ``on_bytes``: the bytes to download, and those downloaded."""
    return backend_for(url, "pull from").pull(
        url,
        dest,
        plain_http=plain_http,
        **_given(deadlines=deadlines, on_bytes=on_bytes, on_total=on_total),
    )


def _given(**options) -> dict:
    """Only the options given: a backend without them still works with their defaults."""
    return {name: value for name, value in options.items() if value is not None}
