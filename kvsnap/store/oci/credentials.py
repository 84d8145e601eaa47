"""Registry credentials: ``$KVSNAP_REGISTRY_USER``/``PASSWORD``, else docker's config.json.

docker's config (``$DOCKER_CONFIG``, else ``~/.docker``) gives them in ``auths`` entries or
through a credential helper (``credHelpers`` per host, ``credsStore`` for all). The values
are never printed: ``Credentials`` hides them from ``repr`` and messages name only their
source. A config or helper that is configured but fails is a ``CredentialError`` naming the
file or the helper with its redacted stderr, never taken for "no credentials".
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from kvsnap.store.oci.errors import CredentialError
from kvsnap.store.remote import redact

ENV_USER, ENV_PASSWORD = "KVSNAP_REGISTRY_USER", "KVSNAP_REGISTRY_PASSWORD"
HELPER_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
HELPER_TIMEOUT_S = 30
# what docker's helpers print (exit 1) for an unknown host
HELPER_NOT_FOUND = "credentials not found"


@dataclass(frozen=True)
class Credentials:
    username: str = field(repr=False)
    password: str = field(repr=False)
    source: str = ""  # where they came from, for messages (never the values)

    def basic(self) -> str:
        return "Basic " + base64.b64encode(f"{self.username}:{self.password}".encode()).decode()


def _docker_config() -> tuple[Path, dict]:
    """docker's config.json and where it is; an absent one is empty, an unreadable one a
    CredentialError."""
    folder = os.environ.get("DOCKER_CONFIG") or os.path.join(os.path.expanduser("~"), ".docker")
    path = Path(folder) / "config.json"
    fix = f"fix it or move it away (or set {ENV_USER} and {ENV_PASSWORD}, which take precedence)"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return path, {}
    except OSError as exc:
        raise CredentialError(
            f"docker config {path} cannot be read ({exc.strerror or exc}); {fix}"
        ) from None
    except (ValueError, RecursionError) as exc:
        raise CredentialError(
            f"docker config {path} is not valid JSON ({redact(str(exc))[:200]}); {fix}"
        ) from None
    if not isinstance(data, dict):
        raise CredentialError(
            f"docker config {path} is {type(data).__name__}, not a JSON object; {fix}"
        )
    for section in ("auths", "credHelpers"):
        if section in data and not isinstance(data[section], dict):
            raise CredentialError(
                f"docker config {path}: {section} is {type(data[section]).__name__}, not an "
                f"object; {fix}"
            )
    if "credsStore" in data and not isinstance(data["credsStore"], str):
        raise CredentialError(
            f"docker config {path}: credsStore is {type(data['credsStore']).__name__}, not a "
            f"helper name; {fix}"
        )
    return path, data


def _registry_key(key: str) -> str:
    """The host of an ``auths`` key, which docker also writes as ``https://HOST/v1/``."""
    key = re.sub(r"^[a-z]+://", "", key.strip())
    return key.split("/", 1)[0]


def _helper_output(text: str) -> str:
    text = redact(" ".join(text.split()))
    return (text[:300] + "...") if len(text) > 300 else (text or "nothing")


def _run_helper(helper: object, host: str, config: Path) -> tuple[str, subprocess.CompletedProcess]:
    """``docker-credential-<helper> get`` for ``host``: its name and what it answered."""
    if not isinstance(helper, str) or not HELPER_NAME_RE.fullmatch(helper):
        raise CredentialError(
            f"docker config {config} names the credential helper {redact(repr(helper))[:80]}, not "
            f"a helper name (letters, digits, . _ -); fix the entry"
        )
    name = f"docker-credential-{helper}"
    exe = shutil.which(name)
    if not exe:
        raise CredentialError(
            f"docker config {config} names the credential helper {name} for {host}, but it is not "
            f"on PATH; install it, or remove the entry from the config"
        )
    try:
        return name, subprocess.run(
            [exe, "get"], input=host, capture_output=True, text=True, timeout=HELPER_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        raise CredentialError(
            f"credential helper {name} did not answer for {host} within {HELPER_TIMEOUT_S} s; "
            f"check it (e.g. a locked keychain)"
        ) from None
    except OSError as exc:
        raise CredentialError(
            f"credential helper {name} cannot be run ({exc.strerror or exc}); check the file at "
            f"{exe}"
        ) from None


def _cred_helper(helper: object, host: str, config: Path) -> Credentials | None:
    """Ask the helper; None only when it says it has nothing for ``host``."""
    name, out = _run_helper(helper, host, config)
    if out.returncode != 0:
        if HELPER_NOT_FOUND in (out.stdout + out.stderr).lower():
            return None
        raise CredentialError(
            f"credential helper {name} failed for {host} (exit {out.returncode}): "
            f"{_helper_output(out.stderr or out.stdout)}; fix the helper, or log in again with "
            f"`docker login {host}`"
        )
    try:
        data = json.loads(out.stdout)
    except ValueError:
        raise CredentialError(
            f"credential helper {name} answered for {host} with something that is not JSON "
            f"({_helper_output(out.stdout)}); fix the helper"
        ) from None
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("Username", ""), str)
        or not isinstance(data.get("Secret", ""), str)
    ):
        raise CredentialError(
            f"credential helper {name} answered for {host} without string Username and Secret "
            f"fields; fix the helper"
        )
    if data.get("Username") and data.get("Secret"):
        return Credentials(data["Username"], data["Secret"], name)
    return None


def _auths_entry(key: str, entry: dict, host: str, path: Path) -> Credentials | None:
    """One ``auths`` entry: ``username``/``password`` fields, or ``auth`` = base64 of
    USER:PASSWORD."""
    if entry.get("username") and entry.get("password") is not None:
        if not isinstance(entry["username"], str) or not isinstance(entry["password"], str):
            raise CredentialError(
                f"docker config {path}: auths[{key!r}] has a username or password that is not a "
                f"string; run `docker login {host}` again"
            )
        return Credentials(entry["username"], entry["password"], "docker config.json")
    if not entry.get("auth"):
        return None
    try:
        user, sep, password = base64.b64decode(entry["auth"], validate=True).decode().partition(":")
    except (ValueError, TypeError, UnicodeDecodeError):
        sep = ""
    if not sep or not user:
        raise CredentialError(
            f"docker config {path}: auths[{key!r}].auth is not base64 of USER:PASSWORD; run "
            f"`docker login {host}` again"
        )
    return Credentials(user, password, "docker config.json")


def find_credentials(host: str) -> Credentials | None:
    """``$KVSNAP_REGISTRY_USER``/``PASSWORD``, else docker's config (auths, credHelpers,
    credsStore).

    None when nothing is configured for ``host``; a CredentialError (naming the file or the
    helper, with its redacted stderr) when something is configured but fails.
    """
    user, password = os.environ.get(ENV_USER), os.environ.get(ENV_PASSWORD)
    if user and password is not None:
        return Credentials(user, password, f"${ENV_USER}/${ENV_PASSWORD}")
    path, config = _docker_config()
    for key, helper in config.get("credHelpers", {}).items():
        if _registry_key(key) == host:
            return _cred_helper(helper, host, path)
    for key, entry in config.get("auths", {}).items():
        if _registry_key(key) == host and isinstance(entry, dict):
            found = _auths_entry(key, entry, host, path)
            if found is not None:
                return found
    if "credsStore" in config:
        return _cred_helper(config["credsStore"], host, path)
    return None
