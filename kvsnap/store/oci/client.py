"""The handful of distribution-API calls kvsnap needs, over httpx, against one repository.

HEAD/GET a blob, a monolithic blob upload (POST, then PUT with ``?digest=``), PUT/GET a
manifest; auth by the ``WWW-Authenticate`` challenge (Basic, or the Bearer token flow).
Blobs stream in both directions; a download is checked for size and sha256 as it arrives.
Every message quotes a registry's answer only through ``redact``.
"""

from __future__ import annotations

import hashlib
import logging
import re
from typing import Any, BinaryIO, Callable, ContextManager

import httpx

from kvsnap.store.fileio import CHUNK
from kvsnap.store.oci.artifact import DOCKER_MANIFEST, MAX_MANIFEST_BYTES, OCI_INDEX, OCI_MANIFEST
from kvsnap.store.oci.credentials import ENV_PASSWORD, ENV_USER, Credentials, find_credentials
from kvsnap.store.oci.deadlines import (
    ENV_IDLE,
    ENV_MIN_RATE,
    ENV_TIMEOUT,
    Deadlines,
    RequestClock,
    deadline_transport,
)
from kvsnap.store.oci.errors import (
    ArtifactNotFoundError,
    CredentialError,
    DigestMismatchError,
    RegistryAuthError,
    RegistryError,
    RegistryUnreachableError,
)
from kvsnap.store.oci.reference import Reference, default_plain_http
from kvsnap.store.remote import redact

log = logging.getLogger("kvsnap")

CONNECT_TIMEOUT = 10.0
REDIRECTS = (301, 302, 303, 307, 308)
MAX_REDIRECTS = 5
DEFAULT_PORTS = {"http": 80, "https": 443}


def origin_of(url: httpx.URL | str) -> str:
    """``scheme://host:port`` with the default port written out: what credentials are bound to."""
    url = httpx.URL(url)
    return f"{url.scheme}://{url.host}:{url.port or DEFAULT_PORTS.get(url.scheme, 0)}"


