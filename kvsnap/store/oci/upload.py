"""``kvsnap push``: verify the store, upload only the blobs the registry lacks (HEADs in parallel
first), then tag the manifest."""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from functools import partial
from typing import BinaryIO, Callable, ContextManager

import httpx

from kvsnap.errors import UsageError
from kvsnap.store.oci.artifact import EMPTY_CONFIG, EMPTY_JSON, Layer, artifact_manifest
from kvsnap.store.oci.client import RegistryClient
from kvsnap.store.oci.credentials import Credentials
from kvsnap.store.oci.deadlines import Deadlines
from kvsnap.store.oci.reference import Reference, as_reference
from kvsnap.store.shipping import collect_store, open_checked, sha256_file


@dataclass
class PushReport:
    ref: Reference
    manifest_digest: str
    uploaded: list[str] = field(default_factory=list)  # relpaths (and "config") sent
    skipped: list[str] = field(default_factory=list)  # already in the registry
    uploaded_bytes: int = 0


class BytesOpener:
    """An in-memory blob with the context-manager shape of ``open_checked`` (the empty config)."""

    def __init__(self, data: bytes):
        self.data = data

    def __enter__(self) -> BinaryIO:
        return io.BytesIO(self.data)

    def __exit__(self, *exc) -> None:
        return None


def push(
    root: str | os.PathLike,
    ref: Reference | str,
    plain_http: bool | None = None,
    credentials: Credentials | None | bool = True,
    transport: httpx.BaseTransport | None = None,
    deadlines: Deadlines | None = None,
    on_bytes: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> PushReport:
    """Verify the store, upload the blobs the registry lacks, then tag the manifest.

    ``on_total(n)`` once the registry has said which blobs it lacks (the bytes to upload);
    ``on_bytes(n)`` as they go: its sum is ``uploaded_bytes``."""
    ref = as_reference(ref)
    if not ref.tag:
        raise UsageError(f"{ref}: push needs a tag (oci://HOST/REPO:TAG), not a digest")
    files = collect_store(root)
    layers = []
    for f in files:
        with open_checked(f):
            layers.append(Layer(f.relpath, sha256_file(f.path), f.size))
    by_path = {f.relpath: f for f in files}
    manifest = artifact_manifest(layers)  # too large for a registry: refused before any upload
    report = PushReport(ref, "")
    with RegistryClient(
        ref, plain_http, credentials, push=True, transport=transport, deadlines=deadlines
    ) as client:
        config_blob = (
            "config",
            str(EMPTY_CONFIG["digest"]),
            len(EMPTY_JSON),
            lambda: BytesOpener(EMPTY_JSON),
        )
        blobs: list[tuple[str, str, int, Callable[[], ContextManager[BinaryIO]]]] = [config_blob]
        blobs += [
            (layer.relpath, layer.digest, layer.size, partial(open_checked, by_path[layer.relpath]))
            for layer in layers
        ]
        seen: set[str] = set()
        # in parallel: only what is missing goes up
        present = client.blobs_exist([digest for _, digest, _, _ in blobs])
        missing = {digest: size for _, digest, size, _ in blobs if not present[digest]}
        if on_total is not None:
            on_total(sum(missing.values()))
        for name, digest, size, opener in blobs:
            if digest in seen or present[digest]:
                report.skipped.append(name)
            else:
                client.upload_blob(digest, size, opener, on_bytes)
                report.uploaded.append(name)
                report.uploaded_bytes += size
            seen.add(digest)
        report.manifest_digest = client.put_manifest(ref.tag, manifest)
    return report
