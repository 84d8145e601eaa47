"""Snapshot stores as OCI artifacts: ``kvsnap push`` / ``pull`` and ``serve --kv-snapshots oci://…``.

A store is pushed as one OCI image manifest (``artifactType`` ``application/vnd.kvsnap.store.v1``,
the empty config) whose layers are its files, one blob each, content-addressed by sha256
and named by the ``org.opencontainers.image.title`` annotation (``manifest.json``,
``snapshots/<key>.safetensors``). A blob the registry already has (HEAD) is not uploaded
again; a pull downloads only the files the folder lacks.

The protocol is the registry HTTP API of the OCI distribution spec over httpx, and only
the calls this needs: HEAD/GET a blob, a monolithic blob upload (POST, then PUT with
``?digest=``), PUT/GET a manifest; auth by the ``WWW-Authenticate`` challenge (Basic, or
the Bearer token flow). Credentials: ``user:password@`` in the reference, else
``$KVSNAP_REGISTRY_USER``/``$KVSNAP_REGISTRY_PASSWORD``, else ``~/.docker/config.json``
(``$DOCKER_CONFIG``): ``auths`` entries or a credential helper. They are never printed: a
reference shows its user info as ``***``, and every message that could quote one (a bad
reference, a credential helper's stderr) goes through ``redact``. A docker config or
credential helper that fails is reported with the helper's name and its (redacted)
stderr, never taken for "no credentials".

No mlx here.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import logging
import os
import re
import shutil
import subprocess
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable

import httpx

from kvsnap import __version__
from kvsnap.store.archive import CHUNK, ShipError, StagedInstall, check_destination, check_relpath, collect_store, open_checked, present_with_digest, sha256_file
from kvsnap.errors import KvsnapError, ManifestError, SnapshotError, UsageError
from kvsnap.key import default_cache_dir
from kvsnap.store.manifest import read_manifest_file
from kvsnap.store.local import MANIFEST, Store

log = logging.getLogger("kvsnap")

from kvsnap.snapshot.format import ARTIFACT_TYPE, MANIFEST_MEDIA_TYPE, SNAPSHOT_MEDIA_TYPE  # noqa: E402  (named after the format versions)
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
EMPTY_JSON = b"{}"
EMPTY_CONFIG = {"mediaType": "application/vnd.oci.empty.v1+json", "digest": "sha256:" + hashlib.sha256(EMPTY_JSON).hexdigest(), "size": len(EMPTY_JSON)}
TITLE = "org.opencontainers.image.title"
MAX_MANIFEST_BYTES = 4 << 20
DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")
REPO_RE = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*")
TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
HOST_RE = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)(?::[0-9]{1,5})?")
ENV_USER, ENV_PASSWORD, ENV_PLAIN_HTTP = "KVSNAP_REGISTRY_USER", "KVSNAP_REGISTRY_PASSWORD", "KVSNAP_REGISTRY_PLAIN_HTTP"
HELPER_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
HELPER_TIMEOUT_S = 30
HELPER_NOT_FOUND = "credentials not found"  # what docker's helpers print (exit 1) for an unknown host
SECRET_PATTERNS = (
    (re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/\s@]*@"), r"\1***@"),  # scheme://user:password@
    (re.compile(r"\b(Basic|Bearer)\s+[A-Za-z0-9._~+/=-]+", re.I), r"\1 ***"),
    (re.compile(r'("?(?:secret|password|passwd|auth|token|identitytoken|access_token)"?\s*[:=]\s*)("[^"]*"|[^\s,}]+)', re.I), r"\1***"),
)
TIMEOUT = httpx.Timeout(60.0, connect=10.0)


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
    """A docker config that cannot be read, or a credential helper that fails (named, with its redacted stderr)."""


def redact(text: str) -> str:
    """``text`` with anything shaped like a credential replaced by ``***`` (URL user info, auth headers, secret fields)."""
    for pattern, replacement in SECRET_PATTERNS:
        text = pattern.sub(replacement, text)
    return text


# --- credentials --------------------------------------------------------------------------


@dataclass(frozen=True)
class Credentials:
    username: str = field(repr=False)
    password: str = field(repr=False)
    source: str = ""  # where they came from, for messages (never the values)

    def basic(self) -> str:
        return "Basic " + base64.b64encode(f"{self.username}:{self.password}".encode()).decode()


# --- references ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Reference:
    host: str  # HOST[:PORT]
    repo: str
    tag: str | None = None
    digest: str | None = None
    credentials: Credentials | None = field(default=None, compare=False, repr=False)  # from oci://USER:PASSWORD@HOST/…

    @classmethod
    def parse(cls, text: str) -> "Reference":
        usage = "give oci://HOST[:PORT]/REPO:TAG, e.g. oci://registry.example.com/team/snaps:v1"
        if not isinstance(text, str) or not text.startswith("oci://"):
            shown = redact(text) if isinstance(text, str) else text
            raise UsageError(f"{shown!r} is not an OCI reference; {usage}")
        rest = text[len("oci://") :]
        # User info ends at the last @ that is not a digest's "@sha256:" (a password may hold / or @).
        digest_at = rest.rfind("@sha256:")
        userinfo_at = max((i for i, ch in enumerate(rest) if ch == "@" and i != digest_at), default=-1)
        userinfo, rest = (rest[:userinfo_at], rest[userinfo_at + 1 :]) if userinfo_at >= 0 else ("", rest)
        text = "oci://" + ("***@" if userinfo_at >= 0 else "") + rest  # from here on only this redacted form is quoted
        host, _, path = rest.partition("/")
        credentials = None
        if userinfo_at >= 0:
            user, _, password = userinfo.partition(":")
            if not user:
                raise UsageError(f"{text!r}: the user info before @ has no user name; give oci://USER:PASSWORD@HOST/REPO:TAG, or set {ENV_USER} and {ENV_PASSWORD}")
            credentials = Credentials(urllib.parse.unquote(user), urllib.parse.unquote(password), "the user:password in the reference")
        if not host or not HOST_RE.fullmatch(host):
            raise UsageError(f"{text!r}: {host!r} is not a registry host; {usage}")
        digest = tag = None
        if "@" in path:
            path, _, digest = path.partition("@")
            if not DIGEST_RE.fullmatch(digest):
                raise UsageError(f"{text!r}: {digest!r} is not a sha256 digest (sha256: and 64 hex digits); {usage}")
        else:
            slash = path.rfind("/")
            colon = path.rfind(":")
            if colon > slash:
                path, tag = path[:colon], path[colon + 1 :]
                if not TAG_RE.fullmatch(tag):
                    raise UsageError(f"{text!r}: {tag!r} is not a valid tag (letters, digits, _ . -, at most 128); {usage}")
        if not path or not REPO_RE.fullmatch(path):
            raise UsageError(f"{text!r}: {path!r} is not a repository name (lowercase letters, digits, . _ - and /); {usage}")
        if tag is None and digest is None:
            raise UsageError(f"{text!r} has no tag; {usage}")
        return cls(host=host, repo=path, tag=tag, digest=digest, credentials=credentials)

    @property
    def reference(self) -> str:
        return self.digest or self.tag or ""

    def __str__(self) -> str:
        userinfo = "***@" if self.credentials is not None else ""
        return f"oci://{userinfo}{self.host}/{self.repo}" + (f"@{self.digest}" if self.digest else f":{self.tag}")

    def __repr__(self) -> str:
        return f"Reference({str(self)!r})"

    def cache_dir(self, base: Path | None = None) -> Path:
        """``<cache>/oci/<host>/<repo>/<tag>`` (``:`` in host and digest written ``_``)."""
        base = base if base is not None else default_cache_dir() / "oci"
        return base / self.host.replace(":", "_").strip("[]") / self.repo / self.reference.replace(":", "_")


def default_plain_http(host: str) -> bool:
    """Plain HTTP for a loopback registry (as docker does) or when ``$KVSNAP_REGISTRY_PLAIN_HTTP=1``."""
    if os.environ.get(ENV_PLAIN_HTTP, "").strip().lower() in ("1", "true", "yes"):
        return True
    name = host.rsplit(":", 1)[0] if not host.startswith("[") else host[1 : host.index("]")]
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


# --- credentials from the environment and docker's config ----------------------------------


def _docker_config() -> tuple[Path, dict]:
    """docker's config.json and where it is; an absent one is empty, an unreadable one a CredentialError."""
    folder = os.environ.get("DOCKER_CONFIG") or os.path.join(os.path.expanduser("~"), ".docker")
    path = Path(folder) / "config.json"
    fix = f"fix it or move it away (or set {ENV_USER} and {ENV_PASSWORD}, which take precedence)"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return path, {}
    except OSError as exc:
        raise CredentialError(f"docker config {path} cannot be read ({exc.strerror or exc}); {fix}") from None
    except (ValueError, RecursionError) as exc:
        raise CredentialError(f"docker config {path} is not valid JSON ({redact(str(exc))[:200]}); {fix}") from None
    if not isinstance(data, dict):
        raise CredentialError(f"docker config {path} is {type(data).__name__}, not a JSON object; {fix}")
    for section in ("auths", "credHelpers"):
        if section in data and not isinstance(data[section], dict):
            raise CredentialError(f"docker config {path}: {section} is {type(data[section]).__name__}, not an object; {fix}")
    if "credsStore" in data and not isinstance(data["credsStore"], str):
        raise CredentialError(f"docker config {path}: credsStore is {type(data['credsStore']).__name__}, not a helper name; {fix}")
    return path, data