def is_same_origin(url: httpx.URL | str, base: httpx.URL | str) -> bool:
    return origin_of(url) == origin_of(base)


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

    def __init__(
        self,
        ref: Reference,
        plain_http: bool | None = None,
        credentials: Credentials | None | bool = True,
        push: bool = False,
        transport: httpx.BaseTransport | None = None,
        deadlines: Deadlines | None = None,
    ):
        self.ref = ref
        self.deadlines = deadlines or Deadlines.from_env()
        self.clock = RequestClock()
        self.plain_http = default_plain_http(ref.host) if plain_http is None else plain_http
        self.base = f"{'http' if self.plain_http else 'https'}://{ref.host}/v2/{ref.repo}"
        self.credential_problem: CredentialError | None = None
        if credentials is True:
            credentials = ref.credentials or self._lookup_credentials()
        self.credentials = credentials or None
        self.scope = f"repository:{ref.repo}:{'pull,push' if push else 'pull'}"
        self._auth: str | None = None
        idle = self.deadlines.idle_s
        timeout = httpx.Timeout(idle, connect=min(idle, CONNECT_TIMEOUT))
        # every read also bounded by the request's deadline
        transport = transport or deadline_transport(self.clock)
        self.client = httpx.Client(
            timeout=timeout, follow_redirects=False, transport=transport, trust_env=False
        )

    def __enter__(self) -> "RegistryClient":
        return self

    def __exit__(self, *exc) -> None:
        self.client.close()

    # -- transport and auth --

    def _lookup_credentials(self) -> Credentials | None:
        """Configured credentials; a broken config or helper is logged now and named again if the
        registry asks for a login."""
        try:
            return find_credentials(self.ref.host)
        except CredentialError as exc:
            log.warning("[kvsnap] %s; going on without credentials", exc)
            self.credential_problem = exc
            return None

    def _send(
        self,
        method: str,
        url: str,
        headers: dict | None,
        content: Callable[[], Any] | None,
        stream: bool,
    ) -> httpx.Response:
        """One call, following redirects itself: credentials go only to the registry's own origin
        (scheme, host, port), never to a host it redirects to, and https never drops to http."""
        for _ in range(MAX_REDIRECTS + 1):
            h = dict(headers or {})
            if self._auth and is_same_origin(url, self.base):
                h["Authorization"] = self._auth
            request = self.client.build_request(
                method, url, headers=h, content=content() if content else None
            )
            try:
                resp = self.client.send(request, stream=stream)
            except httpx.TransportError as exc:
                raise self._unreachable(exc) from None
            location = resp.headers.get("Location")
            if resp.status_code not in REDIRECTS or not location:
                return resp
            resp.close()
            target = httpx.URL(url).join(location)
            if httpx.URL(url).scheme == "https" and target.scheme != "https":
                raise RegistryError(
                    f"registry {self.ref.host} redirected {method} {httpx.URL(url).path} from "
                    f"https to plain http ({origin_of(target)}); refusing it (nothing is sent over "
                    f"plain http after https)"
                )
            method = "GET" if resp.status_code == 303 and method != "HEAD" else method
            url = str(target)
        raise RegistryError(
            f"registry {self.ref.host} redirected {method} more than {MAX_REDIRECTS} times; check "
            f"the registry's setup"
        )

    def _unreachable(self, exc: Exception) -> RegistryUnreachableError:
        if self.clock.expired():
            d = self.deadlines
            return RegistryUnreachableError(
                f"registry {self.ref.host} did not finish a request within its deadline of "
                f"{self.clock.seconds:.0f} s "
                f"({d.total_s:g} s + its bytes at {d.min_rate:g} bytes/s); a slow or stalled "
                f"registry; raise it with "
                f"--registry-timeout / --registry-min-rate (or ${ENV_TIMEOUT} / ${ENV_MIN_RATE})"
            )
        if isinstance(exc, httpx.TimeoutException):
            return RegistryUnreachableError(
                f"registry {self.ref.host} sent nothing for {self.deadlines.idle_s:g} s "
                f"({type(exc).__name__}); "
                f"a stalled registry; raise it with --registry-idle-timeout (or ${ENV_IDLE})"
            )
        text = redact(str(exc)) or type(exc).__name__
        hint = "check the address and that the registry is up"
        if not self.plain_http and re.search(r"ssl|tls|certificate|wrong version", text, re.I):
            hint = (
                "the registry may speak plain HTTP: add --plain-http (or set "
                "KVSNAP_REGISTRY_PLAIN_HTTP=1)"
            )
        return RegistryUnreachableError(
            f"cannot reach registry {self.ref.host} ({type(exc).__name__}: {text[:200]}); {hint}"
        )

    def _authenticate(self, header: str) -> None:
        """Answer a 401 challenge: Basic with the credentials, or a token from the Bearer realm."""
        scheme, params = _challenge(header)
        if scheme == "basic":
            if self.credentials is None:
                raise self._needs_credentials()
            self._auth = self.credentials.basic()
            return
        if scheme != "bearer" or not params.get("realm"):
            raise RegistryAuthError(
                f"registry {self.ref.host} answered 401 with an auth scheme kvsnap does not speak "
                f"({scheme or 'none'}); use a registry with Basic or Bearer token auth"
            )
        self._auth = f"Bearer {self._bearer_token(params)}"

    def _bearer_token(self, params: dict[str, str]) -> str:
        """The token flow: ask the realm for this repository's scope, with Basic credentials if
        there are any."""
        creds = self.credentials
        realm = httpx.URL(params["realm"])
        if httpx.URL(self.base).scheme == "https" and realm.scheme != "https":
            raise RegistryAuthError(
                f"registry {self.ref.host} (https) names a plain-http token service "
                f"{origin_of(realm)}; refusing to send credentials there; check the registry's "
                f"auth setup"
            )
        scopes = [s for s in dict.fromkeys([params.get("scope", ""), self.scope]) if s]
        query: list[tuple[str, str | int | float | bool | None]] = [("scope", s) for s in scopes]
        query += [("service", params["service"])] if params.get("service") else []
        headers = {"Authorization": creds.basic()} if creds else {}
        try:
            resp = self.client.get(params["realm"], params=query, headers=headers)
        except httpx.TransportError as exc:
            raise RegistryUnreachableError(
                f"cannot reach the token service of registry {self.ref.host} "
                f"({type(exc).__name__}); check the network"
            ) from None
        if resp.status_code in (401, 403):
            raise self._refused() if creds else self._needs_credentials()
        if resp.status_code != 200:
            raise RegistryAuthError(
                f"the token service of registry {self.ref.host} answered HTTP {resp.status_code}; "
                f"check the registry's auth setup"
            )
        try:
            body = resp.json()
            token = body.get("token") or body.get("access_token")
        except (ValueError, AttributeError):
            token = None
        if not token:
            raise RegistryAuthError(
                f"the token service of registry {self.ref.host} sent no token; check the "
                f"registry's auth setup"
            )
        return token

    def _needs_credentials(self) -> RegistryAuthError:
        if self.credential_problem is not None:
            return CredentialError(
                f"registry {self.ref.host} needs credentials (HTTP 401), and none could be read: "
                f"{self.credential_problem}"
            )
        return RegistryAuthError(
            f"registry {self.ref.host} needs credentials (HTTP 401); set {ENV_USER} and "
            f"{ENV_PASSWORD}, or run `docker login {self.ref.host}`"
        )

    def _refused(self) -> RegistryAuthError:
        where = self.credentials.source if self.credentials else "none given"
        return RegistryAuthError(
            f"registry {self.ref.host} refused the credentials from {where} (HTTP 401) for "
            f"{self.ref.repo}; check the user name and password"
        )

    def _foreign_401(self, resp: httpx.Response, method: str) -> RegistryAuthError:
        """A 401 from a host the registry redirected to: never answered with the registry's
        credentials."""
        resp.close()
        return RegistryAuthError(
            f"{origin_of(resp.request.url)}, where registry {self.ref.host} redirected {method}, "
            f"answered HTTP 401; "
            f"kvsnap sends credentials only to {origin_of(httpx.URL(self.base))}, so it refuses to "
            f"log in there; "
            "check the registry's storage redirect setup"
        )

    def request(
        self,
        method: str,
        url: str,
        headers: dict | None = None,
        content: Callable[[], Any] | None = None,
        stream: bool = False,
        ok: tuple[int, ...] = (200,),
        nbytes: int = 0,
    ) -> httpx.Response:
        """One call; answers a 401 challenge once. Returns the response if its status is in ``ok``
        or 404.
        The whole call, body included, runs under one deadline sized for ``nbytes``."""
        self.clock.start(self.deadlines.seconds_for(nbytes))
        resp = self._send(method, url, headers, content, stream)
        if resp.status_code == 401 and not is_same_origin(resp.request.url, self.base):
            raise self._foreign_401(resp, method)
        if resp.status_code == 401:
            had_auth = self._auth
            challenge = resp.headers.get("WWW-Authenticate", "")
            resp.close()
            if had_auth and _challenge(challenge)[0] == "basic":
                raise self._refused()
            self._authenticate(challenge)
            resp = self._send(method, url, headers, content, stream)
            if resp.status_code == 401 and not is_same_origin(resp.request.url, self.base):
                raise self._foreign_401(resp, method)
            if resp.status_code == 401:
                resp.close()
                raise self._refused() if self.credentials else self._needs_credentials()
        if resp.status_code == 403:
            resp.close()
            raise RegistryAuthError(
                f"registry {self.ref.host} denied {method} on {self.ref.repo} (HTTP 403); check "
                f"that these credentials may {'push to' if 'push' in self.scope else 'pull from'} "
                f"it"
            )
        if resp.status_code not in ok and resp.status_code != 404:
            if stream:
                resp.read()
            resp.close()
            raise RegistryError(
                f"registry {self.ref.host} answered HTTP {resp.status_code} to {method} "
                f"{httpx.URL(url).path} ({_registry_message(resp)})"
            )
        return resp

    # -- blobs --

    def blob_exists(self, digest: str) -> bool:
        resp = self.request("HEAD", f"{self.base}/blobs/{digest}")
        return resp.status_code == 200

    def blobs_exist(self, digests: list[str], workers: int = 8) -> dict[str, bool]:
        """HEAD each blob, up to ``workers`` at once (a store of blocks has thousands). The first
        goes alone, so a token the registry asks for is fetched once, not by every thread."""
        from concurrent.futures import ThreadPoolExecutor

        unique = list(dict.fromkeys(digests))
        if not unique:
            return {}
        found = {unique[0]: self.blob_exists(unique[0])}
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvsnap-head") as pool:
            found.update(zip(unique[1:], pool.map(self.blob_exists, unique[1:])))
        return found

    def upload_blob(
        self,
        digest: str,
        size: int,
        opener: Callable[[], ContextManager[BinaryIO]],
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        """Monolithic upload: POST for a session, then PUT the bytes with ``?digest=``; the
        registry checks the digest. ``on_bytes(n)`` after each chunk sent; a body sent again
        (after an auth challenge) reports only bytes past those already reported."""
        resp = self.request(
            "POST", f"{self.base}/blobs/uploads/", headers={"Content-Length": "0"}, ok=(202,)
        )
        if resp.status_code == 404:
            raise ArtifactNotFoundError(
                f"registry {self.ref.host} has no repository {self.ref.repo} and would not start "
                f"an upload (HTTP 404); check the name"
            )
        location = resp.headers.get("Location")
        if not location:
            raise RegistryError(
                f"registry {self.ref.host} started an upload without a Location; it does not "
                f"follow the distribution API"
            )
        url = httpx.URL(self.base).join(location).copy_merge_params({"digest": digest})
        reported = 0

        def body():
            def chunks():
                nonlocal reported
                sent = 0
                with opener() as fh:
                    while chunk := fh.read(CHUNK):
                        yield chunk
                        sent += len(chunk)
                        if on_bytes is not None and sent > reported:
                            on_bytes(sent - reported)
                            reported = sent

            return chunks()

        put = self.request(
            "PUT",
            str(url),
            headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)},
            content=body,
            ok=(201,),
            nbytes=size,
        )
        if put.status_code == 404:
            raise RegistryError(
                f"registry {self.ref.host} lost the upload session of {digest} (HTTP 404); push "
                f"again"
            )

    def download_blob(
        self,
        digest: str,
        size: int,
        out: BinaryIO,
        what: str,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        """Stream a blob into ``out``, checking its size and sha256 as it arrives;
        ``on_bytes(n)`` after each chunk written."""
        resp = self.request("GET", f"{self.base}/blobs/{digest}", stream=True, nbytes=size)
        try:
            if resp.status_code == 404:
                raise ArtifactNotFoundError(
                    f"{self.ref}: blob {digest} ({what}) is listed in the manifest but missing "
                    f"from the registry; push the store again"
                )
            declared = resp.headers.get("Content-Length", "")
            if declared.isdigit() and int(declared) > size:
                raise DigestMismatchError(
                    f"{self.ref}: blob {digest} ({what}) is sent as {declared} bytes, not the "
                    f"{size} its manifest says (tampered or corrupt in the registry); refusing it"
                )
            h = hashlib.sha256()
            got = 0
            try:
                for chunk in resp.iter_bytes(CHUNK):
                    got += len(chunk)
                    if got > size:
                        break
                    h.update(chunk)
                    out.write(chunk)
                    if on_bytes is not None:
                        on_bytes(len(chunk))
            except httpx.TransportError as exc:
                raise self._unreachable(exc) from None
        finally:
            resp.close()
        actual = "sha256:" + h.hexdigest()
        if got != size:
            raise DigestMismatchError(
                f"{self.ref}: blob {digest} ({what}) is {'over ' if got > size else ''}{got} "
                f"bytes, not the {size} its manifest says (tampered or corrupt in the registry); "
                f"refusing it"
            )
        if actual != digest:
            raise DigestMismatchError(
                f"{self.ref}: blob {digest} ({what}) hashes to {actual} (tampered or corrupt in "
                f"the registry); refusing it"
            )

    # -- manifests --

    def put_manifest(self, tag: str, body: bytes) -> str:
        resp = self.request(
            "PUT",
            f"{self.base}/manifests/{tag}",
            headers={"Content-Type": OCI_MANIFEST},
            content=lambda: body,
            ok=(201,),
        )
        if resp.status_code == 404:
            raise RegistryError(
                f"registry {self.ref.host} refused the manifest for {self.ref.repo}:{tag} (HTTP "
                f"404: {_registry_message(resp)})"
            )
        return (
            resp.headers.get("Docker-Content-Digest")
            or "sha256:" + hashlib.sha256(body).hexdigest()
        )

    def get_manifest(self) -> tuple[bytes, str]:
        accept = ", ".join((OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST))
        resp = self.request(
            "GET",
            f"{self.base}/manifests/{self.ref.reference}",
            headers={"Accept": accept},
            stream=True,
        )
        try:
            if resp.status_code == 404:
                resp.read()
                message = _registry_message(resp)
                if "NAME_UNKNOWN" in message:
                    raise ArtifactNotFoundError(
                        f"{self.ref}: registry {self.ref.host} has no repository {self.ref.repo}; "
                        f"check the name, or push it first with `kvsnap push`"
                    )
                raise ArtifactNotFoundError(
                    f"{self.ref}: {'tag ' + self.ref.tag if self.ref.tag else self.ref.digest} not "
                    f"found in {self.ref.host}/{self.ref.repo}; check the tag, or push it first "
                    f"with `kvsnap push`"
                )
            body = b""
            for chunk in resp.iter_bytes():
                body += chunk
                if len(body) > MAX_MANIFEST_BYTES:
                    raise RegistryError(
                        f"{self.ref}: the manifest is over {MAX_MANIFEST_BYTES} bytes; not a "
                        f"kvsnap store"
                    )
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from None
        finally:
            resp.close()
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        expected = self.ref.digest or resp.headers.get("Docker-Content-Digest")
        if expected and expected != digest:
            raise DigestMismatchError(
                f"{self.ref}: the manifest hashes to {digest}, not {expected} (tampered or "
                f"corrupt); refusing it"
            )
        return body, digest
