"""Snapshot stores as OCI artifacts: the ``oci://`` backend of :mod:`kvsnap.store.remote`.

A store is pushed as one OCI image manifest (``artifactType`` ``application/vnd.kvsnap.store.v1``,
the empty config) whose layers are its files, one blob each, content-addressed by sha256
and named by the ``org.opencontainers.image.title`` annotation (``manifest.json``,
``snapshots/<key>.safetensors``, ``blocks/<key>.safetensors``, ``checkpoints/<key>.safetensors``).
A blob the registry already has (HEAD) is not uploaded
again; a pull downloads only the files the folder lacks.

- ``reference``: ``oci://[USER:PASSWORD@]HOST[:PORT]/REPO:TAG`` parsing, display, cache folder
- ``credentials``: environment, docker config, credential helpers (never printed)
- ``client``: the distribution-API calls over httpx, with Basic and Bearer-token auth
- ``artifact``: the image manifest written and read back
- ``upload`` (push) and ``download`` (pull, and ``fetch``: what ``serve --kv-snapshots oci://…``
starts from)

The protocol is kvsnap's own, not the ``oras`` SDK's: docs/deploy.md says which checked
property ``oras`` would lose. No mlx here.
"""

from kvsnap.store.oci.artifact import (
    ARTIFACT_TYPE,
    EMPTY_CONFIG,
    OCI_MANIFEST,
    TITLE,
    Layer,
    artifact_manifest,
    parse_artifact,
)
from kvsnap.store.oci.client import RegistryClient
from kvsnap.store.oci.credentials import Credentials, find_credentials
from kvsnap.store.oci.download import PullReport, fetch, pull
from kvsnap.store.oci.errors import (
    ArtifactNotFoundError,
    CredentialError,
    DigestMismatchError,
    RegistryAuthError,
    RegistryError,
    RegistryUnreachableError,
)
from kvsnap.store.oci.reference import Reference
from kvsnap.store.oci.upload import BytesOpener, PushReport, push
from kvsnap.store.remote import redact

__all__ = [
    "ARTIFACT_TYPE",
    "EMPTY_CONFIG",
    "OCI_MANIFEST",
    "TITLE",
    "Layer",
    "artifact_manifest",
    "parse_artifact",
    "RegistryClient",
    "Credentials",
    "find_credentials",
    "ArtifactNotFoundError",
    "CredentialError",
    "DigestMismatchError",
    "RegistryAuthError",
    "RegistryError",
    "RegistryUnreachableError",
    "PullReport",
    "fetch",
    "pull",
    "BytesOpener",
    "PushReport",
    "push",
    "Reference",
    "redact",
]