def _registry_key(key: str) -> str:
    key = re.sub(r"^[a-z]+://", "", key.strip())
    return key.split("/", 1)[0]


def _helper_output(text: str) -> str:
    text = redact(" ".join(text.split()))
    return (text[:300] + "...") if len(text) > 300 else (text or "nothing")


def _cred_helper(helper: object, host: str, config: Path) -> Credentials | None:
    """Ask ``docker-credential-<helper> get``; None only when it says it has nothing for ``host``."""
    if not isinstance(helper, str) or not HELPER_NAME_RE.fullmatch(helper):
        raise CredentialError(f"docker config {config} names the credential helper {redact(repr(helper))[:80]}, not a helper name (letters, digits, . _ -); fix the entry")
    name = f"docker-credential-{helper}"
    exe = shutil.which(name)
    if not exe:
        raise CredentialError(f"docker config {config} names the credential helper {name} for {host}, but it is not on PATH; install it, or remove the entry from the config")
    try:
        out = subprocess.run([exe, "get"], input=host, capture_output=True, text=True, timeout=HELPER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise CredentialError(f"credential helper {name} did not answer for {host} within {HELPER_TIMEOUT_S} s; check it (e.g. a locked keychain)") from None
    except OSError as exc:
        raise CredentialError(f"credential helper {name} cannot be run ({exc.strerror or exc}); check the file at {exe}") from None
    if out.returncode != 0:
        if HELPER_NOT_FOUND in (out.stdout + out.stderr).lower():
            return None
        raise CredentialError(f"credential helper {name} failed for {host} (exit {out.returncode}): {_helper_output(out.stderr or out.stdout)}; fix the helper, or log in again with `docker login {host}`")
    try:
        data = json.loads(out.stdout)
    except ValueError:
        raise CredentialError(f"credential helper {name} answered for {host} with something that is not JSON ({_helper_output(out.stdout)}); fix the helper") from None
    if not isinstance(data, dict) or not isinstance(data.get("Username", ""), str) or not isinstance(data.get("Secret", ""), str):
        raise CredentialError(f"credential helper {name} answered for {host} without string Username and Secret fields; fix the helper")
    if data.get("Username") and data.get("Secret"):
        return Credentials(data["Username"], data["Secret"], name)
    return None


def find_credentials(host: str) -> Credentials | None:
    """``$KVSNAP_REGISTRY_USER``/``PASSWORD``, else docker's config (auths, credHelpers, credsStore).

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
        if _registry_key(key) != host or not isinstance(entry, dict):
            continue
        if entry.get("username") and entry.get("password") is not None:
            if not isinstance(entry["username"], str) or not isinstance(entry["password"], str):
                raise CredentialError(f"docker config {path}: auths[{key!r}] has a username or password that is not a string; run `docker login {host}` again")
            return Credentials(entry["username"], entry["password"], "docker config.json")
        if entry.get("auth"):
            try:
                user, sep, password = base64.b64decode(entry["auth"], validate=True).decode().partition(":")
            except (ValueError, TypeError, UnicodeDecodeError):
                sep = ""
            if not sep or not user:
                raise CredentialError(f"docker config {path}: auths[{key!r}].auth is not base64 of USER:PASSWORD; run `docker login {host}` again")
            return Credentials(user, password, "docker config.json")
    if "credsStore" in config:
        return _cred_helper(config["credsStore"], host, path)
    return None


# --- the client ---------------------------------------------------------------------------


def _challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _, rest = header.strip().partition(" ")
    return scheme.lower(), {k.lower(): v for k, v in re.findall(r'(\w+)="([^"]*)"', rest)}


def _registry_message(resp: httpx.Response) -> str:
    try:
        errors = resp.json().get("errors") or []
        if errors:
            e = errors[0]
            return redact(f"{e.get('code', '')}: {e.get('message', '')}".strip(": "))[:300]
    except (ValueError, AttributeError, httpx.ResponseNotRead):
        pass
    return resp.reason_phrase or ""


class RegistryClient:
    """The handful of distribution-API calls kvsnap needs, with auth, against one repository."""

    def __init__(self, ref: Reference, plain_http: bool | None = None, credentials: Credentials | None | bool = True, push: bool = False, transport: httpx.BaseTransport | None = None):
        self.ref = ref
        self.plain_http = default_plain_http(ref.host) if plain_http is None else plain_http
        self.base = f"{'http' if self.plain_http else 'https'}://{ref.host}/v2/{ref.repo}"
        self.credential_problem: CredentialError | None = None
        if credentials is True:
            credentials = ref.credentials or self._lookup_credentials()
        self.credentials = credentials or None
        self.scope = f"repository:{ref.repo}:{'pull,push' if push else 'pull'}"
        self._auth: str | None = None
        self.client = httpx.Client(timeout=TIMEOUT, follow_redirects=True, transport=transport, trust_env=False)

    def __enter__(self) -> "RegistryClient":
        return self

    def __exit__(self, *exc) -> None:
        self.client.close()

    # -- transport and auth --

    def _lookup_credentials(self) -> Credentials | None:
        """Configured credentials; a broken config or helper is logged now and named again if the registry asks for a login."""
        try:
            return find_credentials(self.ref.host)
        except CredentialError as exc:
            log.warning("[kvsnap] %s; going on without credentials", exc)
            self.credential_problem = exc
            return None

    def _send(self, method: str, url: str, headers: dict | None, content: Callable[[], object] | None, stream: bool) -> httpx.Response:
        h = dict(headers or {})
        if self._auth:
            h["Authorization"] = self._auth
        request = self.client.build_request(method, url, headers=h, content=content() if content else None)
        try:
            return self.client.send(request, stream=stream)
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from None

    def _unreachable(self, exc: Exception) -> RegistryUnreachableError:
        text = redact(str(exc)) or type(exc).__name__
        hint = "check the address and that the registry is up"
        if not self.plain_http and re.search(r"ssl|tls|certificate|wrong version", text, re.I):
            hint = "the registry may speak plain HTTP: add --plain-http (or set KVSNAP_REGISTRY_PLAIN_HTTP=1)"
        return RegistryUnreachableError(f"cannot reach registry {self.ref.host} ({type(exc).__name__}: {text[:200]}); {hint}")

    def _authenticate(self, header: str) -> None:
        scheme, params = _challenge(header)
        creds = self.credentials
        if scheme == "basic":
            if creds is None:
                raise self._needs_credentials()
            self._auth = creds.basic()
            return
        if scheme != "bearer" or not params.get("realm"):
            raise RegistryAuthError(f"registry {self.ref.host} answered 401 with an auth scheme kvsnap does not speak ({scheme or 'none'}); use a registry with Basic or Bearer token auth")
        scopes = [s for s in dict.fromkeys([params.get("scope", ""), self.scope]) if s]
        query = [("scope", s) for s in scopes] + ([("service", params["service"])] if params.get("service") else [])
        headers = {"Authorization": creds.basic()} if creds else {}
        try:
            resp = self.client.get(params["realm"], params=query, headers=headers)
        except httpx.TransportError as exc:
            raise RegistryUnreachableError(f"cannot reach the token service of registry {self.ref.host} ({type(exc).__name__}); check the network") from None
        if resp.status_code in (401, 403):
            raise self._refused() if creds else self._needs_credentials()
        if resp.status_code != 200:
            raise RegistryAuthError(f"the token service of registry {self.ref.host} answered HTTP {resp.status_code}; check the registry's auth setup")
        try:
            body = resp.json()
            token = body.get("token") or body.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not token:
            raise RegistryAuthError(f"the token service of registry {self.ref.host} sent no token; check the registry's auth setup")
        self._auth = f"Bearer {token}"

    def _needs_credentials(self) -> RegistryAuthError:
        if self.credential_problem is not None:
            return CredentialError(f"registry {self.ref.host} needs credentials (HTTP 401), and none could be read: {self.credential_problem}")
        return RegistryAuthError(f"registry {self.ref.host} needs credentials (HTTP 401); set {ENV_USER} and {ENV_PASSWORD}, or run `docker login {self.ref.host}`")

    def _refused(self) -> RegistryAuthError:
        where = self.credentials.source if self.credentials else "none given"
        return RegistryAuthError(f"registry {self.ref.host} refused the credentials from {where} (HTTP 401) for {self.ref.repo}; check the user name and password")

    def request(self, method: str, url: str, headers: dict | None = None, content: Callable[[], object] | None = None, stream: bool = False, ok: tuple[int, ...] = (200,)) -> httpx.Response:
        """One call; answers a 401 challenge once. Returns the response if its status is in ``ok`` or 404."""
        resp = self._send(method, url, headers, content, stream)
        if resp.status_code == 401:
            had_auth = self._auth
            challenge = resp.headers.get("WWW-Authenticate", "")
            resp.close()
            if had_auth and _challenge(challenge)[0] == "basic":
                raise self._refused()
            self._authenticate(challenge)
            resp = self._send(method, url, headers, content, stream)
            if resp.status_code == 401:
                resp.close()
                raise self._refused() if self.credentials else self._needs_credentials()
        if resp.status_code == 403:
            resp.close()
            raise RegistryAuthError(f"registry {self.ref.host} denied {method} on {self.ref.repo} (HTTP 403); check that these credentials may {'push to' if 'push' in self.scope else 'pull from'} it")
        if resp.status_code not in ok and resp.status_code != 404:
            if stream:
                resp.read()
            resp.close()
            raise RegistryError(f"registry {self.ref.host} answered HTTP {resp.status_code} to {method} {httpx.URL(url).path} ({_registry_message(resp)})")
        return resp

    # -- blobs --

    def blob_exists(self, digest: str) -> bool:
        resp = self.request("HEAD", f"{self.base}/blobs/{digest}")
        return resp.status_code == 200

    def upload_blob(self, digest: str, size: int, opener: Callable[[], BinaryIO]) -> None:
        """Monolithic upload: POST for a session, then PUT the bytes with ``?digest=``; the registry checks the digest."""
        resp = self.request("POST", f"{self.base}/blobs/uploads/", headers={"Content-Length": "0"}, ok=(202,))
        if resp.status_code == 404:
            raise ArtifactNotFoundError(f"registry {self.ref.host} has no repository {self.ref.repo} and would not start an upload (HTTP 404); check the name")
        location = resp.headers.get("Location")
        if not location:
            raise RegistryError(f"registry {self.ref.host} started an upload without a Location; it does not follow the distribution API")
        url = httpx.URL(self.base).join(location).copy_merge_params({"digest": digest})

        def body():
            def chunks():
                with opener() as fh:
                    while chunk := fh.read(CHUNK):
                        yield chunk

            return chunks()

        put = self.request("PUT", str(url), headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)}, content=body, ok=(201,))
        if put.status_code == 404:
            raise RegistryError(f"registry {self.ref.host} lost the upload session of {digest} (HTTP 404); push again")

    def download_blob(self, digest: str, size: int, out: BinaryIO, what: str) -> None:
        """Stream a blob into ``out``, checking its size and sha256 as it arrives."""
        resp = self.request("GET", f"{self.base}/blobs/{digest}", stream=True)
        try:
            if resp.status_code == 404:
                raise ArtifactNotFoundError(f"{self.ref}: blob {digest} ({what}) is listed in the manifest but missing from the registry; push the store again")
            h = hashlib.sha256()
            got = 0
            try:
                for chunk in resp.iter_bytes(CHUNK):
                    got += len(chunk)
                    if got > size:
                        break
                    h.update(chunk)
                    out.write(chunk)
            except httpx.TransportError as exc:
                raise self._unreachable(exc) from None
        finally:
            resp.close()
        actual = "sha256:" + h.hexdigest()
        if got != size:
            raise DigestMismatchError(f"{self.ref}: blob {digest} ({what}) is {'over ' if got > size else ''}{got} bytes, not the {size} its manifest says (tampered or corrupt in the registry); refusing it")
        if actual != digest:
            raise DigestMismatchError(f"{self.ref}: blob {digest} ({what}) hashes to {actual} (tampered or corrupt in the registry); refusing it")

    # -- manifests --

    def put_manifest(self, tag: str, body: bytes) -> str:
        resp = self.request("PUT", f"{self.base}/manifests/{tag}", headers={"Content-Type": OCI_MANIFEST}, content=lambda: body, ok=(201,))
        if resp.status_code == 404:
            raise RegistryError(f"registry {self.ref.host} refused the manifest for {self.ref.repo}:{tag} (HTTP 404: {_registry_message(resp)})")
        return resp.headers.get("Docker-Content-Digest") or "sha256:" + hashlib.sha256(body).hexdigest()

    def get_manifest(self) -> tuple[bytes, str]:
        accept = ", ".join((OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST))
        resp = self.request("GET", f"{self.base}/manifests/{self.ref.reference}", headers={"Accept": accept}, stream=True)
        try:
            if resp.status_code == 404:
                resp.read()
                message = _registry_message(resp)
                if "NAME_UNKNOWN" in message:
                    raise ArtifactNotFoundError(f"{self.ref}: registry {self.ref.host} has no repository {self.ref.repo}; check the name, or push it first with `kvsnap push`")
                raise ArtifactNotFoundError(f"{self.ref}: {'tag ' + self.ref.tag if self.ref.tag else self.ref.digest} not found in {self.ref.host}/{self.ref.repo}; check the tag, or push it first with `kvsnap push`")
            body = b""
            for chunk in resp.iter_bytes():
                body += chunk
                if len(body) > MAX_MANIFEST_BYTES:
                    raise RegistryError(f"{self.ref}: the manifest is over {MAX_MANIFEST_BYTES} bytes; not a kvsnap store")
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from None
        finally:
            resp.close()
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        expected = self.ref.digest or resp.headers.get("Docker-Content-Digest")
        if expected and expected != digest:
            raise DigestMismatchError(f"{self.ref}: the manifest hashes to {digest}, not {expected} (tampered or corrupt); refusing it")
        return body, digest


# --- push ---------------------------------------------------------------------------------


@dataclass
class Layer:
    relpath: str
    digest: str
    size: int


@dataclass
class PushReport:
    ref: Reference
    manifest_digest: str
    uploaded: list[str] = field(default_factory=list)  # relpaths (and "config") sent
    skipped: list[str] = field(default_factory=list)  # already in the registry
    uploaded_bytes: int = 0


def artifact_manifest(layers: list[Layer]) -> bytes:
    doc = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": ARTIFACT_TYPE,
        "config": EMPTY_CONFIG,
        "layers": [
            {"mediaType": MANIFEST_MEDIA_TYPE if l.relpath == MANIFEST else SNAPSHOT_MEDIA_TYPE, "digest": l.digest, "size": l.size, "annotations": {TITLE: l.relpath}}
            for l in layers
        ],
        "annotations": {"io.kvsnap.version": __version__},  # no timestamp: an unchanged store pushes the same manifest digest
    }
    return json.dumps(doc, indent=1).encode()


def push(root: str | os.PathLike, ref: Reference, plain_http: bool | None = None, credentials: Credentials | None | bool = True, transport: httpx.BaseTransport | None = None) -> PushReport:
    """Verify the store, upload the blobs the registry lacks, then tag the manifest."""
    if not ref.tag:
        raise UsageError(f"{ref}: push needs a tag (oci://HOST/REPO:TAG), not a digest")
    files = collect_store(root)
    layers = []
    for f in files:
        with open_checked(f):
            layers.append(Layer(f.relpath, sha256_file(f.path), f.size))
    by_path = {f.relpath: f for f in files}
    report = PushReport(ref, "")
    with RegistryClient(ref, plain_http, credentials, push=True, transport=transport) as client:
        blobs: list[tuple[str, str, int, Callable[[], BinaryIO]]] = [("config", EMPTY_CONFIG["digest"], EMPTY_CONFIG["size"], lambda: _BytesOpener(EMPTY_JSON))]
        blobs += [(l.relpath, l.digest, l.size, (lambda f=by_path[l.relpath]: open_checked(f))) for l in layers]
        seen: set[str] = set()
        for name, digest, size, opener in blobs:
            if digest in seen or client.blob_exists(digest):
                report.skipped.append(name)
            else:
                client.upload_blob(digest, size, opener)
                report.uploaded.append(name)
                report.uploaded_bytes += size
            seen.add(digest)
        report.manifest_digest = client.put_manifest(ref.tag, artifact_manifest(layers))
    return report


class _BytesOpener:
    def __init__(self, data: bytes):
        self.data = data

    def __enter__(self):
        import io

        return io.BytesIO(self.data)

    def __exit__(self, *exc):
        return None


# --- pull ---------------------------------------------------------------------------------


@dataclass
class PullReport:
    ref: Reference
    dest: Path
    manifest_digest: str
    downloaded: list[str] = field(default_factory=list)
    present: list[str] = field(default_factory=list)
    downloaded_bytes: int = 0


def parse_artifact(body: bytes, ref: Reference) -> list[Layer]:
    """The layers of a kvsnap store manifest, each with a checked digest, size and store path."""
    try:
        doc = json.loads(body)
    except ValueError:
        raise RegistryError(f"{ref}: the manifest is not JSON; not a kvsnap store") from None
    if not isinstance(doc, dict):
        raise RegistryError(f"{ref}: the manifest is not a JSON object; not a kvsnap store")
    media = doc.get("mediaType")
    if media == OCI_INDEX or "manifests" in doc:
        raise RegistryError(f"{ref} is an image index, not a kvsnap store; give the tag `kvsnap push` wrote")
    config = doc.get("config") if isinstance(doc.get("config"), dict) else {}
    if doc.get("artifactType") != ARTIFACT_TYPE and config.get("mediaType") != ARTIFACT_TYPE:
        kind = str(doc.get("artifactType") or config.get("mediaType") or media or "unknown")[:100]
        raise RegistryError(f"{ref} is not a kvsnap store (its type is {kind!r}); give a tag written by `kvsnap push`")
    raw_layers = doc.get("layers")
    if not isinstance(raw_layers, list) or not raw_layers:
        raise RegistryError(f"{ref}: the manifest lists no files; push the store again")
    layers: list[Layer] = []
    seen: set[str] = set()
    for i, layer in enumerate(raw_layers):
        if not isinstance(layer, dict):
            raise RegistryError(f"{ref}: layer {i} is not a JSON object; not a kvsnap store")
        title = (layer.get("annotations") or {}).get(TITLE) if isinstance(layer.get("annotations"), dict) else None
        if not isinstance(title, str):
            raise RegistryError(f"{ref}: layer {i} has no {TITLE} annotation; not a kvsnap store")
        try:
            check_relpath(title, f"{ref}: layer {i}")
        except ShipError as exc:
            raise RegistryError(str(exc)) from None
        digest, size = layer.get("digest"), layer.get("size")
        if not isinstance(digest, str) or not DIGEST_RE.fullmatch(digest):
            raise RegistryError(f"{ref}: layer {title} has digest {digest!r}, not a sha256 digest; refusing it")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise RegistryError(f"{ref}: layer {title} has size {size!r}; refusing it")
        if title in seen:
            raise RegistryError(f"{ref}: {title} is listed twice; refusing it")
        seen.add(title)
        layers.append(Layer(title, digest, size))
    return layers


def pull(ref: Reference, dest: str | os.PathLike, plain_http: bool | None = None, credentials: Credentials | None | bool = True, transport: httpx.BaseTransport | None = None) -> PullReport:
    """Fetch the manifest, download what ``dest`` lacks into a temp folder, verify all, move it in."""
    dest_path = check_destination(dest)  # before any network call
    with RegistryClient(ref, plain_http, credentials, transport=transport) as client:
        body, digest = client.get_manifest()
        layers = parse_artifact(body, ref)
        report = PullReport(ref, dest_path, digest)
        have = [l for l in layers if present_with_digest(dest_path / l.relpath, l.size, l.digest)]
        with StagedInstall(dest_path) as staging:
            try:
                for layer in layers:
                    if layer in have:
                        report.present.append(layer.relpath)
                        continue
                    with staging.open(layer.relpath) as out:
                        client.download_blob(layer.digest, layer.size, out, layer.relpath)
                    report.downloaded.append(layer.relpath)
                    report.downloaded_bytes += layer.size
            except RegistryError as exc:
                raise type(exc)(f"{exc}; nothing was changed in {dest_path}") from None
            staging.verify(str(ref))
            _verify_present(dest_path, [l.relpath for l in have], ref)
            staging.commit()
    return report


def _verify_present(root: Path, relpaths: list[str], ref: Reference) -> None:
    """Files already in place matched their blob's sha256; still run their own kvsnap checks."""
    if not relpaths:
        return
    store = Store(root=root.resolve(), readonly=True)
    for relpath in relpaths:
        try:
            if relpath == MANIFEST:
                read_manifest_file(store.root / MANIFEST, f"refusing it (nothing was changed in {root})")
            else:
                store.verify_file(store.root / relpath)
        except ManifestError as exc:
            raise ShipError(f"{ref}: {exc}") from None
        except SnapshotError as exc:
            raise ShipError(f"{ref}: {relpath}: {exc.reason}; refusing it (nothing was changed in {root})") from None


# --- serve --kv-snapshots oci://… -----------------------------------------------------------


def resolve_kv_snapshots(value: str | None) -> str | None:
    """``--kv-snapshots``: a folder stays as it is; ``oci://…`` is pulled into the cache folder first.

    The cache folder is ``$KVSNAP_CACHE_DIR/oci/<host>/<repo>/<tag>`` (else
    ``~/.cache/kvsnap/oci/…``); files already there are reused. If the registry cannot be
    reached and an earlier pull left a store there, the server starts from that copy (a
    snapshot is keyed by model and prompt, so an older copy can only be colder, never wrong).
    """
    if not value or not value.startswith("oci://"):
        return value
    ref = Reference.parse(value)
    dest = ref.cache_dir()
    try:
        report = pull(ref, dest)
    except RegistryUnreachableError as exc:
        if dest.is_dir() and Store(root=dest).is_initialized():
            log.warning("[kvsnap] %s; starting from the copy pulled earlier into %s", exc, dest)
            return str(dest)
        raise
    log.info(
        "[kvsnap] pulled %s (%s) into %s: %d file(s) downloaded (%d bytes), %d already there",
        ref, report.manifest_digest[:19], dest, len(report.downloaded), report.downloaded_bytes, len(report.present),
    )
    return str(dest)
