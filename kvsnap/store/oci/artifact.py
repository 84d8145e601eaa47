"""The OCI image manifest a store is pushed as, written and read back (an untrusted document).

``artifactType`` ``application/vnd.kvsnap.store.v1``, the empty config, and one layer per
store file, content-addressed by sha256 and named by the ``org.opencontainers.image.title``
annotation (``manifest.json``, ``snapshots/<key>.safetensors``, ``blocks/<key>.safetensors``,
``checkpoints/<key>.safetensors``). Compact JSON: about 230 bytes a layer, so a 4 MiB
registry limit holds about 18,000 files -- 1,000 agents sharing a preamble are ~3,000
(docs/format.md, "Shipping blocks").
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from kvsnap import __version__
from kvsnap.errors import UsageError
from kvsnap.snapshot.format import (  # named after the format versions
    ARTIFACT_TYPE,
    BLOCK_MEDIA_TYPE,
    MANIFEST_MEDIA_TYPE,
    PART_REL_RE,
    SNAPSHOT_MEDIA_TYPE,
)
from kvsnap.store.local import MANIFEST
from kvsnap.store.manifest import MAX_MANIFEST_BYTES as MAX_STORE_MANIFEST_BYTES
from kvsnap.store.oci.errors import RegistryError
from kvsnap.store.oci.reference import DIGEST_RE, Reference
from kvsnap.store.shipping import ShipError, check_relpath

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
EMPTY_JSON = b"{}"
EMPTY_CONFIG = {
    "mediaType": "application/vnd.oci.empty.v1+json",
    "digest": "sha256:" + hashlib.sha256(EMPTY_JSON).hexdigest(),
    "size": len(EMPTY_JSON),
}
TITLE = "org.opencontainers.image.title"
MAX_MANIFEST_BYTES = 4 << 20
MAX_BLOB_BYTES = 64 << 30  # one store file; a 2,048-token fp32 snapshot of a 0.6B model is 470 MB
ENV_MAX_BLOB = "KVSNAP_REGISTRY_MAX_BLOB_BYTES"


def max_blob_bytes(environ=os.environ) -> int:
    """The largest blob a pull accepts: MAX_BLOB_BYTES, or ``$KVSNAP_REGISTRY_MAX_BLOB_BYTES``."""
    text = environ.get(ENV_MAX_BLOB, "").strip()
    if not text:
        return MAX_BLOB_BYTES
    if not text.isdigit() or int(text) <= 0:
        raise UsageError(f"${ENV_MAX_BLOB} is {text!r}; give a positive number of bytes")
    return int(text)


@dataclass
class Layer:
    relpath: str
    digest: str
    size: int


def media_type(relpath: str) -> str:
    if relpath == MANIFEST:
        return MANIFEST_MEDIA_TYPE
    return BLOCK_MEDIA_TYPE if PART_REL_RE.fullmatch(relpath) else SNAPSHOT_MEDIA_TYPE


def artifact_manifest(layers: list[Layer]) -> bytes:
    """The manifest ``push`` tags; RegistryError (nothing tagged) past the 4 MiB registries
    accept."""
    doc = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": ARTIFACT_TYPE,
        "config": EMPTY_CONFIG,
        "layers": [
            {
                "mediaType": media_type(layer.relpath),
                "digest": layer.digest,
                "size": layer.size,
                "annotations": {TITLE: layer.relpath},
            }
            for layer in layers
        ],
        # no timestamp: an unchanged store pushes the same manifest digest
        "annotations": {"io.kvsnap.version": __version__},
    }
    body = json.dumps(doc, separators=(",", ":")).encode()
    if len(body) > MAX_MANIFEST_BYTES:
        raise RegistryError(
            f"the registry manifest for {len(layers)} files would be {len(body)} bytes, over the "
            f"{MAX_MANIFEST_BYTES} registries accept; "
            "rebuild with a larger `kvsnap build --block-tokens` (fewer, larger blocks), or push "
            "the agents in several stores"
        )
    return body


def _check_kind(doc: object, ref: Reference) -> dict:
    """``doc`` as a kvsnap store manifest (not an index, not another artifact type)."""
    if not isinstance(doc, dict):
        raise RegistryError(f"{ref}: the manifest is not a JSON object; not a kvsnap store")
    media = doc.get("mediaType")
    if media == OCI_INDEX or "manifests" in doc:
        raise RegistryError(
            f"{ref} is an image index, not a kvsnap store; give the tag `kvsnap push` wrote"
        )
    config = doc["config"] if isinstance(doc.get("config"), dict) else {}
    if doc.get("artifactType") != ARTIFACT_TYPE and config.get("mediaType") != ARTIFACT_TYPE:
        kind = str(doc.get("artifactType") or config.get("mediaType") or media or "unknown")[:100]
        raise RegistryError(
            f"{ref} is not a kvsnap store (its type is {kind!r}); give a tag written by `kvsnap "
            f"push`"
        )
    return doc


def _parse_layer(layer: object, i: int, ref: Reference, max_blob: int) -> Layer:
    """One layer descriptor: a store path as its title, a sha256 digest, a size."""
    if not isinstance(layer, dict):
        raise RegistryError(f"{ref}: layer {i} is not a JSON object; not a kvsnap store")
    title = (
        (layer.get("annotations") or {}).get(TITLE)
        if isinstance(layer.get("annotations"), dict)
        else None
    )
    if not isinstance(title, str):
        raise RegistryError(f"{ref}: layer {i} has no {TITLE} annotation; not a kvsnap store")
    try:
        check_relpath(title, f"{ref}: layer {i}")
    except ShipError as exc:
        raise RegistryError(str(exc)) from None
    digest, size = layer.get("digest"), layer.get("size")
    if not isinstance(digest, str) or not DIGEST_RE.fullmatch(digest):
        raise RegistryError(
            f"{ref}: layer {title} has digest {digest!r}, not a sha256 digest; refusing it"
        )
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise RegistryError(f"{ref}: layer {title} has size {size!r}; refusing it")
    # Declared sizes bound what a pull streams: checked here, before any download.
    cap, why = (
        (MAX_STORE_MANIFEST_BYTES, "the limit for a store manifest")
        if title == MANIFEST
        else (max_blob, f"the blob limit (${ENV_MAX_BLOB} raises it)")
    )
    if size > cap:
        raise RegistryError(
            f"{ref}: layer {title} declares {size} bytes, over {cap}, {why}; refusing it before "
            f"downloading anything"
        )
    return Layer(title, digest, size)


def parse_artifact(body: bytes, ref: Reference, max_blob: int | None = None) -> list[Layer]:
    """The layers of a kvsnap store manifest, each with a checked digest, size (bounded) and store
    path."""
    max_blob = max_blob_bytes() if max_blob is None else max_blob
    try:
        doc = _check_kind(json.loads(body), ref)
    except ValueError:
        raise RegistryError(f"{ref}: the manifest is not JSON; not a kvsnap store") from None
    raw_layers = doc.get("layers")
    if not isinstance(raw_layers, list) or not raw_layers:
        raise RegistryError(f"{ref}: the manifest lists no files; push the store again")
    layers: list[Layer] = []
    seen: set[str] = set()
    for i, raw in enumerate(raw_layers):
        layer = _parse_layer(raw, i, ref, max_blob)
        if layer.relpath in seen:
            raise RegistryError(f"{ref}: {layer.relpath} is listed twice; refusing it")
        seen.add(layer.relpath)
        layers.append(layer)
    return layers
