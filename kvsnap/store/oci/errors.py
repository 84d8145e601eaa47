"""What can go wrong talking to an OCI registry, one class per fix the user has to make."""

from __future__ import annotations

from kvsnap.errors import KvsnapError


class RegistryError(KvsnapError):
    """A registry that answers something kvsnap cannot use."""


class RegistryUnreachableError(RegistryError):
    """No connection to the registry (refused, DNS, TLS, timeout)."""


class RegistryAuthError(RegistryError):
    """The registry wants credentials (401) or refuses them (401/403)."""


class ArtifactNotFoundError(RegistryError):
    """No such repository, tag or blob."""


class DigestMismatchError(RegistryError):
    """Content whose sha256 or size is not what its descriptor says (tampered or corrupt)."""


class CredentialError(RegistryAuthError):
    """A docker config that cannot be read, or a credential helper that fails (named, with its
    redacted stderr)."""
